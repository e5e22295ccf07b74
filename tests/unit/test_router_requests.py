"""Inbound validation, stripping and leg bodies (pure logic, no servers)."""

from __future__ import annotations

import pytest

from kvtier.router.config import RouterConfig
from kvtier.router.requests import (
    BadRequest,
    Endpoint,
    decode_body,
    forward_headers,
    parse_inbound,
    prefill_body,
    strip_headers,
)
from kvtier.transfer_params import INBOUND_STRIP_HEADERS, KVTransferParams, NixlParams

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_client_kv_params_and_conversation_id_are_stripped():
    raw = {**CHAT, "kv_transfer_params": {"remote_host": "evil"}, "conversation_id": "c"}
    inb = parse_inbound(Endpoint.CHAT, raw, {})
    assert "kv_transfer_params" not in inb.body and "conversation_id" not in inb.body
    assert inb.conversation == "c"
    kv = KVTransferParams.prefill_request()
    p = prefill_body(inb, kv, None)
    assert p["kv_transfer_params"] == kv.to_wire()
    assert "remote_host" not in str(decode_body(inb, None, None, stream=False, want_ids=False))


def test_conversation_id_from_header():
    inb = parse_inbound(Endpoint.CHAT, CHAT, {"x-conversation-id": "h1"})
    assert inb.conversation == "h1"


def test_kv_source_headers_are_not_forwarded():
    hdrs = {h: "1.2.3.4:5" for h in INBOUND_STRIP_HEADERS}
    hdrs.update({"Authorization": "Bearer k", "X-Request-Id": "r", "X-Conversation-Id": "c"})
    hdrs["traceparent"] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    out = strip_headers(hdrs)
    assert out == {"traceparent": hdrs["traceparent"]}
    fwd = forward_headers(hdrs, "router-rid", "engine-key")
    assert fwd == {"content-type": "application/json", "x-request-id": "router-rid",
                   "traceparent": hdrs["traceparent"], "authorization": "Bearer engine-key"}


@pytest.mark.parametrize("raw", [
    [], "x", 3, None, {}, {"model": "tiny"}, {**CHAT, "messages": []},
    {**CHAT, "messages": [{"content": "no role"}]}, {**CHAT, "stream": "yes"},
    {**CHAT, "n": 0}, {**CHAT, "max_tokens": -1}, {**CHAT, "conversation_id": ""},
    {**CHAT, "conversation_id": "x" * 257}, {**CHAT, "model": 7},
])
def test_bad_chat_requests_are_4xx(raw):
    with pytest.raises(BadRequest) as e:
        parse_inbound(Endpoint.CHAT, raw, {})
    assert 400 <= e.value.status < 500


@pytest.mark.parametrize("prompt", [[], [-1, 2], [1.5], {"a": 1}, [[1], "x"], None])
def test_bad_completion_prompts_are_4xx(prompt):
    with pytest.raises(BadRequest):
        parse_inbound(Endpoint.COMPLETIONS, {"model": "tiny", "prompt": prompt}, {})


def test_token_prompt_is_known_up_front_and_sent_verbatim():
    inb = parse_inbound(Endpoint.COMPLETIONS, {"model": "m", "prompt": [[5, 6, 7]]}, {})
    assert inb.prompt_ids == (5, 6, 7) and inb.mode == "pd"
    kv = KVTransferParams.prefill_request()
    p = prefill_body(inb, kv, (5, 6, 7))
    assert p["prompt"] == [5, 6, 7] and p["max_tokens"] == 1 and p["stream"] is False


@pytest.mark.parametrize("extra", [{"n": 2}, {"prompt": ["a", "b"]}, {"echo": True},
                                   {"prompt_logprobs": 1}, {"use_beam_search": True}])
def test_options_needing_one_instance_go_direct(extra):
    inb = parse_inbound(Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", **extra}, {})
    assert inb.mode == "direct"


def test_prefill_leg_drops_options_of_other_legs():
    raw = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
           "top_logprobs": 3, "min_tokens": 5, "max_completion_tokens": 50, "temperature": 0}
    inb = parse_inbound(Endpoint.CHAT, raw, {})
    p = prefill_body(inb, KVTransferParams(), (1, 2, 3))
    for k in ("stream_options", "logprobs", "top_logprobs", "min_tokens", "max_completion_tokens"):
        assert k not in p
    assert p["max_tokens"] == 1 and p["temperature"] == 0
    assert p["kv_transfer_params"]["prompt_token_ids"] == [1, 2, 3]
    d = decode_body(inb, NixlParams(do_remote_prefill=True), (1, 2, 3), stream=False,
                    want_ids=True)
    assert d["stream"] is False and "stream_options" not in d and d["return_token_ids"]
    assert d["max_completion_tokens"] == 50 and d["logprobs"] is True


def test_config_shorthand_and_checks():
    c = RouterConfig.model_validate({"prefill_urls": ["http://a:1"], "decode": ["http://b:2/"]})
    assert [i.name for i in c.instances] == ["prefill-0", "decode-0"]
    assert c.decode_instances[0].url == "http://b:2"
    assert c.entry_ttl_s == 450 and c.host == "127.0.0.1"
    with pytest.raises(ValueError):
        RouterConfig.model_validate({"prefill": ["http://a:1"]})
    with pytest.raises(ValueError):
        RouterConfig.model_validate({"decode": ["ftp://b"]})
    with pytest.raises(ValueError):
        RouterConfig.model_validate({"decode": ["http://b:1"], "unknown_key": 1})


def test_shipped_router_config_loads_and_cli_flags_override(tmp_path):
    import argparse

    from kvtier.configs import CONFIG_DIR
    from kvtier.router.cli import config_from_args, register
    from kvtier.router.config import load_config

    cfg = load_config(CONFIG_DIR / "router.yaml")
    assert [i.name for i in cfg.prefill_instances] == ["prefill-0"]
    assert cfg.indexer == "http://127.0.0.1:8300" and cfg.entry_ttl_s == 450
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    args = ap.parse_args(["router", "--config", str(CONFIG_DIR / "router.yaml"), "--port", "9001"])
    assert config_from_args(args).port == 9001
    args = ap.parse_args(["router", "--prefill", "http://a:1", "--decode", "http://b:2"])
    c = config_from_args(args)
    assert c.port == 8000 and c.host == "127.0.0.1" and c.indexer is None


def test_responses_input_maps_to_the_chat_messages_vllm_renders() -> None:
    from kvtier.router.requests import responses_messages

    assert responses_messages({"input": "hi", "instructions": "be brief"}) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "c"}]}]
    assert responses_messages({"input": items}) == [
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"}]
    # anything but plain text messages: the router does not guess
    for bad in ([{"type": "function_call_output", "call_id": "c", "output": "1"}],
                [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
                [{"role": "tool", "content": "x"}], 7):
        assert responses_messages({"input": bad}) is None


def test_responses_requests_are_validated() -> None:
    from kvtier.router.requests import Endpoint, parse_inbound

    inb = parse_inbound(Endpoint.RESPONSES, {"model": "m", "input": "hi",
                                             "conversation_id": "c", "store": True}, {})
    assert inb.conversation == "c" and "conversation_id" not in inb.body
    assert inb.mode == "pd" and inb.body["store"] is True
    for raw in ({"input": "x"}, {"model": "m"}, {"model": "m", "input": ""},
                {"model": "m", "input": "x", "max_output_tokens": 0}):
        with pytest.raises(BadRequest):
            parse_inbound(Endpoint.RESPONSES, raw, {})
