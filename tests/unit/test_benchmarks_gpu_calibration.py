"""Pure helpers of the GPU calibration (benchmarks/gpu): shape arithmetic, grid, link fits, and the
validation helpers. No GPU, no torch needed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kvtier.cost.model import CostModel, LinkModel

GPU_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, GPU_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


shapes = _load("gpu_shapes")
validate = _load("validate")


def test_kv_bytes_per_token_matches_published_layouts_and_costmodel():
    # Llama-3.1-8B: 32 layers x 2 x 8 kv heads x 128 x 2 B = 128 KiB; Qwen 32B layouts: 256 KiB.
    assert shapes.SHAPES["llama8b"].kv_bytes_per_token() == 128 * 1024
    assert shapes.SHAPES["qwen25_32b"].kv_bytes_per_token() == 256 * 1024
    assert shapes.SHAPES["qwen3_32b"].kv_bytes_per_token() == 256 * 1024
    for s in shapes.SHAPES.values():
        assert CostModel.from_model_config(s.hf_config()).kv_bytes_per_token == s.kv_bytes_per_token()


def test_param_counts_are_model_class_sized():
    assert 7.5e9 < shapes.SHAPES["llama8b"].params() < 8.5e9  # Llama-3.1-8B: 8.03B
    assert 32e9 < shapes.SHAPES["qwen25_32b"].params() < 33.5e9  # Qwen2.5-32B: 32.5B
    assert 32e9 < shapes.SHAPES["qwen3_32b"].params() < 33.5e9  # Qwen3-32B: 32.8B


def test_prefill_flops_attention_term_grows_with_cached_context():
    s = shapes.SHAPES["qwen3_32b"]
    no_ctx = s.prefill_flops(1024, 0)
    ctx = s.prefill_flops(1024, 8192)
    assert ctx - no_ctx == pytest.approx(4.0 * 1024 * 8192 * s.q_dim * s.layers)
    assert s.prefill_flops(2048) > 2 * s.prefill_flops(1024) - 2 * 2.0 * s.vocab * s.hidden


def test_prefill_grid_full_recompute_and_partial_points():
    grid = shapes.prefill_grid([2048, 4096], [512, 2048, 8192])
    assert grid == [(512, 1536), (2048, 0), (512, 3584), (2048, 2048), (4096, 0)]
    with pytest.raises(ValueError):
        shapes.prefill_grid([0], [1])


def test_scale_layers_and_median():
    assert shapes.scale_layers(0.1, 4, 64) == pytest.approx(1.6)
    with pytest.raises(ValueError):
        shapes.scale_layers(0.1, 5, 4)
    assert shapes.median([3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        shapes.median([])


def test_link_through_published_points():
    link = validate.link_through(((2048, 30.0), (24576, 130.0)), 256 * 1024)
    assert link.seconds(2048 * 256 * 1024) == pytest.approx(0.030)
    assert link.seconds(24576 * 256 * 1024) == pytest.approx(0.130)
    with pytest.raises(ValueError):
        validate.link_through(((2048, 130.0), (24576, 30.0)), 1)
    with pytest.raises(ValueError):  # would need a negative setup
        validate.link_through(((1000, 1.0), (2000, 100.0)), 1)


def test_tp_scaled_divides_compute_and_adds_overhead():
    cost = CostModel(kv_bytes_per_token=1, prefill_a_s=0.08, prefill_b_s_per_token=8e-5,
                     prefill_c_s_per_token_ctx=8e-9)
    tp = validate.tp_scaled(cost, 8, overhead_s=0.1)
    assert tp.prefill_s(4096, 1000) == pytest.approx(cost.prefill_s(4096, 1000) / 8 + 0.1)


def test_growth_trace_hits_the_published_prompt_lengths():
    from kvtier.ab.traces import turn_plan

    plan = turn_plan(validate.growth_trace().conversations[0])
    prompts = [p.prompt_tokens for p in plan]
    assert prompts[1] == 2048 and prompts[19] == 20480 and prompts[23] == 24576


def test_implied_computed_tokens_inverts_ttft():
    link = LinkModel(setup_s=0.02, bytes_per_s=50e9)
    cost = CostModel(kv_bytes_per_token=262144, prefill_a_s=0.05, prefill_b_s_per_token=2e-5,
                     prefill_c_s_per_token_ctx=1e-9, reads={"dp_read": link})
    target = cost.ttft_s("dp_read", 20000, 20000 - 3000) + link.seconds(3000 * 262144)
    assert abs(validate.implied_computed_tokens(cost, 20000, target, link) - 3000) <= 1
    assert validate.implied_computed_tokens(cost, 20000, 0.001, link) is None
