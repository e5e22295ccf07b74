"""Inbound request validation and the bodies of each engine leg.

Every body an engine gets is built here, from the validated request and typed params
(``KVTransferParams`` for a prefill leg, the prefill's ``NixlParams`` for a decode leg);
nothing patches a body after it is built.

The router validates only what it relies on (model, messages/prompt shape,
stream, n, max tokens, conversation id) and passes every other field through
to vLLM, which validates the rest and answers 4xx itself. Client-supplied
``kv_transfer_params`` are always stripped here, before anything else sees the request;
engines get an allow-list of headers only (``forward_headers``).

Threading model: pure functions over immutable inputs; no shared state.
"""

from __future__ import annotations

import copy
from enum import Enum
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from kvtier.ids import ConversationId
from kvtier.transfer_params import INBOUND_STRIP_KEYS, KVTransferParams, NixlParams
from kvtier.wire.leases import PARAM_KEY as LEASE_PARAM
from kvtier.wire.leases import RETAIN_KEY as RETAIN_PARAM

MAX_CONVERSATION_ID_LEN = 256
# Options that mean nothing for a 1-token, non-streaming prefill leg (or that
# would conflict with max_tokens=1).
_PREFILL_DROP = (
    "stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "echo",
    "min_tokens", "max_completion_tokens", "return_token_ids", "prompt_logprobs",
    "use_beam_search", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "stop", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "logit_bias",
)
# Router-only fields never forwarded to an engine.
_ROUTER_FIELDS = ("conversation_id",)


class Endpoint(str, Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    # OpenAI's Responses API, for a whole conversation sent as input (``previous_response_id``,
    # a ``conversation`` object and ``background`` are passed through: router/responses.py)
    RESPONSES = "responses"

    @property
    def path(self) -> str:
        return _PATHS[self]


_PATHS = {Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETIONS: "/v1/completions",
          Endpoint.RESPONSES: "/v1/responses"}
# What a Responses prefill leg does not need, or must not do: it generates one token, stores
# nothing and streams nothing (``max_output_tokens``, ``store``, ``stream`` are set).
_RESPONSES_PREFILL_DROP = ("stream", "stream_options", "background", "max_output_tokens",
                           "store", "include", "text", "top_logprobs", "enable_response_messages")


_M = TypeVar("_M", bound=BaseModel)


class BadRequest(Exception):
    """Client error; becomes an HTTP 4xx with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error",
                          "param": self.param, "code": self.status}}


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1, max_length=64)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=1024)
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=128)
    max_tokens: StrictInt | None = Field(None, ge=0)
    conversation_id: str | None = Field(None, min_length=1, max_length=MAX_CONVERSATION_ID_LEN)
    return_token_ids: StrictBool | None = None
    echo: StrictBool | None = None
    prompt_logprobs: StrictInt | None = None
    use_beam_search: StrictBool | None = None


class _Chat(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)


class _Completion(_Common):
    # str | token list | batch of either. Ints are token ids, validated by vLLM.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]


class _Responses(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=1024)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    stream: StrictBool = False
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    conversation_id: str | None = Field(None, min_length=1, max_length=MAX_CONVERSATION_ID_LEN)
    enable_response_messages: StrictBool | None = None


class Inbound(BaseModel):
    """A validated, sanitized client request."""

    model_config = ConfigDict(frozen=True)

    endpoint: Endpoint
    body: dict[str, Any]  # sanitized: no kv_transfer_params, no router fields
    model: str
    stream: bool
    conversation: ConversationId | None
    client_wants_token_ids: bool
    include_usage: bool
    # Direct: serve on one instance, no P/D split (n>1, batches, beam search,
    # prompt logprobs, echo: these need the prompt computed where they run).
    mode: Literal["pd", "direct"]
    prompt_ids: tuple[int, ...] | None  # known up front (completions token prompt)


def parse_inbound(endpoint: Endpoint, raw: Any, headers: dict[str, str]) -> Inbound:
    """Validate a decoded JSON body; raise BadRequest (4xx) on anything unusable."""
    if not isinstance(raw, dict):
        raise BadRequest("request body must be a JSON object")
    if endpoint is Endpoint.RESPONSES:
        return _parse_responses(raw, headers)
    req = _validated(_Chat if endpoint is Endpoint.CHAT else _Completion, raw)
    conv, body = _named_and_sanitized(raw, headers)
    prompt_ids: tuple[int, ...] | None = None
    batch = False
    if endpoint is Endpoint.COMPLETIONS:
        p = raw["prompt"]
        if isinstance(p, list) and p and isinstance(p[0], (list, str)):
            batch = len(p) != 1
            if not batch:
                body["prompt"] = p = p[0]
        if isinstance(p, list) and not batch:
            if not p:
                raise BadRequest("prompt must not be empty", param="prompt")
            if any(t < 0 for t in p):
                raise BadRequest("token ids must be non-negative", param="prompt")
            prompt_ids = tuple(p)
    direct = bool(batch or req.n > 1 or req.use_beam_search or req.echo
                  or req.prompt_logprobs is not None)
    # Every field is of its type already: no second validation (it copied the body).
    return Inbound.model_construct(
        endpoint=endpoint,
        body=body,
        model=req.model,
        stream=req.stream,
        conversation=ConversationId(conv) if conv else None,
        client_wants_token_ids=bool(req.return_token_ids),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        mode="direct" if direct else "pd",
        prompt_ids=prompt_ids,
    )


def _validated(model_cls: type[_M], raw: dict[str, Any]) -> _M:
    try:
        return model_cls.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise BadRequest(f"invalid field {loc!r}: {first.get('msg')}", param=loc or None) from None


def _named_and_sanitized(raw: dict[str, Any], headers: dict[str, str],
                         ) -> tuple[str | None, dict[str, Any]]:
    """The conversation the request names (checked), and its body for the engines: no
    client transfer params, no router-only fields."""
    conv, named_by = session_name(raw, headers)
    if conv is not None and not (0 < len(conv) <= MAX_CONVERSATION_ID_LEN):
        raise BadRequest(f"{named_by} must be 1..256 characters", param=named_by)
    body = {k: v for k, v in raw.items()
            if k not in INBOUND_STRIP_KEYS and k not in _ROUTER_FIELDS}
    return conv, body


def _parse_responses(raw: dict[str, Any], headers: dict[str, str]) -> Inbound:
    """A Responses request for the P/D flow (the caller sends only those without
    ``previous_response_id`` and ``background`` here)."""
    req = _validated(_Responses, raw)
    conv, body = _named_and_sanitized(raw, headers)
    return Inbound.model_construct(
        endpoint=Endpoint.RESPONSES, body=body, model=req.model, stream=req.stream,
        conversation=ConversationId(conv) if conv else None,
        client_wants_token_ids=bool(req.enable_response_messages),
        include_usage=False, mode="pd", prompt_ids=None)


# Where a conversation's name is read from, first found wins: kvtier's own name, vLLM's
# session id, OpenAI's prompt cache key. Only ``conversation_id`` is kvtier's and never
# forwarded; the others are the client's fields for the engine too and pass through.
_NAME_FIELDS = (("body", "conversation_id"), ("header", "x-conversation-id"),
                ("body", "session_id"), ("header", "x-session-id"),
                ("body", "prompt_cache_key"))


def session_name(raw: dict[str, Any], headers: dict[str, str]) -> tuple[str | None, str]:
    """The conversation a request names, and the field it was named by."""
    for where, key in _NAME_FIELDS:
        v = raw.get(key) if where == "body" else headers.get(key)
        if isinstance(v, str) and v:
            return v, key
    return None, "conversation_id"


# The only inbound headers an engine ever sees (W3C trace context); everything else a client
# sends (KV-source headers such as llm-d's x-kv-cache-source-host-port, its own
# X-Request-Id, cookies, auth) stays at the router. ``forward_headers`` adds the router's
# own request id and the engine API key.
FORWARDED_HEADERS = ("traceparent", "tracestate")


def forward_headers(headers: dict[str, str], request_id: str,
                    engine_api_key: str | None = None) -> dict[str, str]:
    """The headers every leg of one request sends to engines: an allow-list.

    ``headers`` are the client's (any case); only ``FORWARDED_HEADERS`` pass. The request id
    is the router's (``request_id``), never the client's; ``Authorization`` is the engine
    API key when one is configured, never the client's bearer token. The body is always
    JSON the router serialized, so ``content-type`` is the router's too."""
    out = {"content-type": "application/json", "x-request-id": request_id}
    for k, v in headers.items():
        lk = k.lower()
        if lk in FORWARDED_HEADERS and _header_ok(v):
            out[lk] = v
    if engine_api_key:
        out["authorization"] = f"Bearer {engine_api_key}"
    return out


def _header_ok(v: str) -> bool:
    # Trace context is short ASCII (W3C: traceparent 55 chars, tracestate <= 512).
    return len(v) <= 512 and v.isascii() and v.isprintable()


def strip_headers(headers: dict[str, str]) -> dict[str, str]:
    """Deprecated (use ``forward_headers``): the client headers that may reach an engine,
    now an allow-list of ``FORWARDED_HEADERS`` (the router sets the request id itself)."""
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}


def prefill_body(inb: Inbound, kv: KVTransferParams, prompt_ids: tuple[int, ...] | None,
                 *, want_ids: bool = False) -> dict[str, Any]:
    """A prefill leg: one token, not streamed, with the router's transfer params ``kv``.
    ``want_ids``: the engine answers the prompt's token ids (the router keeps them for the
    next turn when it had none)."""
    wire = kv.to_wire()
    if inb.endpoint is Endpoint.RESPONSES:
        # vLLM answers the prompt's token ids in ``input_messages`` (the router checks
        # them against the ids it proved reuse with)
        body = {k: v for k, v in inb.body.items() if k not in _RESPONSES_PREFILL_DROP}
        body.update(max_output_tokens=1, stream=False, store=False,
                    enable_response_messages=True, kv_transfer_params=wire)
        return body
    body = {k: v for k, v in inb.body.items() if k not in _PREFILL_DROP}
    body["max_tokens"] = 1
    body["stream"] = False
    _attach_ids(inb, body, wire, prompt_ids)
    body["kv_transfer_params"] = wire
    if want_ids:
        body["return_token_ids"] = True
    return body


def decode_body(inb: Inbound, handoff: NixlParams | None, prompt_ids: tuple[int, ...] | None,
                *, stream: bool, want_ids: bool, lease_s: float | None = None,
                retain: bool = True, feed_tag: str | None = None) -> dict[str, Any]:
    """A decode leg: the client's request with the prefill's ``handoff`` (where to read the
    prompt's KV). ``want_ids``: the answer carries the prompt's and the generated token ids
    (non-streamed, to retain the turn); ``lease_s``: the decode node's lease the router asks
    for; ``retain`` False: the node is to keep nothing of the turn (``kvtier_decode_retain``);
    ``feed_tag``: the tag of this leg on the node's params feed (a Responses leg carries
    it in its request id; other endpoints in the ``X-Request-Id`` header, ``tagged``)."""
    body = copy.copy(inb.body)
    body["stream"] = stream
    if not stream:
        body.pop("stream_options", None)
    if want_ids and inb.endpoint is Endpoint.RESPONSES:
        body["enable_response_messages"] = True  # the prompt's and the answer's token ids
    elif want_ids:
        body["return_token_ids"] = True
    kv: dict[str, Any] = handoff.model_dump(exclude_none=True) if handoff is not None else {}
    if handoff is not None and lease_s is not None:
        kv[LEASE_PARAM] = lease_s
    if handoff is not None and not retain:
        kv[RETAIN_PARAM] = False
    _attach_ids(inb, body, kv, prompt_ids)
    if kv:
        body["kv_transfer_params"] = kv
    if feed_tag is not None and inb.endpoint is Endpoint.RESPONSES:
        body["request_id"] = f"resp_{feed_tag}"  # vLLM's Responses request id is a body field
    return body


def tagged(headers: dict[str, str], feed_tag: str) -> dict[str, str]:
    """A decode leg's headers with its params-feed tag in ``X-Request-Id`` (vLLM derives the
    engine request id the node's feed names from it)."""
    rid = headers.get("x-request-id", "")
    return {**headers, "x-request-id": f"{rid}-{feed_tag}" if rid else feed_tag}


def direct_body(inb: Inbound) -> dict[str, Any]:
    return copy.copy(inb.body)


def _attach_ids(inb: Inbound, body: dict[str, Any], kv: dict[str, Any],
                prompt_ids: tuple[int, ...] | None) -> None:
    """Send the router's verified token ids so no engine re-tokenizes differently."""
    if prompt_ids is None or inb.endpoint is Endpoint.RESPONSES:
        return
    if inb.endpoint is Endpoint.COMPLETIONS:
        body["prompt"] = list(prompt_ids)
    else:
        kv["prompt_token_ids"] = list(prompt_ids)


def tokenize_body(inb: Inbound) -> dict[str, Any] | None:
    """vLLM ``/tokenize`` body that renders exactly what the engine would; None where the
    router cannot say (a Responses input it does not map to chat messages)."""
    b = inb.body
    if inb.endpoint is Endpoint.RESPONSES:
        messages = responses_messages(b)
        if messages is None or "tools" in b:
            return None  # tools: rendered from another schema than chat's
        return {"model": inb.model, "messages": messages}
    if inb.endpoint is Endpoint.COMPLETIONS:
        return {"model": inb.model, "prompt": b["prompt"],
                "add_special_tokens": b.get("add_special_tokens", True)}
    out: dict[str, Any] = {"model": inb.model, "messages": b["messages"]}
    for k in ("add_generation_prompt", "continue_final_message", "add_special_tokens",
              "chat_template", "chat_template_kwargs", "tools", "documents",
              "mm_processor_kwargs"):
        if k in b:
            out[k] = b[k]
    return out


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A Responses request's ``instructions`` + ``input`` as the chat messages vLLM renders
    it from (vllm/entrypoints/openai/responses/utils.py ``construct_input_messages``), for
    plain text messages only; None for anything else (tool calls, images, reasoning items).
    The router never trusts this alone: the prefill's own prompt ids are checked."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
        return messages
    if not isinstance(inp, list):
        return None
    for item in inp:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            return None
        role, content = item.get("role"), item.get("content")
        if role not in ("user", "assistant", "system", "developer") or content is None:
            return None
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") in ("input_text",
                                                                         "output_text")
                        and isinstance(part.get("text"), str)):
                    return None
                texts.append(part["text"])
            content = "".join(texts) if role == "assistant" else [
                {"type": "text", "text": t} for t in texts]
        elif not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    return messages
