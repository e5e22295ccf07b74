"""benchmarks/ab_projection.py: the committed projection table is what its raw reports give."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# session 19's (before holds were priced by the odds that decode memory is in use) and the
# current code's
RUNS = (ROOT / "benchmarks/ab/2026-12-06-projection-gpu-mixed",
        ROOT / "benchmarks/ab/2026-12-07-projection-gpu-mixed-pressure-price")


@pytest.mark.parametrize("RUN", RUNS, ids=lambda p: p.name)
def test_the_committed_projection_table_regenerates_from_its_raw_reports(RUN):
    spec = importlib.util.spec_from_file_location("ab_projection",
                                                  ROOT / "benchmarks/ab_projection.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (RUN / "projection.md").read_text() == mod.table(RUN)
    assert "not run" not in (RUN / "projection.md").read_text()  # every regime, both links
