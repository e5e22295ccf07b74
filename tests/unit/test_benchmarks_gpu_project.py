"""benchmarks/gpu/project.py: the H200 / Llama-8B cost model fitted from the GPU runs reproduces
the measured points within the errors its report states, the shipped config is that model, and
the projected TTFT grows with context. CPU only, no timing."""

from __future__ import annotations

import importlib.util
import json
import sys
from itertools import pairwise
from pathlib import Path

import pytest

from kvtier.ab.live.common import sim_fleet
from kvtier.ab.simulator import simulate_all
from kvtier.ab.strategies import STRATEGY_NAMES, builtin
from kvtier.cost.config import CostConfig
from kvtier.cost.model import CostModel, LinkModel

GPU_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
REPORT = GPU_DIR / "projection-h200-2026-12-04.json"
CONFIG = GPU_DIR.parents[1] / "configs" / "cost-h200-8b.json"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, GPU_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


project = _load("project")


@pytest.fixture(scope="module")
def fitted():
    inputs = project.load_inputs()
    fits = project.fit_all(inputs)
    return inputs, fits, project.error_rows(inputs, fits)


def test_serving_fit_recovers_known_parameters():
    # TTFTs generated from a known o, u, s (and a host load) must give them back.
    torch = CostModel(kv_bytes_per_token=131072, prefill_a_s=0.0135, prefill_b_s_per_token=20e-6,
                      prefill_c_s_per_token_ctx=1.6e-9, block_size=16)
    load = LinkModel(setup_s=0.0005, bytes_per_s=55e9)
    o, u, s = 0.009, 2e-6, 0.7
    points = []
    for prompt in (3000, 16000):
        for mode in ("recompute", "host tier"):
            k = project.tokens_loaded(prompt) if mode == "host tier" else 0
            t = o + u * prompt + s * torch.prefill_s(prompt - k, k) + load.seconds(k * 131072)
            points.append(project.ServePoint("X", prompt, mode, t * 1e3, t * 1e3, t * 1e3))
    got = project.fit_serving(torch, load, points)
    assert got.overhead_s == pytest.approx(o, rel=1e-6)
    assert got.per_prompt_token_s == pytest.approx(u, rel=1e-6)
    assert got.compute_scale == pytest.approx(s, rel=1e-6)


def test_tokens_loaded_matches_the_runs_metrics():
    # vllm:external_prefix_cache_hits_total per request on the H200: +2,992 at 3,000 and +15,984 at 16,000
    assert project.tokens_loaded(3000) == 2992
    assert project.tokens_loaded(16000) == 15984


def test_fitted_vllm_points_within_stated_errors(fitted):
    _, _, rows = fitted
    serve = [r for r in rows if r["group"] == "vLLM server TTFT"]
    assert len(serve) == 12  # 3 runs x {3k, 16k} x {recompute, host tier}
    for r in serve:
        bound = 0.01 if r["role"].startswith("fitted") else 0.08
        assert abs(r["rel_error"]) < bound, r
    other = [r for r in rows if r["group"].startswith("vLLM server TTFT (other")]
    assert len(other) == 8
    within = [r for r in other if abs(r["rel_error"]) < 0.10]
    assert len(within) == 7  # the report's headline: seven within 10 %, the first P/D prefill leg not
    assert abs(next(r for r in other if "first request" in r["point"])["rel_error"]) < 0.30


def test_every_point_is_in_the_committed_report_with_the_same_error(fitted):
    _, _, rows = fitted
    report = json.loads(REPORT.read_text())
    stated = {(r["group"], r["point"]): r for r in report["errors"]}
    assert len(stated) == len(rows)
    for r in rows:
        s = stated[(r["group"], r["point"])]
        assert s["measured"] == pytest.approx(r["measured"], rel=1e-9)
        assert s["predicted"] == pytest.approx(r["predicted"], rel=1e-6)
        assert s["rel_error"] == pytest.approx(r["rel_error"], abs=1e-6)


def test_every_measured_gpu_point_has_a_row(fitted):
    inputs, _, rows = fitted
    s = inputs["calib"]["shapes"]["llama8b"]
    groups = [r["group"] for r in rows]
    assert groups.count("torch prefill calibration (results-h200.json)") == len(s["prefill"]) + len(s["full_stack_check"])
    assert groups.count("torch host copies (results-h200.json, own fit per layout)") == sum(
        1 for h in inputs["calib"]["host_copies"] if h["shape"] == "llama8b")
    # bench_copy: 3 runs x 2 sizes x {load, store} x {consecutive, scattered}
    assert groups.count("host-tier copy (bench_copy)") == 24


def _floats_approx(a: object, b: object) -> bool:
    """a == b, except that floats compare to a relative 1e-9."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_floats_approx(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_floats_approx(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return bool(a == pytest.approx(b, rel=1e-9, abs=0.0))
    return a == b


def test_floats_approx_tells_a_different_model():
    assert _floats_approx({"a": [1.0, "x"], "b": 3}, {"a": [1.0 + 1e-12, "x"], "b": 3})
    assert not _floats_approx({"a": [1.0, "x"]}, {"a": [1.001, "x"]})
    assert not _floats_approx({"a": 1.0}, {"a": 1.0, "b": 2})


def test_shipped_config_is_the_fitted_model_and_loads(fitted):
    _, fits, _ = fitted
    doc = json.loads(CONFIG.read_text())
    # equal to the last bits a float fit allows: numpy/BLAS builds differ in the last ulp
    assert _floats_approx(CostModel.model_validate(doc).model_dump(), fits["cost"].model_dump())
    cfg = CostConfig.model_validate({"fitted": "cost-h200-8b.json", "paths": ["dp_read", "p2p"]})
    cost, names = cfg.with_bytes_per_token(131072).resolved()
    assert names == ("dp_read", "p2p") and cost.block_size == 16
    # it reproduces run C's measured vLLM TTFTs by itself (no script needed)
    assert cost.ttft_s(None, 3000, 0) * 1e3 == pytest.approx(74.22, rel=0.01)
    assert cost.ttft_s(None, 16000, 0) * 1e3 == pytest.approx(456.69, rel=0.01)
    assert cost.ttft_s("host_local", 3000, 2992) * 1e3 == pytest.approx(28.75, rel=0.01)
    assert cost.ttft_s("host_local", 16000, 15984) * 1e3 == pytest.approx(76.61, rel=0.01)


def test_config_runs_in_the_ab_simulate_path():
    cost = CostModel.model_validate_json(CONFIG.read_text())
    specs = [builtin(n).with_cost_model(cost) for n in STRATEGY_NAMES]
    results = simulate_all(project.isolated_trace(), specs, sim_fleet(1, 1, 16), cost)
    assert [r.strategy for r in results] == list(STRATEGY_NAMES)
    assert all(len(r.ok_turns) == 2 * len(project.CONTEXTS) for r in results)


@pytest.fixture(scope="module")
def isolated(fitted):
    inputs, fits, _ = fitted
    out = {}
    for link_name, links in fits["links"].items():
        cost = project.vllm_cost(fits["torch"], fits["serving"], fits["host"]["load"], fits["decode_s"], links)
        for wait in (5.0, 120.0):
            runs = project.run_strategies(project.isolated_trace(wait_s=wait),
                                          project.fleet_spec("1P1D", cost, inputs["calib"]), cost)
            for name, run in runs.items():
                by = {t.conversation_id: t for t in run.ok_turns if t.turn == 1}
                out[(link_name, wait, name)] = [by[f"ctx-{c}"].ttft_s for c in project.CONTEXTS]
    return out


def test_isolated_ttft_grows_with_context(isolated):
    for key, ttft in isolated.items():
        assert all(b >= a for a, b in pairwise(ttft)), (key, ttft)
        if key[2] == "recompute":
            assert all(b > a for a, b in pairwise(ttft)), (key, ttft)


def test_reuse_beats_recompute_at_long_context(isolated):
    for (link, wait, name), ttft in isolated.items():
        if name != "recompute":
            assert ttft[-1] < isolated[(link, wait, "recompute")][-1] / 2, (link, wait, name)


def test_fleets_agree_without_contention(fitted):
    inputs, fits, _ = fitted
    cost = fits["cost"]
    a = project.run_strategies(project.isolated_trace(), project.fleet_spec("1P1D", cost, inputs["calib"]), cost)
    b = project.run_strategies(project.isolated_trace(), project.fleet_spec("2P4D", cost, inputs["calib"]), cost)
    for name in STRATEGY_NAMES:
        assert [t.ttft_s for t in a[name].ok_turns] == pytest.approx([t.ttft_s for t in b[name].ok_turns])
