"""benchmarks/engine_overhead/README.md shows run 3's table as bench_engine_overhead.py --table
prints it from the committed JSON (no hand-edited figure)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "bench_engine_overhead", ROOT / "benchmarks" / "bench_engine_overhead.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_table_is_the_one_the_json_prints() -> None:
    doc = json.loads((ROOT / "benchmarks" / "engine_overhead"
                      / "2026-12-07-run3-current.json").read_text())
    table = _module().table(doc)
    assert table in (ROOT / "benchmarks" / "engine_overhead" / "README.md").read_text()


def test_table_rows_are_medians_per_round() -> None:
    doc = {"median_s": {"a": 0.1}, "rounds": [{"strategy": "a", "latency_s": [0.1, 0.3, 0.2]},
                                              {"strategy": "a", "latency_s": [0.4]}]}
    assert _module().table(doc).splitlines()[-1] == "| a | 100.0 | 200.0, 400.0 |"
