"""Live tiered-adaptive (kvtier.cost.hold): per-conversation hold times from observed waits."""

from __future__ import annotations

import pytest

from kvtier.cost.hold import HoldPolicy
from kvtier.cost.model import CostModel, LinkModel


def _cost() -> CostModel:
    # a device read is much cheaper than recomputing; a host copy is slower than the device read
    return CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                     prefill_c_s_per_token_ctx=2e-8, decode_s_per_token=0.002, block_size=32,
                     reads={"dp_read": LinkModel(setup_s=0.004, bytes_per_s=4e9),
                            "p2p": LinkModel(setup_s=0.02, bytes_per_s=1e9)})


def test_no_waits_yet_holds_the_default():
    c = HoldPolicy(_cost(), host_copy=False, default_hold_s=30).choose("a")
    assert (c.hold_s, c.basis, c.samples) == (30, "default", 0)


def test_no_waits_yet_with_a_host_copy_as_fast_as_the_device_releases_at_once():
    same = LinkModel(setup_s=0.004, bytes_per_s=4e9)
    cpu = _cost().model_copy(update={"reads": {"dp_read": same, "p2p": same}})
    c = HoldPolicy(cpu, host_copy=True, default_hold_s=30).choose("a")
    assert (c.hold_s, c.basis) == (0.0, "default") and "never faster" in c.explanation
    # a slower host copy (the usual GPU case), or none, keeps the default hold
    assert HoldPolicy(_cost(), host_copy=True, default_hold_s=30).choose("a").hold_s == 30
    assert HoldPolicy(cpu, host_copy=False, default_hold_s=30).choose("a").hold_s == 30
    # host copies seen evicted: the default hold comes back
    p = HoldPolicy(cpu, host_copy=True, default_hold_s=30)
    p.observe_host("other", False)
    assert p.choose("a").hold_s == 30


def test_conversations_with_short_and_long_waits_get_different_holds():
    p = HoldPolicy(_cost(), host_copy=False, min_samples=3, horizon_s=60)
    for _ in range(4):
        p.observe("quick", 2.0, 2000)     # tools answer in seconds
        p.observe("slow", 300.0, 2000)    # a human in the loop
    quick, slow = p.choose("quick"), p.choose("slow")
    assert quick.basis == slow.basis == "conversation"
    assert quick.hold_s == pytest.approx(2.0 * 1.2) and quick.covers_wait_s == 2.0
    # holding 2,000 tokens for 5 minutes costs more than recomputing them: released at once
    assert slow.hold_s == 0.0 and "no device retention" in slow.explanation


def test_a_new_conversation_is_judged_on_the_fleet():
    p = HoldPolicy(_cost(), host_copy=False, min_samples=3, horizon_s=60)
    for w in (1.0, 2.0, 3.0):
        p.observe("other", w, 2000)
    c = p.choose("new")
    assert c.basis == "fleet" and c.samples == 3 and c.hold_s == pytest.approx(3.0 * 1.2)


def test_a_host_copy_as_fast_as_the_device_read_means_no_hold():
    c = _cost()
    same = c.model_copy(update={"reads": {"dp_read": c.reads["dp_read"],
                                          "p2p": c.reads["dp_read"]}})
    p = HoldPolicy(same, host_copy=True, min_samples=1)
    p.observe("a", 2.0, 2000)
    assert p.choose("a").hold_s == 0.0


def test_conversation_memory_is_bounded():
    p = HoldPolicy(_cost(), host_copy=False, max_conversations=2)
    for conv in ("a", "b", "c"):
        p.observe(conv, 1.0, 100)
    assert set(p._conv) == {"b", "c"}


def test_needs_a_device_read_link():
    c = _cost()
    with pytest.raises(ValueError, match="dp_read"):
        HoldPolicy(CostModel(kv_bytes_per_token=2048, prefill_a_s=0.01,
                             prefill_b_s_per_token=2e-4, prefill_c_s_per_token_ctx=2e-8,
                             decode_s_per_token=0.002, block_size=32, reads={"p2p": c.reads["p2p"]}),
                   host_copy=True)


def _same_speed() -> CostModel:
    """A host read costs what a device read does (this CPU: both move DRAM over NIXL)."""
    c = _cost()
    return c.model_copy(update={"reads": {"dp_read": c.reads["dp_read"],
                                          "p2p": c.reads["dp_read"]}})


def test_conversations_whose_host_copies_are_evicted_are_held_the_others_released():
    """A host tier smaller than the working set: the host copy of one conversation is gone
    when its next turn comes, the other's survives. Same waits, different choices."""
    p = HoldPolicy(_same_speed(), host_copy=True, min_samples=3, horizon_s=60)
    for _ in range(4):
        p.observe("evicted", 2.0, 2000)
        p.observe("kept", 2.0, 2000)
        p.observe_host("evicted", False)
        p.observe_host("kept", True)
    evicted, kept = p.choose("evicted"), p.choose("kept")
    assert (evicted.host_odds, kept.host_odds) == (0.0, 1.0)
    assert evicted.hold_s == pytest.approx(2.0 * 1.2) and "recomputing" in evicted.explanation
    assert kept.hold_s == 0.0


def test_host_odds_come_from_the_conversation_then_the_fleet_then_one():
    p = HoldPolicy(_same_speed(), host_copy=True, min_host_samples=2)
    assert p.host_odds("a") == 1.0  # nothing seen: a host copy is assumed
    p.observe_host("b", False)
    p.observe_host("c", True)
    p.observe_host("c", True)
    p.observe_host("c", True)
    assert p.host_odds("a") == pytest.approx(0.75)   # the fleet's: 3 of 4 held
    assert p.host_odds("b") == pytest.approx(0.75)   # one report is not enough of its own
    p.observe_host("b", False)
    assert p.host_odds("b") == 0.0 and p.host_odds("c") == 1.0
    # without host copies the odds are 0 whatever is reported
    q = HoldPolicy(_same_speed(), host_copy=False)
    q.observe_host("a", True)
    assert q.host_odds("a") == 0.0


def test_partly_surviving_host_copies_hold_for_shorter_waits_only():
    """The hold pays (1 - odds) x (recompute - device read): the lower the odds, the longer
    the waits worth covering."""
    holds = {}
    for odds_in in (0, 1, 2, 3):  # held reports out of 4
        p = HoldPolicy(_same_speed(), host_copy=True, min_samples=1, horizon_s=60)
        for w in (1.0, 5.0, 20.0):
            p.observe("a", w, 3000)
        for i in range(4):
            p.observe_host("a", i < odds_in)
        holds[odds_in] = p.choose("a").hold_s
    assert holds[0] >= holds[1] >= holds[2] >= holds[3]
    assert holds[0] > holds[3]
