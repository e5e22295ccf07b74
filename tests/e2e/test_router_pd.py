"""The router against a real 1P1D vLLM-CPU stack (bidirectional NixlConnector).

Every answer that goes through the router is compared with a fresh
single-instance recompute of the same request on the prefill instance (its
prefix cache reset before and after, so the reference never sees transferred
KV and the router's prefill never gets a local hit that hides the D->P read).

Runs last in this module: the fault test that kills the decode instance (the
pool restarts the stack for whoever needs it next).
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from kvtier.runtime import free_ports
from tests.e2e.pd import metric, pd_complete, reset_prefix_cache

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "tiny"
MARK = "INJECTED-7f3a"


class Recording(httpx.AsyncBaseTransport):
    """Forwards to the real network and keeps every upstream request body."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[tuple[str, bytes]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.bodies.append((str(request.url), body))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class FaultyPort:
    """A TCP port that either hangs (accepts, never answers) or resets after the
    request arrives: a slow engine and an engine dying mid-request."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "reset":
                try:
                    c.settimeout(2)
                    c.recv(65536)
                except OSError:
                    pass
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                c.close()
            else:
                self.conns.append(c)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone does not
        self.sock.close()
        self.thread.join(timeout=5)
        for c in self.conns:
            c.close()


@pytest.fixture(scope="module")
def stack(stack_pool, tiny_model):
    return stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                    kv_transfer_config=load_config_file("nixl-bidirectional")))


def router_config(stack, **kw) -> RouterConfig:
    insts = [{"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
             for i in stack.instances]
    insts = kw.pop("instances", insts)
    return RouterConfig.model_validate({"instances": insts, "port": 0, "log_json": False,
                                        **kw})


@pytest.fixture(scope="module")
def recorder():
    return Recording()


@pytest.fixture(scope="module")
def router(stack, recorder):
    with RouterServer(router_config(stack), transport=recorder) as srv:
        yield srv


@pytest.fixture()
def http():
    with httpx.Client(timeout=120) as c:
        yield c


def p_url(stack) -> str:
    return stack.prefill[0].url


def reference(http, stack, path: str, body: dict) -> dict:
    """Fresh single-instance answer on the prefill node. Its own ``cache_salt`` keeps it apart
    from every other request's cache entries both ways (it reuses nothing and leaves nothing
    a later turn could hit); the resets around it are best effort (vLLM refuses one while
    blocks are held, answering ``success: false``)."""
    url = p_url(stack)
    reset_prefix_cache(http, url, retry_s=5)
    salt = {"cache_salt": uuid.uuid4().hex}
    r = http.post(url + path, json={**body, "temperature": 0, **salt})
    r.raise_for_status()
    reset_prefix_cache(http, url, retry_s=5)
    return r.json()


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def router_metric(http, router, name, **labels) -> float:
    return metric(http, router.url, name, **labels)


def test_five_turns_reuse_decode_kv_and_match_single_instance(http, stack, router):
    p = p_url(stack)
    history: list[int] = []
    conv = "five-turns"
    for turn in range(5):
        prompt = history + ids(100 + turn, 150 if turn == 0 else 40)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 96, "ignore_eos": True,
                "return_token_ids": True}
        ref = reference(http, stack, "/v1/completions", body)
        ext0 = metric(http, p, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        comp0 = metric(http, p, "vllm:prompt_tokens_by_source_total", source="local_compute")
        dp0 = router_metric(http, router, "kvtier_router_reuse_total", path="dp_read")
        r = http.post(router.url + "/v1/completions",
                      json={**body, "temperature": 0, "conversation_id": conv})
        r.raise_for_status()
        out = r.json()
        assert "kv_transfer_params" not in out  # never shown to clients
        ch, rch = out["choices"][0], ref["choices"][0]
        assert ch["token_ids"] == rch["token_ids"], f"turn {turn + 1} differs from reference"
        assert ch["text"] == rch["text"]
        ext = metric(http, p, "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer") - ext0
        comp = metric(http, p, "vllm:prompt_tokens_by_source_total", source="local_compute") - comp0
        dp = router_metric(http, router, "kvtier_router_reuse_total", path="dp_read") - dp0
        if turn == 0:
            assert ext == 0 and dp == 0
        else:
            # P read the previous turn (prompt + generated) from D over NIXL and
            # computed only the new tokens.
            assert dp == 1
            assert ext >= len(history) - 32, (turn, ext, len(history))
            assert comp < len(prompt) - len(history) + 33, (turn, comp)
        history = prompt + ch["token_ids"]


def _chat_turns(case: str):
    system = {"role": "system", "content": " ".join(
        f"rule {i}: answer briefly and cite the tool output when relevant." for i in range(12))}
    u1 = {"role": "user", "content": "Which files changed in the last commit and why?"}
    u2 = {"role": "user", "content": "Now summarise that in one line."}
    if case == "strip_reasoning":
        first = [system, u1, {"role": "assistant", "content":
                 "<think>I should list the files, then explain each change.</think>Two files."},
                 {"role": "user", "content": "Which ones?"}]
        def edit(msgs, a1):
            return [system, u1, {"role": "assistant", "content": "Two files."},
                                         msgs[3], {"role": "assistant", "content": a1}, u2]
    elif case == "rewrite_tool":
        first = [system, u1, {"role": "assistant", "content": "call git_show(HEAD)"},
                 {"role": "tool", "content": "router/app.py | 40 +++--\nrouter/flow.py | 12 +-"}]
        def edit(msgs, a1):
            return [system, u1, msgs[2],
                                         {"role": "tool", "content": "[tool output elided: 2 files]"},
                                         {"role": "assistant", "content": a1}, u2]
    elif case == "truncate":
        first = [system, u1, {"role": "assistant", "content": "Two files changed."},
                 {"role": "user", "content": "Show the diff."}]
        def edit(msgs, a1):
            return [system, u1, u2]
    else:  # normal: append the answer and a new user message
        first = [system, u1]
        def edit(msgs, a1):
            return [*msgs, {"role": "assistant", "content": a1}, u2]
    return first, edit


@pytest.mark.parametrize("case", ["normal", "strip_reasoning", "rewrite_tool", "truncate"])
def test_chat_history_edits_match_fresh_recompute(http, stack, router, case):
    conv = f"chat-{case}"
    first, edit = _chat_turns(case)
    base = {"model": MODEL, "max_tokens": 48, "ignore_eos": True}
    ref1 = reference(http, stack, "/v1/chat/completions", {**base, "messages": first})
    r1 = http.post(router.url + "/v1/chat/completions",
                   json={**base, "messages": first, "temperature": 0},
                   headers={"x-conversation-id": conv})
    r1.raise_for_status()
    a1 = r1.json()["choices"][0]["message"]["content"]
    assert a1 == ref1["choices"][0]["message"]["content"]
    second = edit(first, a1)
    ref2 = reference(http, stack, "/v1/chat/completions", {**base, "messages": second})
    proofs0 = (router_metric(http, router, "kvtier_router_params_trimmed_total")
               + router_metric(http, router, "kvtier_router_params_dropped_total", reason="stale"))
    r2 = http.post(router.url + "/v1/chat/completions",
                   json={**base, "messages": second, "temperature": 0, "conversation_id": conv})
    r2.raise_for_status()
    assert r2.json()["choices"][0]["message"]["content"] == ref2["choices"][0]["message"]["content"]
    proofs = (router_metric(http, router, "kvtier_router_params_trimmed_total")
              + router_metric(http, router, "kvtier_router_params_dropped_total", reason="stale"))
    if case != "normal":
        # The edit broke the retained prefix: the router trimmed or dropped D's params.
        assert proofs - proofs0 == 1


def test_edited_token_history_is_trimmed_and_unproven_reuse_would_be_wrong(http, stack, router):
    """Control: the same edit with D's params passed untrimmed gives a different
    answer (the hazard); through the router it equals the fresh recompute."""
    p, d = p_url(stack), stack.decode[0].url
    body = {"model": MODEL, "max_tokens": 64, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0}
    # Router first: the hazard leaves wrong KV in both nodes' prefix caches under
    # the edited prompt's block hashes, so the two runs use different tokens.
    for seed, conv, check_hazard in ((7, "edit-router", False), (70, "edit-hazard", True)):
        a = ids(seed, 200)
        r = http.post(router.url + "/v1/completions",
                      json={**body, "prompt": a, "conversation_id": conv})
        r.raise_for_status()
        gen = r.json()["choices"][0]["token_ids"]
        # Rewrite tokens 150..170 of the history (a tool result, say).
        edited = a[:150] + ids(seed + 1, 20) + a[170:] + gen + ids(seed + 2, 30)
        ref = reference(http, stack, "/v1/completions", {**body, "prompt": edited})
        if check_hazard:
            entry, _ = router.router.store.take("", conv)
            assert entry is not None and entry.params.has_remote_blocks
            reset_prefix_cache(http, p)
            _, dec = pd_complete(http, p, d, MODEL, edited, 64, reuse=entry.params)
            assert dec["choices"][0]["token_ids"] != ref["choices"][0]["token_ids"], \
                "loading unproven KV should have changed the output"
            continue
        trimmed0 = router_metric(http, router, "kvtier_router_params_trimmed_total")
        r2 = http.post(router.url + "/v1/completions",
                       json={**body, "prompt": edited, "conversation_id": conv})
        r2.raise_for_status()
        assert r2.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        assert router_metric(http, router, "kvtier_router_params_trimmed_total") == trimmed0 + 1


def test_openai_client_streams_through_router(http, stack, router):
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    # A long system prompt: the proven prefix of turn 2 then spans whole blocks
    # (the re-tokenized answer diverges from the generated ids within it).
    msgs = [_chat_turns("normal")[0][0],
            {"role": "user", "content": "Stream me a short story about caches."}]
    ref = reference(http, stack, "/v1/chat/completions",
                    {"model": MODEL, "messages": msgs, "max_tokens": 40, "ignore_eos": True})
    want = ref["choices"][0]["message"]["content"]
    assert [m.id for m in client.models.list().data]
    for conv in (None, "openai-stream"):  # passthrough relay, then buffered capture
        extra = {"ignore_eos": True, **({"conversation_id": conv} if conv else {})}
        stream = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        text, finish, usage = "", None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        assert text == want and finish == "length"
        assert usage is not None and usage.completion_tokens == 40
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert sum(len(c.choices[0].text) for c in comp if c.choices) > 0
    # A tracked conversation's second streamed turn reads D's KV.
    dp0 = router_metric(http, router, "kvtier_router_reuse_total", path="dp_read")
    msgs2 = [*msgs, {"role": "assistant", "content": want}, {"role": "user", "content": "More."}]
    ref2 = reference(http, stack, "/v1/chat/completions",
                     {"model": MODEL, "messages": msgs2, "max_tokens": 20, "ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs2, max_tokens=20, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "conversation_id": "openai-stream"}) if c.choices)
    assert text == ref2["choices"][0]["message"]["content"]
    assert router_metric(http, router, "kvtier_router_reuse_total", path="dp_read") == dp0 + 1


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=False),
                         st.text(max_size=8))
_fields = st.dictionaries(
    st.sampled_from(["model", "messages", "prompt", "stream", "n", "max_tokens", "temperature",
                     "conversation_id", "logprobs", "stream_options", "top_p", "stop", "seed",
                     "max_completion_tokens", "echo", "return_token_ids"]),
    st.one_of(_json_scalar, st.lists(_json_scalar, max_size=3),
              st.lists(st.fixed_dictionaries({"role": st.text(max_size=6)}), max_size=2)),
    max_size=6)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(fields=_fields, endpoint=st.sampled_from(["chat/completions", "completions"]),
       raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzzed_bad_requests_get_4xx_and_never_carry_injected_params(
        stack, router, recorder, fields, endpoint, raw):
    body = {**fields, "kv_transfer_params": {"remote_host": MARK, "do_remote_prefill": True,
                                             "remote_block_ids": [[1, 2]]}}
    if "model" not in fields and endpoint == "completions":
        body["model"] = MODEL
    payload = raw if raw is not None else json.dumps(body).encode()
    with httpx.Client(timeout=120) as c:
        r = c.post(f"{router.url}/v1/{endpoint}", content=payload,
                   headers={"content-type": "application/json", "x-kv-source": MARK,
                            "x-prefiller-host-port": MARK})
    assert r.status_code < 500, (r.status_code, r.text[:300], payload[:300])
    assert all(MARK.encode() not in b for _, b in recorder.bodies)


def test_indexer_down_dead_and_reset_prefill_still_answer_correctly(http, stack):
    dead_port = free_ports(1)[0]  # nothing listens here
    hang, reset = FaultyPort("hang"), FaultyPort("reset")
    insts = [{"name": "prefill-dead", "url": f"http://127.0.0.1:{dead_port}", "role": "prefill"},
             {"name": "prefill-hang", "url": f"http://127.0.0.1:{hang.port}", "role": "prefill"},
             {"name": "prefill-reset", "url": f"http://127.0.0.1:{reset.port}", "role": "prefill"},
             *({"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
               for i in stack.instances)]
    cfg = router_config(stack, instances=insts, indexer=f"http://127.0.0.1:{dead_port}",
                        max_retries=3, timeouts={"prefill_s": 8.0, "decode_idle_s": 60.0},
                        health_interval_s=60)
    try:
        with RouterServer(cfg, health_checks=False) as srv:
            prompt = ids(21, 120)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "ignore_eos": True,
                    "return_token_ids": True}
            ref = reference(http, stack, "/v1/completions", body)
            for n in range(4):  # round-robin walks into every faulty prefill
                r = http.post(srv.url + "/v1/completions", timeout=300,
                              json={**body, "temperature": 0, "conversation_id": f"faults-{n}"})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
            assert router_metric(http, srv, "kvtier_router_indexer_unavailable_total") >= 4
            for kind in ("connect", "timeout", "protocol"):
                assert router_metric(http, srv, "kvtier_router_upstream_errors_total",
                                     leg="prefill", kind=kind) >= 1, kind
            health = http.get(srv.url + "/healthz").json()["instances"]
            assert health["prefill-dead"]["healthy"] is False
    finally:
        hang.close()
        reset.close()


def test_decode_killed_between_turns_is_recomputed(http, stack, router):
    """Last test of the module: kills the pooled stack's decode instance."""
    conv = "kill-decode"
    body = {"model": MODEL, "max_tokens": 32, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0}
    a = ids(31, 150)
    r = http.post(router.url + "/v1/completions", json={**body, "prompt": a,
                                                        "conversation_id": conv})
    r.raise_for_status()
    nxt = a + r.json()["choices"][0]["token_ids"] + ids(32, 30)
    ref = reference(http, stack, "/v1/completions", {**body, "prompt": nxt})
    stack.kill(stack.decode[0].spec.name)
    r2 = http.post(router.url + "/v1/completions", json={**body, "prompt": nxt,
                                                         "conversation_id": conv})
    assert r2.status_code == 200, r2.text
    assert r2.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert router_metric(http, router, "kvtier_router_retries_total", leg="decode",
                         action="recompute") >= 1
