"""Streaming with reuse against a real 1P1D vLLM-CPU stack, with the official openai client.

The decode node runs ``KVTierNixlConnector`` (configs/nixl-bidirectional-feed.json): a
NixlConnector that publishes each finished request's kv_transfer_params on ZMQ, so the
router can stream decode's tokens to the client as they come *and* keep D's KV for the
next turn. Each 5-turn chat conversation (history resent as text) must arrive token by
token, and turns 2-5 must read D's KV over NIXL (the router's dp_read counter, the prefill's
``prompt_tokens_by_source_total{source="external_kv_transfer"}``), once named and once
with no conversation id at all (found by content). Every turn's text equals a fresh
single-instance recompute.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from tests.e2e.pd import metric, reset_prefix_cache

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "tiny"
MAX_TOKENS = 96
CONFIG = load_config_file("nixl-bidirectional-feed")
OFFSET = CONFIG["kv_connector_extra_config"]["params_feed_port_offset"]


@pytest.fixture(scope="module")
def stack(stack_pool, tiny_model):
    return stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                    kv_transfer_config=CONFIG))


@pytest.fixture(scope="module")
def router(stack):
    insts = []
    for i in stack.instances:
        inst = {"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
        if i.spec.role.value == "decode":
            inst["params_feed"] = f"tcp://127.0.0.1:{i.spec.side_channel_port + OFFSET}"
        insts.append(inst)
    cfg = RouterConfig.model_validate({"instances": insts, "port": 0, "log_json": False})
    assert cfg.stream_capture == "stream"  # the default
    with RouterServer(cfg) as srv:
        time.sleep(0.5)  # the feed's SUB connects
        yield srv


@pytest.fixture()
def http():
    with httpx.Client(timeout=120) as c:
        yield c


def _reference(http, stack, messages, max_tokens) -> str:
    url = stack.prefill[0].url
    reset_prefix_cache(http, url)
    r = http.post(url + "/v1/chat/completions",
                  json={"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    reset_prefix_cache(http, url)
    return r.json()["choices"][0]["message"]["content"]


SYSTEM = {"role": "system", "content": " ".join(
    f"rule {i}: answer briefly and cite the tool output when relevant." for i in range(12))}
USERS = ["Which files changed in the last commit and why?", "Summarise that in one line.",
         "Now list the risks.", "Which test covers the first risk?", "Write the commit title."]


def _five_streamed_turns(http, stack, router, conv: str | None) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    p = stack.prefill[0].url
    msgs = [SYSTEM]
    turns = []
    for turn, user in enumerate(USERS):
        msgs.append({"role": "user", "content": user})
        want = _reference(http, stack, msgs, MAX_TOKENS)
        ext0 = metric(http, p, "vllm:prompt_tokens_by_source_total",
                      source="external_kv_transfer")
        dp0 = metric(http, router.url, "kvtier_router_reuse_total", path="dp_read")
        extra = {"ignore_eos": True, **({"conversation_id": conv} if conv else {})}
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        text, finish, first, chunks, usage = "", None, None, 0, None
        for chunk in stream:
            assert "kv_transfer_params" not in chunk.model_dump_json()
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content:
                    if first is None:
                        first = time.perf_counter() - t0
                    chunks += 1
                    text += c.delta.content
                finish = c.finish_reason or finish
        total = time.perf_counter() - t0
        ext = metric(http, p, "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer") - ext0
        dp = metric(http, router.url, "kvtier_router_reuse_total", path="dp_read") - dp0
        turns.append({"turn": turn + 1, "first_s": first, "total_s": total, "chunks": chunks,
                      "dp_read": dp, "external_tokens": ext, "same_as_reference": text == want})
        assert text == want, f"turn {turn + 1} differs from a fresh recompute"
        assert finish == "length" and usage is not None and usage.completion_tokens == MAX_TOKENS
        msgs.append({"role": "assistant", "content": text})
    print(f"\nconv={conv!r}:", *turns, sep="\n  ")
    # Token by token: many content chunks per turn (a buffered turn arrives as one chunk at
    # the very end). When the first chunk arrives relative to the whole turn is a timing, which
    # belongs to benchmarks (the loaded CI machine made a "before half the turn" check flaky).
    for t in turns:
        assert t["chunks"] >= 20 and t["first_s"] is not None, t
    assert turns[0]["dp_read"] == 0
    for t in turns[1:]:
        assert t["dp_read"] == 1 and t["external_tokens"] > 0, t
    return turns


def test_streamed_named_conversation_reads_decode_kv(http, stack, router):
    _five_streamed_turns(http, stack, router, "stream-named")


def test_streamed_unnamed_conversation_reads_decode_kv(http, stack, router):
    # The same messages as the named test: what that test left retained (its turn 5) starts
    # like this conversation's turn 1 but is no continuation of it, so turn 1 reads nothing.
    _five_streamed_turns(http, stack, router, None)


def test_raw_stream_never_carries_transfer_params(http, stack, router):
    body = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": USERS[0]}],
            "max_tokens": 16, "stream": True, "conversation_id": "raw"}
    for mode_body in (body, {**body, "stream": False}):
        with http.stream("POST", router.url + "/v1/chat/completions", json=mode_body) as r:
            raw = r.read()
        assert r.status_code == 200 and b"kv_transfer_params" not in raw
        assert b"remote_block_ids" not in raw


def test_streamed_responses_conversation_reads_decode_kv(http, stack, router):
    """The Responses API, streamed, with the whole conversation resent each turn: decode's
    events arrive as they come (several text deltas), the answer equals the engine's own, and
    turns 2-3 read the previous turn's KV from the decode node (D's params came over the
    feed: vLLM's Responses stream carries none)."""
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    p = stack.prefill[0].url
    # Its own instructions: with the chat tests' system prompt, turn 1 would repeat the raw
    # test's retained prompt and (rightly) read it, by content, from the decode node.
    kw = {"model": MODEL, "max_output_tokens": 24, "temperature": 0,
          "instructions": SYSTEM["content"] + " Answer in plain prose."}
    history: list[dict] = []
    for turn, user in enumerate(USERS[:3]):
        history.append({"role": "user", "content": user})
        reset_prefix_cache(http, p, retry_s=5)  # what P reuses, it reads
        own = http.post(stack.decode[0].url + "/v1/responses",
                        json={"input": history, "cache_salt": uuid.uuid4().hex, **kw}).json()
        want = "".join(c["text"] for o in own["output"] if o.get("type") == "message"
                       for c in o["content"] if c.get("type") == "output_text")
        ext0 = metric(http, p, "vllm:prompt_tokens_by_source_total",
                      source="external_kv_transfer")
        dp0 = metric(http, router.url, "kvtier_router_reuse_total", path="dp_read")
        deltas, text, kinds = 0, "", []
        for ev in client.responses.create(input=history, stream=True,
                                          extra_body={"conversation_id": "resp-stream"}, **kw):
            kinds.append(ev.type)
            assert "kv_transfer_params" not in ev.model_dump_json()
            if ev.type == "response.output_text.delta":
                deltas += 1
                text += ev.delta
        ext = metric(http, p, "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer") - ext0
        dp = metric(http, router.url, "kvtier_router_reuse_total", path="dp_read") - dp0
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        # streamed, not one answer at the end; vLLM merges tokens into fewer deltas when its
        # consumer lags (a loaded CI run saw 2 for 24 tokens), so no count beyond that
        assert deltas >= 2 and text == want, (turn, deltas, text, want)
        if turn == 0:
            assert dp == 0
        else:
            assert dp == 1 and ext > 0, (turn, dp, ext)
        history.append({"role": "assistant", "content": text})
