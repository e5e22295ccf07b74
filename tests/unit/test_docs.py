"""The README and docs/ name only what exists, the README's layout names every module, and
the README fits on a screen (tests/docpaths.py does the reading)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.docpaths import problems

REPO = Path(__file__).resolve().parents[2]


def test_docs_name_only_modules_paths_and_names_that_exist() -> None:
    assert problems(REPO) == []


def test_readme_fits_on_a_screen() -> None:
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def _copy(tmp: Path) -> Path:
    for part in ("kvtier", "connectors", "indexer", "router", "configs", "docs"):
        shutil.copytree(REPO / part, tmp / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("tests", "benchmarks"):
        (tmp / part).mkdir()
    shutil.copy(REPO / "README.md", tmp / "README.md")
    return tmp


def test_negative_control_a_stale_name_and_an_unlisted_module_are_reported(tmp_path: Path) -> None:
    repo = _copy(tmp_path)
    page = repo / "docs" / "planted.md"
    page.write_text("Headers live in `kvtier.ab.live.headers`; leases in `kvtier/leases.py`;\n"
                    "`kvtier/cost/decide.py` `no_such_function` decides.\n")
    (repo / "kvtier" / "tier" / "planted.py").write_text('"""planted"""\n')
    found = "\n".join(problems(repo))
    assert "kvtier.ab.live.headers" in found
    assert "kvtier/leases.py" in found
    assert "no_such_function" in found
    assert "kvtier/tier/planted.py is not named" in found
