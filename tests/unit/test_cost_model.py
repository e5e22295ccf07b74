"""Cost model: KV size, TTFT per path, thresholds (kvtier.cost.model)."""

from __future__ import annotations

import math

import pytest

from kvtier.cost.model import NEVER, CostModel, LinkModel, kv_bytes_per_token

TINY = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def _model(**kw) -> CostModel:
    base = dict(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                prefill_c_s_per_token_ctx=2e-8,
                reads={"dp_read": LinkModel(setup_s=0.004, bytes_per_s=4e9),
                       "p2p": LinkModel(setup_s=0.008, bytes_per_s=1e9)})
    base.update(kw)
    return CostModel(**base)


def test_kv_bytes_per_token_from_configs():
    assert kv_bytes_per_token(TINY) == 4 * 2 * 2 * 64 * 2 == 2048
    assert kv_bytes_per_token(TINY, dtype_bytes=1) == 1024
    # explicit head_dim wins over hidden/heads (Qwen3, Gemma)
    qwen3_32b = {"num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "head_dim": 128}
    assert kv_bytes_per_token(qwen3_32b) == 64 * 2 * 8 * 128 * 2 == 262144
    # no num_key_value_heads: multi-head attention
    assert kv_bytes_per_token({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}) == 2 * 2 * 4 * 16 * 2
    # nested text_config and MLA
    assert kv_bytes_per_token({"text_config": TINY}) == 2048
    mla = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert kv_bytes_per_token(mla, dtype_bytes=1) == 61 * 576
    cm = CostModel.from_model_config(TINY, prefill_a_s=0.5)
    assert cm.kv_bytes_per_token == 2048 and cm.prefill_a_s == 0.5


def test_prefill_read_ttft():
    cm = _model()
    assert cm.prefill_s(1000, 0) == pytest.approx(0.01 + 0.2 + 2e-8 * 1000 * 500)
    assert cm.prefill_s(100, 5000) == pytest.approx(0.01 + 0.02 + 2e-8 * 100 * 5050)
    assert cm.read_s("dp_read", 0) == 0
    assert cm.read_s("dp_read", 1000) == pytest.approx(0.004 + 1000 * 2048 / 4e9)
    assert cm.read_s("local", 10**6) == 0
    with pytest.raises(KeyError, match="nope"):
        cm.read_s("nope", 10)
    assert cm.ttft_s(None, 1000, 900) == cm.prefill_s(1000, 0)
    assert cm.ttft_s("dp_read", 1000, 900) == pytest.approx(cm.read_s("dp_read", 900) + cm.prefill_s(100, 900))
    # at least the last token is computed
    assert cm.ttft_s("dp_read", 1000, 1000) == pytest.approx(cm.read_s("dp_read", 999) + cm.prefill_s(1, 999))
    # local tokens come free and shift the read
    assert cm.ttft_s("p2p", 1000, 300, local_tokens=600) == pytest.approx(
        cm.read_s("p2p", 300) + cm.prefill_s(100, 900))


def test_break_even_is_where_read_equals_recompute():
    cm = _model()
    for path in ("dp_read", "p2p"):
        for local in (0, 4000):
            n = cm.break_even_tokens(path, local)
            assert n is not None and n > 0
            recompute = cm.prefill_b_s_per_token * n + cm.prefill_c_s_per_token_ctx * n * (local + n / 2)
            assert recompute == pytest.approx(cm.read_s(path, 1) - 2048 / cm.reads[path].bytes_per_s
                                              + n * 2048 / cm.reads[path].bytes_per_s, rel=1e-6)


def test_recommend_thresholds_move_the_right_way():
    base = _model().recommend()
    assert base.kv_recompute_threshold % 32 == 0 and base.min_cached_token_delta % 32 == 0
    assert base.kv_recompute_threshold >= base.dp_read_break_even_tokens
    assert "dp_read" in base.explanation and "p2p" in base.explanation
    # dp_read has the faster link and lower setup here, so it pays off sooner
    assert base.kv_recompute_threshold < base.min_cached_token_delta

    def with_link(path, setup, bw):
        cm = _model()
        return cm.model_copy(update={"reads": {**cm.reads, path: LinkModel(setup_s=setup, bytes_per_s=bw)}})

    # more setup -> larger thresholds; more bandwidth -> smaller
    assert with_link("p2p", 0.05, 1e9).recommend().min_cached_token_delta > base.min_cached_token_delta
    assert with_link("p2p", 0.008, 1e12).recommend().min_cached_token_delta <= base.min_cached_token_delta
    assert with_link("dp_read", 0.02, 4e9).recommend().kv_recompute_threshold > base.kv_recompute_threshold
    # faster compute -> recomputing is cheaper -> larger thresholds
    fast = _model(prefill_b_s_per_token=2e-5, prefill_c_s_per_token_ctx=2e-9).recommend()
    assert fast.kv_recompute_threshold > base.kv_recompute_threshold
    assert fast.min_cached_token_delta > base.min_cached_token_delta
    # more cached context in front -> recompute costs more -> smaller thresholds
    deep = _model().recommend(local_tokens=30000)
    assert deep.min_cached_token_delta <= base.min_cached_token_delta
    assert deep.p2p_break_even_tokens < base.p2p_break_even_tokens


def test_recommend_never_and_missing_paths():
    # reading a token costs more than computing it and attention is free: never read
    cm = _model(prefill_c_s_per_token_ctx=0.0, reads={"dp_read": LinkModel(setup_s=0.0, bytes_per_s=1e6)})
    r = cm.recommend()
    assert r.kv_recompute_threshold == NEVER and r.dp_read_break_even_tokens is None
    assert r.min_cached_token_delta == NEVER and "no measurement" in r.explanation
    # with attention, reading eventually wins even over a slow link
    cm2 = cm.model_copy(update={"prefill_c_s_per_token_ctx": 1e-6})
    n = cm2.break_even_tokens("dp_read")
    assert n is not None and math.isfinite(n)
    # zero setup, cheap link: threshold is one block
    cheap = _model(reads={"dp_read": LinkModel(setup_s=0.0, bytes_per_s=1e12),
                          "p2p": LinkModel(setup_s=0.0, bytes_per_s=1e12)}).recommend()
    assert cheap.kv_recompute_threshold == 32 and cheap.min_cached_token_delta == 32
