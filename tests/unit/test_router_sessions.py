"""Sessions without an id: a request that names no conversation continues the one whose
retained token ids its prompt provably starts with (same tenant, longest match), and the
names clients already send (vLLM's session_id / X-Session-ID, OpenAI's prompt_cache_key)
name a conversation as conversation_id does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvtier.ids import ConversationId, PodId
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router
from kvtier.router.requests import Endpoint, parse_inbound
from kvtier.router.store import ConversationStore, RetainedKV, block_hashes
from kvtier.transfer_params import NixlParams
from tests.fakes.engine import BLOCK_SIZE, D_URL, GEN, P_URL, FakeEngines

PROMPT = list(range(1, 11))
COVERED = len(PROMPT) + len(GEN) - 1


def make(**cfg: Any) -> Iterator[tuple[TestClient, FakeEngines, Router]]:
    fake = FakeEngines()
    config = RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL],
                                          "log_json": False, "block_size": BLOCK_SIZE, **cfg})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        yield c, fake, c.app.state.router  # type: ignore[attr-defined]


def complete(c: TestClient, prompt: list[int], headers: dict[str, str] | None = None,
             **extra: Any) -> Any:
    return c.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                           "max_tokens": 3, **extra}, headers=headers or {})


def reuse(r: Any) -> tuple[str, str]:
    return r.headers["x-kvtier-reuse"], r.headers["x-kvtier-outcome"]


def test_an_unnamed_turn_continues_by_content() -> None:
    for c, fake, _ in make():
        assert reuse(complete(c, PROMPT)) == ("none; tokens=0", "none")
        r = complete(c, [*PROMPT, *GEN, 7])
        assert reuse(r) == (f"dp_read; tokens={COVERED}", "full")
        assert fake.prefills()[-1].kvp["remote_engine_id"] == "D"
        # and the turn after that continues the same conversation
        r = complete(c, [*PROMPT, *GEN, 7, *GEN, 8])
        assert reuse(r)[0].startswith("dp_read;")


def test_named_and_unnamed_get_the_same_reuse() -> None:
    for c, _, _ in make():
        complete(c, PROMPT, conversation_id="x")
        named = reuse(complete(c, [*PROMPT, *GEN, 7], conversation_id="x"))
    for c, _, _ in make():
        complete(c, PROMPT)
        unnamed = reuse(complete(c, [*PROMPT, *GEN, 7]))
    assert named == unnamed == (f"dp_read; tokens={COVERED}", "full")


def test_unnamed_chat_is_tokenized_and_continues() -> None:
    for c, fake, _ in make():
        msgs = [{"role": "user", "content": "hello world, a longer prompt"}]
        c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs})
        more = [*msgs, {"role": "user", "content": "more"}]
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": more})
        # the fake tokenizes characters: the new prompt starts with the old prompt only
        assert reuse(r)[0].startswith("dp_read;") and reuse(r)[1] == "trimmed"


def test_another_tenant_never_continues_by_content() -> None:
    for c, _, _ in make(api_keys=["ka", "kb"]):
        complete(c, PROMPT, headers={"authorization": "Bearer ka"})
        r = complete(c, [*PROMPT, *GEN, 7], headers={"authorization": "Bearer kb"})
        assert reuse(r) == ("none; tokens=0", "none")
        r = complete(c, [*PROMPT, *GEN, 7], headers={"authorization": "Bearer ka"})
        assert reuse(r)[0].startswith("dp_read;")


def test_implicit_sessions_can_be_switched_off() -> None:
    for c, _, router in make(implicit_sessions=False):
        complete(c, PROMPT)
        assert reuse(complete(c, [*PROMPT, *GEN, 7])) == ("none; tokens=0", "none")
        assert len(router.store) == 0


@pytest.mark.parametrize("how", ["session_id", "x-session-id", "prompt_cache_key",
                                 "x-conversation-id"])
def test_the_names_clients_already_send(how: str) -> None:
    for c, fake, _ in make(implicit_sessions=False):
        body: dict[str, Any] = {}
        headers: dict[str, str] = {}
        if how.startswith("x-"):
            headers[how] = "s1"
        else:
            body[how] = "s1"
        complete(c, PROMPT, headers=headers, **body)
        r = complete(c, [*PROMPT, *GEN, 7], headers=headers, **body)
        assert reuse(r) == (f"dp_read; tokens={COVERED}", "full")
        if how in ("session_id", "prompt_cache_key"):  # the engine's own fields pass through
            assert fake.completions(D_URL)[-1].body[how] == "s1"


def test_name_precedence() -> None:
    inb = parse_inbound(Endpoint.COMPLETIONS, {"model": "m", "prompt": [1], "session_id": "s",
                                               "prompt_cache_key": "k"}, {"x-session-id": "h"})
    assert inb.conversation == "s"
    inb = parse_inbound(Endpoint.COMPLETIONS, {"model": "m", "prompt": [1],
                                               "prompt_cache_key": "k"}, {"x-session-id": "h"})
    assert inb.conversation == "h"


def _entry(conv: str, ids: list[int], tenant: str = "") -> RetainedKV:
    params = NixlParams(remote_block_ids=[[1, 2, 3, 4]], remote_engine_id="D",
                        remote_request_id="r", remote_host="h", remote_port=1,
                        remote_num_tokens=len(ids))
    return RetainedKV.build(ConversationId(conv), tenant, PodId("decode-0"), params, ids, 1e18)


def test_store_find_longest_match_and_unindexing() -> None:
    s = ConversationStore(10, 1 << 20, block_size=4)
    system = list(range(100, 108))  # two blocks every conversation shares
    s.put(_entry("a", [*system, 1, 2, 3, 4]))
    s.put(_entry("b", [*system, 5, 6, 7, 8, 9, 9, 9, 9]))
    assert s.find("", [*system, 5, 6, 7, 8, 9, 9, 9, 9, 42]) == "b"
    assert s.find("", [*system, 1, 2, 3, 4, 42]) == "a"
    assert s.find("", [*system, 5, 6, 7, 8, 0]) == "b"  # longest whole-block match
    assert s.find("other-tenant", [*system, 1, 2, 3, 4]) is None
    assert s.find("", [7, 7, 7, 7, 7]) is None
    s.take("", ConversationId("b"))
    # b's boundaries are gone; the shared system blocks still lead to a
    assert s.find("", [*system, 5, 6, 7, 8, 0]) == "a"
    s.take("", ConversationId("a"))
    assert s.find("", [*system, 1, 2, 3, 4]) is None
    assert not s._index and not s._hashes


def test_store_index_follows_eviction_and_expiry() -> None:
    now = [0.0]
    s = ConversationStore(1, 1 << 20, clock=lambda: now[0], block_size=4)
    s.put(_entry("a", [1, 2, 3, 4, 5]))
    s.put(_entry("b", [9, 9, 9, 9, 5]))  # evicts a (entry cap 1)
    assert s.find("", [1, 2, 3, 4]) is None and s.find("", [9, 9, 9, 9]) == "b"
    params = _entry("c", [3, 3, 3, 3]).params
    s.put(RetainedKV.build(ConversationId("c"), "", PodId("d"), params, [3, 3, 3, 3], 5.0))
    now[0] = 10.0
    assert s.find("", [3, 3, 3, 3]) is None
    len(s)  # cachetools purges expired entries here
    assert all(k[1] != "c" for k in s._hashes)


def test_block_hashes_chain() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes(np.asarray([1, 2, 3, 4, 5, 6, 7, 0], dtype=np.uint32), 4)  # type: ignore[arg-type]
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_hashes([5, 6, 7, 8], 4)[0] != a[1]  # chained, not per block


# ---- the structured log line per answer ----------------------------------------------------
def _served(caplog: pytest.LogCaptureFixture) -> Any:
    recs = [r for r in caplog.records if r.getMessage() == "served"]
    return recs[-1]


def test_each_answer_logs_path_tokens_and_refusal(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="kvtier.router")
    for c, _, router in make(implicit_sessions=False):
        complete(c, PROMPT, conversation_id="a")
        rec = _served(caplog)
        assert (rec.reuse_path, rec.reuse_tokens, rec.outcome) == ("none", 0, "none")
        assert not hasattr(rec, "refusal")
        complete(c, [*PROMPT, *GEN, 7], conversation_id="a")
        rec = _served(caplog)
        assert (rec.reuse_path, rec.reuse_tokens, rec.outcome) == ("dp_read", COVERED, "full")
        # history edited in the first block: the retained KV is not proven
        complete(c, [0, *PROMPT[1:], *GEN, 7, *GEN, 8], conversation_id="a")
        rec = _served(caplog)
        assert (rec.reuse_path, rec.outcome, rec.refusal) == ("none", "stale", "unproven")
        # retained past its TTL
        complete(c, PROMPT, conversation_id="b")
        entry, _ = router.store.take("", ConversationId("b"))
        assert entry is not None
        assert router.store.put(RetainedKV(entry.conversation, entry.tenant, entry.decode_pod,
                                           entry.params, entry.covered, entry.digest,
                                           time.monotonic() + 0.05))
        time.sleep(0.1)
        complete(c, [*PROMPT, *GEN, 7], conversation_id="b")
        rec = _served(caplog)
        assert (rec.outcome, rec.refusal) == ("expired", "expired")


def test_the_served_line_says_when_the_prefill_answered_and_what_d_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    """What ``kvtier ab`` reads from a router process's log (its legs are not visible there):
    ``prefill_ms`` within ``ms``, the prefill's ``cached_tokens`` when the engine says it, and
    the tokens a non-streamed decode answer retained."""
    from kvtier.router.prefill import _cached_tokens

    caplog.set_level("INFO", logger="kvtier.router")
    for c, _, _ in make():
        complete(c, PROMPT, conversation_id="a")
        rec = _served(caplog)
        assert 0 < rec.prefill_ms <= rec.ms
        assert rec.retained_tokens == len(PROMPT) + len(GEN) - 1  # D's remote_num_tokens
        assert not hasattr(rec, "prefill_cached_tokens")  # the fake engine does not say
        complete(c, [1, 2, 3], conversation_id="b", stream=True)  # buffered: D still says
        assert _served(caplog).retained_tokens == 3 + len(GEN) - 1
    usage = {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 96}}}
    assert _cached_tokens(usage) == 96
    assert _cached_tokens({"usage": {"prompt_tokens_details": None}}) is None
    assert _cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}) is None


def test_only_a_continuation_is_found() -> None:
    s = ConversationStore(10, 1 << 20, block_size=4)
    system = list(range(100, 108))
    params = _entry("x", list(range(16))).params
    # a turn whose prompt was system + 4 user tokens, answered with 4 tokens
    s.put(RetainedKV.build(ConversationId("a"), "", PodId("d"), params,
                           [*system, 1, 2, 3, 4, 9, 9, 9, 9], 1e18, prompt_len=12))
    assert s.find("", [*system, 5, 6, 7, 8]) is None  # shares only the system prompt
    assert s.find("", [*system, 1, 2, 3, 4, 9, 9, 0]) == "a"  # repeats the whole prompt
    assert s.find("", [*system, 1, 2, 3, 4]) == "a"  # the same prompt again


def test_a_new_conversation_with_the_same_system_prompt_takes_nothing() -> None:
    for c, _, router in make():
        system = list(range(100, 112))
        complete(c, [*system, 1, 2], conversation_id="a")
        r = complete(c, [*system, 5, 6])  # unnamed, same system prompt, another question
        assert reuse(r) == ("none; tokens=0", "none")
        r = complete(c, [*system, 1, 2, *GEN, 7], conversation_id="a")
        assert reuse(r)[0].startswith("dp_read;")  # a kept its KV


def test_a_continuation_whose_answer_diverges_at_once_is_found() -> None:
    s = ConversationStore(10, 1 << 20, block_size=4)
    system = list(range(100, 112))
    params = _entry("x", list(range(16))).params
    s.put(RetainedKV.build(ConversationId("a"), "", PodId("d"), params,
                           [*system, 1, 2, 9, 9, 9, 9], 1e18, prompt_len=14))
    # the answer came back re-tokenized differently from its first token on
    assert s.find("", [*system, 1, 2, 8, 8, 8, 8, 5]) == "a"
    assert s.find("", [*system, 5, 6, 9, 9, 9, 9]) is None


@pytest.fixture(params=["memory", "redis"])
def store_cfg(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "memory":
        return {}
    return {"store": request.getfixturevalue("redis_url"),
            "store_namespace": f"sessions-{time.monotonic_ns()}"}


def test_a_named_turn_hits_its_own_entry_and_a_new_name_continues_by_content(
        store_cfg: dict[str, Any]) -> None:
    """A named turn takes its own entry; a name never seen finds the conversation its prompt
    continues by content and takes that: the same with the memory and the Redis store."""
    for c, _, _ in make(**store_cfg):
        complete(c, PROMPT, conversation_id="x")
        assert reuse(complete(c, [*PROMPT, *GEN, 7], conversation_id="x")) == (
            f"dp_read; tokens={COVERED}", "full")
    fresh = {**store_cfg, "store_namespace": f"sessions-{time.monotonic_ns()}"} \
        if store_cfg else {}
    for c, _, _ in make(**fresh):
        complete(c, PROMPT, conversation_id="x")
        r = complete(c, [*PROMPT, *GEN, 7], conversation_id="y")  # a name never seen
        assert reuse(r) == (f"dp_read; tokens={COVERED}", "full")
        # x's turn was taken by y's: x alone has nothing left
        assert reuse(complete(c, [9, 9, 9], conversation_id="x")) == ("none; tokens=0", "none")
