"""The layer contract and the type check of `./run test` fail when they should.

`./run check` (part of `./run test`) runs import-linter and mypy over the clean tree; these
tests plant one deliberate violation each and show the same tools refuse it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _stage(dest: Path) -> Path:
    """The installed layout, as `run`'s check() arranges it."""
    root = dest / "kvtier"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "kvtier", root, ignore=ignore)
    for sub in ("connectors", "indexer", "router"):
        shutil.copytree(REPO / sub, root / sub, ignore=ignore)
    return root


@pytest.mark.skipif(not (BIN / "lint-imports").exists(), reason="import-linter not installed")
def test_lint_imports_refuses_core_importing_the_router(tmp_path):
    root = _stage(tmp_path)
    model = root / "cost" / "model.py"
    model.write_text(model.read_text() + "\nimport kvtier.router.app  # deliberate violation\n")
    out = subprocess.run([str(BIN / "lint-imports"), str(REPO / "pyproject.toml"), "--no-cache"],
                         cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": str(BIN)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stdout
    assert "kvtier layers BROKEN" in out.stdout
    assert "kvtier.cost.model -> kvtier.router.app" in out.stdout


@pytest.mark.skipif(not (BIN / "mypy").exists(), reason="mypy not installed")
def test_mypy_refuses_a_pod_passed_as_a_conversation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from kvtier.ids import ConversationId, PodId\n\n\n"
        "def close(conversation: ConversationId) -> None:\n    ...\n\n\n"
        "def oops(pod: PodId) -> None:\n    close(pod)  # deliberate violation\n")
    out = subprocess.run([str(BIN / "mypy"), "--config-file", str(REPO / "pyproject.toml"),
                          "--no-incremental", str(bad)],
                         cwd=tmp_path, env={"MYPYPATH": str(REPO), "PATH": str(BIN)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stdout
    assert 'incompatible type "PodId"; expected "ConversationId"' in out.stdout
