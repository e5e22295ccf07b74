"""benchmarks/ab_projection.py: the committed projection table is what its raw reports give."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks/ab/2026-12-06-projection-gpu-mixed"


def test_the_committed_projection_table_regenerates_from_its_raw_reports():
    spec = importlib.util.spec_from_file_location("ab_projection",
                                                  ROOT / "benchmarks/ab_projection.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (RUN / "projection.md").read_text() == mod.table(RUN)
    assert "not run" not in (RUN / "projection.md").read_text()  # every regime, both links
