"""OnlineCost: the router's cost model refitted from the prefills it times."""

from __future__ import annotations

import random

import pytest

from kvtier.cost import online
from kvtier.cost.hold import HoldPolicy
from kvtier.cost.model import CostModel, LinkModel
from kvtier.cost.online import OnlineCost

LINK = LinkModel(setup_s=0.010, bytes_per_s=4.4e9)
# the idle calibration (configs/cost-tiny.json, rounded)
IDLE = CostModel(kv_bytes_per_token=2048, prefill_a_s=0.025, prefill_b_s_per_token=7e-5,
                 prefill_c_s_per_token_ctx=3.7e-8, decode_s_per_token=0.012,
                 reads={"dp_read": LINK, "p2p": LINK}, block_size=32)
# the same stack under load (the host-scarce A/B's own fit, rounded): every prefill ~90 ms,
# a D->P read 70 ms of setup
LOADED = IDLE.model_copy(update={
    "prefill_a_s": 0.089, "prefill_b_s_per_token": 2e-5, "prefill_c_s_per_token_ctx": 0.0,
    "reads": {"dp_read": LinkModel(setup_s=0.070, bytes_per_s=4.4e9), "p2p": LINK}})


def measured(truth: CostModel, n: int, paths: tuple[str, ...] = ("none", "dp_read"),
             noise: float = 0.15, seed: int = 1) -> list[tuple[int, int, str, float]]:
    """``n`` prefill legs of follow-up turns as a router times them, with lognormal noise."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        path = paths[i % len(paths)]
        reused = rng.randrange(256, 2048) if path != "none" else 0
        computed = rng.randrange(64, 512) if reused else rng.randrange(64, 2400)
        sec = truth.ttft_s(None if path == "none" else path, computed + reused, reused)
        out.append((computed, reused, path, sec * rng.lognormvariate(0.0, noise)))
    return out


def test_the_prior_is_used_until_enough_prefills_were_timed():
    oc = OnlineCost(IDLE, min_samples=32, refit_every=16)
    for s in measured(LOADED, 31):
        assert oc.observe(*s) is False
    assert oc.model is IDLE and oc.refits == 0
    assert oc.observe(*measured(LOADED, 32)[-1]) is True
    assert oc.model is not IDLE and oc.refits == 1


def test_a_loaded_stack_is_learned_and_a_device_read_stops_paying():
    oc = OnlineCost(IDLE)
    for s in measured(LOADED, 200):
        oc.observe(*s)
    m = oc.model
    for computed, reused, path in ((1000, 0, None), (128, 1500, "dp_read"), (400, 800, "dp_read")):
        want = LOADED.ttft_s(path, computed + reused, reused)
        assert m.ttft_s(path, computed + reused, reused) == pytest.approx(want, rel=0.15)
    assert m.reads["dp_read"].setup_s > 0.04  # the read's setup under load, not idle's 10 ms
    assert m.kv_bytes_per_token == IDLE.kv_bytes_per_token
    assert m.decode_s_per_token == IDLE.decode_s_per_token
    assert any("online refit" in n for n in m.fit_notes)
    # what the policy concludes: idle says holding pays for a 20 s tool wait, loaded says not
    idle, loaded = (HoldPolicy(c, host_copy=False, min_samples=1) for c in (IDLE, m))
    for p in (idle, loaded):
        p.observe("c", 20.0, 1500)
    assert idle.choose("c").hold_s > 0
    assert loaded.choose("c").hold_s < idle.choose("c").hold_s


def test_a_path_with_too_few_reads_keeps_the_priors_link():
    oc = OnlineCost(IDLE, min_path_samples=8)
    legs = measured(LOADED, 100, paths=("none",)) + measured(LOADED, 5, paths=("dp_read",))
    for s in legs:
        oc.observe(*s)
    oc.refit()
    assert oc.model.reads["dp_read"] == IDLE.reads["dp_read"]
    assert oc.model.reads["p2p"] == IDLE.reads["p2p"]
    assert any("dp_read: 5 measured reads (< 8)" in n for n in oc.model.fit_notes)


def test_refits_come_every_refit_every_samples_over_a_sliding_window():
    oc = OnlineCost(IDLE, window=64, min_samples=32, refit_every=16)
    changed = [oc.observe(*s) for s in measured(LOADED, 96)]
    assert [i for i, c in enumerate(changed) if c] == [31, 47, 63, 79, 95]
    assert len(oc.samples) == 64 and oc.seen == 96


def test_legs_that_cannot_be_samples_are_ignored_and_a_bad_path_raises():
    oc = OnlineCost(IDLE, min_samples=3)
    assert oc.observe(0, 100, "dp_read", 0.1) is False       # nothing computed
    assert oc.observe(100, 0, "none", 0.0) is False          # no time
    assert oc.observe(100, 0, "none", float("nan")) is False
    assert oc.seen == 0
    with pytest.raises(ValueError):
        oc.observe(100, 0, "carrier-pigeon", 0.1)


def test_a_failed_refit_keeps_the_model_and_says_why(monkeypatch):
    def boom(*a, **k):
        raise ValueError("singular")
    monkeypatch.setattr(online, "fit_turns", boom)
    oc = OnlineCost(IDLE, min_samples=3)
    for s in measured(LOADED, 3):
        oc.observe(*s)
    assert oc.model is IDLE and oc.refits == 0
    assert oc.last_error is not None and "singular" in oc.last_error


@pytest.mark.parametrize("kw", [dict(window=2), dict(min_samples=300), dict(refit_every=0),
                                dict(min_path_samples=0), dict(prior_samples=-1)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        OnlineCost(IDLE, **kw)
