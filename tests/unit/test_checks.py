"""The checks of `./run check` (part of `./run test`) fail when they should.

`./run check` runs ruff over the repository, then import-linter and mypy over the tree arranged
as installed; these tests plant one deliberate violation each and show the same tools refuse
it. The contracts claim to cover every module: the walk below checks that claim against the
files, so a new module in no layer, or a new top-level module missing from the engine
contracts, fails here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Where each installed package's files live in the repository.
INSTALLED = {"kvtier": "kvtier", "kvtier.connectors": "connectors",
             "kvtier.indexer": "indexer", "kvtier.router": "router"}
# The forbidden contracts that must name every top-level module but the connectors.
ENGINE_CONTRACTS = ("only the connectors import vLLM",
                    "torch only in the host tier's worker and the connectors")

needs_lint_imports = pytest.mark.skipif(not (BIN / "lint-imports").exists(),
                                        reason="import-linter not installed")
needs_ruff = pytest.mark.skipif(not (BIN / "ruff").exists(), reason="ruff not installed")


def _stage(dest: Path) -> Path:
    """The installed layout, as `run`'s check() arranges it."""
    root = dest / "kvtier"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "kvtier", root, ignore=ignore)
    for sub in ("connectors", "indexer", "router"):
        shutil.copytree(REPO / sub, root / sub, ignore=ignore)
    return root


def _lint_imports(stage: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "lint-imports"), str(REPO / "pyproject.toml"), "--no-cache"],
                          cwd=stage, env={"PYTHONPATH": str(stage), "PATH": str(BIN)},
                          capture_output=True, text=True, timeout=300)


def _plant(stage: Path, path: str, line: str) -> None:
    module = stage / "kvtier" / path
    module.write_text(module.read_text() + f"\n{line}  # deliberate violation\n")


# -- the contracts cover every module -------------------------------------------------------


def installed_modules(repo: Path) -> set[str]:
    """Every module of the repository's packages, under its installed name."""
    names = set()
    for package, folder in INSTALLED.items():
        for path in (repo / folder).rglob("*.py"):
            parts = path.relative_to(repo / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            # connectors/ etc. also sit inside no kvtier/ folder, so no name is seen twice.
            names.add(".".join((package, *parts)))
    return names


def _contracts(kind: str) -> list[dict[str, Any]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [c for c in config["contracts"] if c["type"] == kind]


def layered(contracts: list[dict[str, Any]]) -> set[str]:
    """The modules the layers contracts name, each standing for itself and its submodules."""
    names = set()
    for contract in contracts:
        containers = contract.get("containers")
        for layer in contract["layers"]:
            for tail in re.split(r"[|:]", layer):
                tail = tail.strip().strip("()")  # "(name)": an optional layer
                names.update([f"{c}.{tail}" for c in containers] if containers else [tail])
    return names


def unlayered(modules: set[str], layers: set[str]) -> list[str]:
    """The modules no layer names (the package root is the container, not a layer)."""
    def covered(m: str) -> bool:
        return any(m == name or m.startswith(name + ".") for name in layers)
    return sorted(m for m in modules if m != "kvtier" and not covered(m))


def unlisted(modules: set[str], sources: list[str]) -> list[str]:
    """Top-level modules but the connectors that a forbidden contract does not name."""
    top = {".".join(m.split(".")[:2]) for m in modules if m != "kvtier"}
    return sorted(top - {"kvtier.connectors"} - set(sources))


def test_every_module_is_in_a_layer():
    modules = installed_modules(REPO)
    # the walk sees the installed names, not the folders
    assert {"kvtier.tier.manager", "kvtier.connectors", "kvtier.router.app",
            "kvtier.indexer.native.build", "kvtier.ab.live"} <= modules
    assert unlayered(modules, layered(_contracts("layers"))) == []


def test_engine_contracts_name_every_top_level_module_but_the_connectors():
    modules = installed_modules(REPO)
    by_name = {c["name"]: c for c in _contracts("forbidden")}
    for name in ENGINE_CONTRACTS:
        assert unlisted(modules, by_name[name]["source_modules"]) == [], name
        assert "kvtier.connectors" not in by_name[name]["source_modules"], name


def test_a_new_module_in_no_layer_or_engine_contract_is_reported(tmp_path):
    """Negative control of the two tests above, on a tree with one module too many."""
    for folder in INSTALLED.values():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "kvtier" / "planted.py").write_text("")
    (tmp_path / "kvtier" / "tier").mkdir()
    (tmp_path / "kvtier" / "tier" / "manager.py").write_text("")
    (tmp_path / "router" / "app.py").write_text("")
    modules = installed_modules(tmp_path)
    assert modules == {"kvtier", "kvtier.planted", "kvtier.tier.manager", "kvtier.connectors",
                       "kvtier.indexer", "kvtier.router", "kvtier.router.app"}
    assert unlayered(modules, layered(_contracts("layers"))) == ["kvtier.planted"]
    by_name = {c["name"]: c for c in _contracts("forbidden")}
    for name in ENGINE_CONTRACTS:
        assert unlisted(modules, by_name[name]["source_modules"]) == ["kvtier.planted"], name
    # a package entry names its submodules; without it, each of them is reported
    assert unlayered(modules, {"kvtier.connectors", "kvtier.indexer", "kvtier.router"}) == [
        "kvtier.planted", "kvtier.tier.manager"]


@needs_lint_imports
@pytest.mark.parametrize(("path", "contract", "module"), [
    ("planted.py", "kvtier layers", "kvtier.planted"),
    ("ab/planted.py", "A/B harness layers", "kvtier.ab.planted"),
])
def test_lint_imports_refuses_a_module_in_no_layer(tmp_path, path, contract, module):
    stage = tmp_path
    _stage(stage)
    (stage / "kvtier" / path).write_text('"""In no layer."""\n')
    out = _lint_imports(stage)
    assert out.returncode != 0, out.stdout
    assert f"{contract} BROKEN" in out.stdout
    assert "The following modules are not listed as layers" in out.stdout
    assert f"- {module}\n" in out.stdout


# -- planted imports -----------------------------------------------------------------------


@needs_lint_imports
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


@needs_lint_imports
@pytest.mark.parametrize(("path", "line", "contract", "link"), [
    # modules that no contract checked before every module had a layer
    ("ab/sizing.py", "import kvtier.router.flow",
     "only the live A/B runner drives the servers", "kvtier.ab.sizing -> kvtier.router.flow"),
    ("ab/stats.py", "import kvtier.ab.live.runner",
     "A/B harness layers", "kvtier.ab.stats -> kvtier.ab.live.runner"),
    ("watchdog.py", "import kvtier.router.app",
     "kvtier layers", "kvtier.watchdog -> kvtier.router.app"),
    ("tier/leases.py", "import vllm.config",
     "only the connectors import vLLM", "kvtier.tier.leases -> vllm"),
    ("tier/manager.py", "import vllm.config",
     "only the connectors import vLLM", "kvtier.tier.manager -> vllm"),
    ("watchdog.py", "import vllm.config",
     "only the connectors import vLLM", "kvtier.watchdog -> vllm"),
    ("tier/manager.py", "import torch",
     "torch only in the host tier's worker and the connectors", "kvtier.tier.manager -> torch"),
    ("router/app.py", "import torch",
     "torch only in the host tier's worker and the connectors", "kvtier.router.app -> torch"),
    ("router/app.py", "import kvtier.tier.worker", "only the host tier's spec and the "
     "connectors build its worker half", "kvtier.router.app -> kvtier.tier.worker"),
    ("tier/manager.py", "import kvtier.tier.cuda_copy", "only the host tier's spec and the "
     "connectors build its worker half", "kvtier.tier.manager -> kvtier.tier.cuda_copy"),
    ("__init__.py", "import vllm",
     "the package root imports no engine", "kvtier -> vllm"),
])
def test_lint_imports_refuses_a_planted_import(tmp_path, path, line, contract, link):
    _stage(tmp_path)
    _plant(tmp_path, path, line)
    out = _lint_imports(tmp_path)
    assert out.returncode != 0, out.stdout
    assert f"{contract} BROKEN" in out.stdout
    assert f"{link} (l." in out.stdout


# -- ruff ----------------------------------------------------------------------------------


def _ruff(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ruff"), "check", "--no-cache", "--output-format", "concise",
                           "--config", str(REPO / "pyproject.toml"), path.name],
                          cwd=path.parent, env={"PATH": str(BIN)},
                          capture_output=True, text=True, timeout=120)


@needs_ruff
@pytest.mark.parametrize(("source", "rule"), [
    ("import os\nimport sys\n\nprint(sys.argv)\n", "F401"),
    ("import sys\nimport os\n\nprint(os.sep, sys.argv)\n", "I001"),
    # kvtier.* is first party even where no kvtier/router/ folder exists (installed names)
    ("import httpx\nfrom kvtier.router.config import RouterConfig\n\nprint(httpx, RouterConfig)\n",
     "I001"),
])
def test_ruff_refuses_a_planted_finding(tmp_path, source, rule):
    (tmp_path / "ok.py").write_text(
        "import sys\n\nimport httpx\n\nfrom kvtier.router.config import RouterConfig\n\n"
        "print(sys.argv, httpx, RouterConfig)\n")
    assert _ruff(tmp_path / "ok.py").returncode == 0, _ruff(tmp_path / "ok.py").stdout
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    out = _ruff(bad)
    assert out.returncode != 0, out.stdout
    assert re.search(rf"^bad\.py:\d+:\d+: {rule} ", out.stdout, re.M), out.stdout


# -- mypy ----------------------------------------------------------------------------------


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
