"""`kvtier calibrate` (kvtier.ab.live.calibrate) without a stack: the simulated sweep, and the
fitted cost model written with --out."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.ab.live.ab import trace_max_context
from kvtier.ab.live.calibrate import CALIBRATE_WITH, calibration_trace
from kvtier.cli import main
from kvtier.cost.model import CostModel


def test_calibrate_out_writes_the_fitted_cost_model(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cost.json"
    assert main(["calibrate", "--simulate", "--out", str(out)]) == 0
    cost = CostModel.model_validate_json(out.read_text())
    printed = capsys.readouterr().out
    assert f"cost model: {out}" in printed
    assert f"{cost.prefill_a_s * 1e3:.3g} ms" in printed
    assert set(cost.reads) >= {"dp_read", "p2p"} and cost.block_size == 32


def test_calibration_trace_fits_the_context() -> None:
    trace = calibration_trace(2048)
    assert [c.turns[0].new_tokens for c in trace.conversations] == [64, 256, 512]
    assert trace_max_context(trace) < 2048
    assert CALIBRATE_WITH.split(",") == ["recompute", "device-ttl", "host-p2p"]
