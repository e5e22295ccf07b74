"""Conversation store and prefix proof (pure logic, no servers)."""

from __future__ import annotations

import pytest

from kvtier.ids import ConversationId, Outcome, PodId
from kvtier.router.store import ConversationStore, RetainedKV, prove_prefix
from kvtier.transfer_params import NixlParams

BS = 4


def params(num_tokens: int) -> NixlParams:
    nblocks = -(-num_tokens // BS)
    return NixlParams(do_remote_decode=True, remote_block_ids=[list(range(100, 100 + nblocks))],
                      remote_engine_id="d0", remote_request_id="r1", remote_host="127.0.0.1",
                      remote_port=5600, remote_num_tokens=num_tokens)


def entry(ids: list[int], conv: str = "c1", tenant: str = "", pod: str = "decode-0",
          expires: float = 1e18, num_tokens: int | None = None) -> RetainedKV:
    n = len(ids) if num_tokens is None else num_tokens
    return RetainedKV.build(ConversationId(conv), tenant, PodId(pod), params(n), ids, expires)


IDS = list(range(1, 18))  # 17 tokens: 4 full blocks + 1


def test_full_prefix_is_reused_whole() -> None:
    d = prove_prefix(entry(IDS), IDS + [99, 98], BS)
    assert d.outcome is Outcome.FULL
    assert d.params is not None and d.params.remote_num_tokens == 17
    assert d.reused_tokens == 17


def test_covered_stops_at_remote_num_tokens() -> None:
    # D computed only 16 of the 17 ids (last sampled token never ran).
    e = entry(IDS, num_tokens=16)
    assert len(e.covered) == 16
    d = prove_prefix(e, IDS[:16] + [5, 5], BS)
    assert d.outcome is Outcome.FULL


@pytest.mark.parametrize("edit_at,keep_tokens", [(13, 12), (9, 8), (7, 4), (4, 4)])
def test_edit_in_history_trims_to_whole_blocks_before_the_edit(edit_at: int,
                                                                keep_tokens: int) -> None:
    new = list(IDS)
    new[edit_at] = 1000
    d = prove_prefix(entry(IDS), new, BS)
    assert d.outcome is Outcome.TRIMMED and d.params is not None
    assert d.params.remote_num_tokens == keep_tokens
    assert d.params.remote_block_ids == [list(range(100, 100 + keep_tokens // BS))]


@pytest.mark.parametrize("edit_at", [0, 1, 3])
def test_edit_in_first_block_drops_params(edit_at: int) -> None:
    new = list(IDS)
    new[edit_at] = 1000
    d = prove_prefix(entry(IDS), new, BS)
    assert d.outcome is Outcome.STALE and d.params is None


def test_truncated_history_is_trimmed_to_the_shorter_prompt() -> None:
    d = prove_prefix(entry(IDS), IDS[:10], BS)
    assert d.outcome is Outcome.TRIMMED and d.params is not None
    assert d.params.remote_num_tokens == 8


def test_prompt_equal_to_covered_keeps_blocks_before_last_token() -> None:
    ids = list(range(1, 17))  # exactly 4 blocks
    d = prove_prefix(entry(ids), ids, BS)
    # The engine must compute the last token itself: 3 blocks are reusable.
    assert d.outcome is Outcome.TRIMMED and d.params is not None
    assert d.params.remote_num_tokens == 12


def test_retokenized_text_shares_only_prompt_part() -> None:
    prompt, gen, retok = list(range(1, 9)), [50, 51, 52, 53, 54], [50, 5051, 52]
    d = prove_prefix(entry(prompt + gen), prompt + retok + [7, 7, 7], BS)
    assert d.outcome is Outcome.TRIMMED and d.params is not None
    assert d.params.remote_num_tokens == 8


def test_params_without_blocks_are_never_reused() -> None:
    e = RetainedKV.build(ConversationId("c"), "", PodId("d"), NixlParams(remote_num_tokens=8),
                         IDS, 1e18)
    assert prove_prefix(e, IDS + [1], BS).outcome is Outcome.STALE


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_take_is_single_use_and_tenant_scoped() -> None:
    s = ConversationStore(10, 1 << 20)
    s.put(entry(IDS, tenant="alice"))
    assert s.take("bob", ConversationId("c1")) == (None, False)
    got, expired = s.take("alice", ConversationId("c1"))
    assert got is not None and not expired
    assert s.take("alice", ConversationId("c1")) == (None, False)
    assert len(s) == 0 and s.nbytes == 0


def test_ttl_expires_on_router_clock() -> None:
    clk = Clock()
    s = ConversationStore(10, 1 << 20, clock=clk)
    s.put(entry(IDS, expires=10.0))
    clk.t = 10.0
    assert s.take("", ConversationId("c1")) == (None, True)
    assert s.expired == 1


def test_lru_by_entry_count() -> None:
    s = ConversationStore(2, 1 << 20)
    for c in ("a", "b", "c"):
        s.put(entry(IDS, conv=c))
    assert s.take("", ConversationId("a"))[0] is None
    assert s.take("", ConversationId("c"))[0] is not None
    assert s.evicted == 1


def test_memory_cap_evicts_oldest_and_refuses_oversized() -> None:
    one = entry(list(range(1000)))
    s = ConversationStore(100, 2 * one.nbytes + 10)
    for c in ("a", "b", "c"):
        s.put(entry(list(range(1000)), conv=c))
    assert len(s) == 2 and s.nbytes <= s.max_bytes
    assert s.take("", ConversationId("a"))[0] is None
    assert not s.put(entry(list(range(10_000)), conv="huge"))


def test_put_replaces_previous_entry_of_conversation() -> None:
    s = ConversationStore(10, 1 << 20)
    s.put(entry(IDS))
    s.put(entry(IDS[:8]))
    assert len(s) == 1
    got, _ = s.take("", ConversationId("c1"))
    assert got is not None and len(got.covered) == 8


def test_discard_pod_forgets_its_entries() -> None:
    s = ConversationStore(10, 1 << 20)
    s.put(entry(IDS, conv="a", pod="d0"))
    s.put(entry(IDS, conv="b", pod="d1"))
    assert s.discard_pod(PodId("d0")) == 1
    assert s.take("", ConversationId("a"))[0] is None
    assert s.take("", ConversationId("b"))[0] is not None


def test_expiry_is_reported_whichever_call_purged_the_entry() -> None:
    # cachetools purges on any write and on len/size reads (the gauges): the next turn of
    # the conversation must still learn its KV expired, once.
    clk = Clock()
    s = ConversationStore(10, 1 << 20, clock=clk)
    s.put(entry(IDS, conv="a", expires=10.0))
    clk.t = 11.0
    assert len(s) == 0 and s.nbytes == 0
    s.put(entry(IDS, conv="b", expires=20.0))
    assert s.take("", ConversationId("a")) == (None, True)
    assert s.take("", ConversationId("a")) == (None, False)
    assert s.expired == 1 and s.evicted == 0


def test_a_new_entry_replaces_the_expiry_of_the_old_one() -> None:
    clk = Clock()
    s = ConversationStore(10, 1 << 20, clock=clk)
    s.put(entry(IDS, expires=10.0))
    clk.t = 11.0
    assert len(s) == 0
    s.put(entry(IDS[:8], expires=20.0))
    got, expired = s.take("", ConversationId("c1"))
    assert got is not None and len(got.covered) == 8 and not expired
    assert s.take("", ConversationId("c1")) == (None, False)


def test_replacing_an_entry_is_not_an_eviction() -> None:
    s = ConversationStore(2, 1 << 20)
    s.put(entry(IDS, conv="a"))
    s.put(entry(IDS, conv="b"))
    s.put(entry(IDS[:8], conv="b"))
    assert s.evicted == 0 and len(s) == 2


def test_an_entry_expired_on_arrival_is_not_stored() -> None:
    clk = Clock()
    clk.t = 5.0
    s = ConversationStore(10, 1 << 20, clock=clk)
    assert not s.put(entry(IDS, expires=5.0))
    assert len(s) == 0


def test_byte_accounting_follows_what_entries_really_cost() -> None:
    """The byte cap is only as good as the accounting: within 25% of what tracemalloc sees
    (the issue measured 604 B accounted against ~2.5 KB of RSS per entry)."""
    import gc
    import tracemalloc

    from kvtier.ids import ConversationId, PodId
    from kvtier.transfer_params import NixlParams

    for ntok in (256, 2048):
        s = ConversationStore(10_000, 1 << 34, block_size=32)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        n = 300
        for i in range(n):
            p = NixlParams(do_remote_decode=True, remote_block_ids=[list(range(ntok // 32 + 1))],
                           remote_engine_id="D-engine-0", remote_request_id=f"cmpl-{i:08d}",
                           remote_host="10.0.0.1", remote_port=5600, remote_num_tokens=ntok)
            s.put(RetainedKV.build(ConversationId(f"conv-{i:08d}"), "0123456789abcdef",
                                   PodId("decode-0"), p, list(range(i, i + ntok)),
                                   1e12, ntok - 16))
        gc.collect()
        real = (tracemalloc.get_traced_memory()[0] - before) / n
        tracemalloc.stop()
        assert 0.75 * real <= s.nbytes / n <= 1.25 * real, (ntok, real, s.nbytes / n)


def test_redis_urls_name_host_port_db_tls_socket_and_credentials() -> None:
    from kvtier.router.redis_conn import Target

    t = Target.from_url("redis://127.0.0.1:6380/2")
    assert (t.host, t.port, t.db, t.tls, t.path, t.password) == ("127.0.0.1", 6380, 2, False,
                                                                  None, None)
    t = Target.from_url("rediss://user:p%40ss@redis.svc/0")
    assert (t.host, t.port, t.tls, t.username, t.password) == ("redis.svc", 6379, True, "user",
                                                               "p@ss")
    t = Target.from_url("unix:///run/redis.sock?db=3")
    assert (t.path, t.db) == ("/run/redis.sock", 3)
