"""benchmarks/threads/README.md shows the table benchmarks/thread_cpu.py prints from the
committed JSON (no hand-edited figure), and per-thread rows add up a thread's names."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "benchmarks" / "threads"


def _module():
    spec = importlib.util.spec_from_file_location("thread_cpu", ROOT / "benchmarks" / "thread_cpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_table_is_the_one_the_json_prints() -> None:
    files = [DIR / "2026-12-07-decode-scarce-host-p2p.json",
             DIR / "2026-12-07-decode-scarce-tiered-adaptive.json"]
    assert _module().table(files) in (DIR / "README.md").read_text()


def test_a_thread_renamed_or_reniced_is_one_row() -> None:
    doc = {"seconds": 10.0, "cpu_s": {"decode-0|python|python|tid7|nice0": 1.0,
                                      "decode-0|VLLM::Worker|VLLM::Worker|tid7|nice10": 2.5,
                                      "router|python|kvtier|tid9|nice0": 0.5}}
    rows = _module().per_thread(doc)
    assert rows[0][:3] == (3.5, "decode-0", "tid7")
    assert rows[0][3] == "VLLM::Worker (10), python (0)"
