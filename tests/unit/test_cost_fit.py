"""Fitting the cost model (kvtier.cost.fit): the joint fit recovers a known model; bare links."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.cost.fit import ReadSample, ServiceSample, fit_link, fit_turns
from kvtier.cost.model import NIXL_CPU_PRIOR, CostModel, LinkModel
from kvtier.ids import ReusePath

TRUTH = CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                  prefill_c_s_per_token_ctx=2e-8,
                  reads={"dp_read": LinkModel(setup_s=0.004, bytes_per_s=4e9),
                         "p2p": LinkModel(setup_s=0.008, bytes_per_s=1e9)})


def _samples(rng: np.random.Generator, noise: float, paths: tuple[ReusePath, ...]) -> list[ServiceSample]:
    out = []
    for new, reused in rng.integers(32, 6000, size=(120, 2)).tolist():
        path = paths[len(out) % len(paths)]
        k = 0 if path is ReusePath.NONE else reused
        t = TRUTH.ttft_s(None if path in (ReusePath.NONE, ReusePath.LOCAL) else path.value,
                         new + k + 1, k, local_tokens=k if path is ReusePath.LOCAL else 0)
        out.append(ServiceSample(new + 1, k, path.value, t * (1 + noise * rng.standard_normal())))
    return out


def test_joint_fit_recovers_prefill_and_both_links():
    rng = np.random.default_rng(7)
    fit = fit_turns(_samples(rng, 0.0, tuple(ReusePath)), 2048, 32)
    assert fit.prefill_a_s == pytest.approx(TRUTH.prefill_a_s, rel=1e-3)
    assert fit.prefill_b_s_per_token == pytest.approx(TRUTH.prefill_b_s_per_token, rel=1e-3)
    assert fit.prefill_c_s_per_token_ctx == pytest.approx(TRUTH.prefill_c_s_per_token_ctx, rel=1e-3)
    for p in ("dp_read", "p2p"):
        assert fit.reads[p].bytes_per_s == pytest.approx(TRUTH.reads[p].bytes_per_s, rel=1e-3)
    assert fit.recommend().kv_recompute_threshold == TRUTH.recommend().kv_recompute_threshold
    assert fit.recommend().min_cached_token_delta == TRUTH.recommend().min_cached_token_delta


def test_noisy_fit_is_close_and_never_negative():
    rng = np.random.default_rng(3)
    fit = fit_turns(_samples(rng, 0.03, (ReusePath.NONE, ReusePath.LOCAL)), 2048, 32)
    assert fit.prefill_b_s_per_token == pytest.approx(TRUTH.prefill_b_s_per_token, rel=0.1)
    assert min(fit.prefill_a_s, fit.prefill_b_s_per_token, fit.prefill_c_s_per_token_ctx) >= 0
    # no read was measured: both paths take the stated prior, and the notes say so
    assert fit.reads["dp_read"] == fit.reads["p2p"] == NIXL_CPU_PRIOR
    assert any("prior" in n for n in fit.fit_notes)


def test_a_path_nobody_took_borrows_the_other():
    rng = np.random.default_rng(4)
    fit = fit_turns(_samples(rng, 0.0, (ReusePath.NONE, ReusePath.P2P)), 2048, 32)
    assert fit.reads["dp_read"] == fit.reads["p2p"]
    assert any("borrowed from p2p" in n for n in fit.fit_notes)


def test_fit_refuses_too_few_samples():
    with pytest.raises(ValueError, match="at least 3"):
        fit_turns([ServiceSample(10, 0, "none", 0.1)] * 2, 2048, 32)
    with pytest.raises(ValueError, match="at least 3"):
        fit_turns([ServiceSample(0, 10, "none", 0.1)] * 5, 2048, 32)  # nothing computed


def test_fit_link_recovers_setup_and_bandwidth():
    rng = np.random.default_rng(1)
    samples = [ReadSample(int(nb), (0.003 + nb / 5e9) * (1 + 0.02 * rng.standard_normal()))
               for nb in rng.integers(1e5, 1e9, 40)]
    link = fit_link(samples)
    assert link.setup_s == pytest.approx(0.003, rel=0.2)
    assert link.bytes_per_s == pytest.approx(5e9, rel=0.05)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_link([ReadSample(100, 0.1), ReadSample(100, 0.2)])
    with pytest.raises(ValueError, match="does not grow"):
        fit_link([ReadSample(100, 0.2), ReadSample(1000, 0.1)])


def test_noisy_samples_do_not_pull_the_fit_under_the_median():
    """Multiplicative, heavy noise (a loaded machine): the fit lands on the typical sample.
    Dividing rows by the measurement alone (the first pass) settles well under it."""
    rng = np.random.default_rng(11)
    clean = _samples(rng, 0.0, (ReusePath.NONE,))
    noisy = [ServiceSample(s.computed_tokens, s.reused_tokens, s.path,
                           s.seconds * float(np.exp(0.7 * rng.standard_normal())))
             for s in clean for _ in range(4)]
    fit = fit_turns(noisy, 2048, 32)
    ratio = [s.seconds / fit.ttft_s(None, s.computed_tokens, 0) for s in noisy]
    assert 0.85 < float(np.median(ratio)) < 1.15
    # the first pass alone (rows divided by the measured seconds) is biased low
    from scipy.optimize import nnls
    x = np.array([[1.0, s.computed_tokens, s.computed_tokens * s.computed_tokens / 2]
                  for s in noisy])
    y = np.array([s.seconds for s in noisy])
    first, _ = nnls(x / y[:, None], np.ones_like(y))
    assert float(np.median(y / (x @ first))) > 1.3
