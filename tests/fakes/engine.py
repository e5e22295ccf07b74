"""The fake vLLM P/D engine: what the router talks to where no model runs.

Two faces of one fake, for the two ways a test or benchmark reaches an engine:

**In process** (unit and integration tests): ``FakeEngines``, one ``httpx`` transport
answering for every engine (and the indexer) of a 1P1D-style bidirectional NIXL stack, at
the logical URLs ``P_URL``, ``P2_URL``, ``D_URL`` and ``IDX_URL``. Prefill legs
(``max_tokens=1``, ``do_remote_decode``) return P's block params, decode legs return the
generated ids (``GEN``) and D's retained-KV params, ``/tokenize`` tokenizes characters,
and ``/v1/route`` answers as the indexer was told to (calls kept in ``indexer_calls``).
Every engine call is kept in ``calls`` (with its headers); ``fail(url, ...)`` queues faults for the next completion calls
to one engine: ``"connect"``, ``"timeout"``, an HTTP status, or, for what a broken engine
sends with a 200: ``"garbage"`` (not JSON / not SSE), ``"error_event"`` (a stream whose first
event is an error), ``"midstream"`` (a stream whose connection breaks after one event),
``"cut"`` (a stream that ends after one event without ``[DONE]``), ``"bad_event"`` (a
stream whose second event is not SSE) and ``"bad_data"`` (a stream whose second event's data
is not JSON, then ``[DONE]``). Streamed answers arrive content chunk by content
chunk. ``feed`` (when set) is called, as ``KVTierNixlConnector`` would publish, with the
engine request id vLLM derives from the leg's ``X-Request-Id`` and D's retained params, for
every streamed decode leg; ``stream_params=True`` also puts those params into the stream's
last chunk, as an engine that streams them would.

**Out of process** (``benchmarks/bench_router.py``, ``tests/integration/test_router_workers.py``,
``tests/integration/test_router_faults_under_load.py``):
a real HTTP server, a load-generator target fast enough to isolate a proxy's own cost::

    python tests/fakes/engine.py --port 9100 --tokens 16 \\
        [--token-delay-ms 2] [--params-feed tcp://127.0.0.1:9190]

(or ``python -m tests.fakes.engine`` from the repository root). It answers
``/v1/completions`` and ``/v1/chat/completions`` (streaming and not) with ``--tokens`` tokens
(``"tok "`` each, ids 100, 101, ...), ``/health``, ``/v1/models`` and ``/tokenize`` (40 ids
for any text), and mimics vLLM's P/D fields: a P/D leg gets ``kv_transfer_params`` back;
``return_token_ids`` adds token ids. It keeps no calls; faults are set from outside, under
load, by ``POST /fake/faults`` (``{"stall": true}``: completions get no answer until
``{"stall": false}`` while ``/health`` stays 200, as a wedged engine; ``{"garbage": N}``: the
next N streamed answers turn to garbage mid-stream, a non-streamed one is cut JSON), and a
process is killed by its signal. ``--ledger FILE`` appends one line per leg answered in full
(``read_ledger``): a prefill's params name the request they were computed for, so the ledger
shows, per answer, which prefill and which decode served it and whether the decode got that
very request's prefill (one prefill and one decode leg per answer).
``--token-delay-ms`` spaces the tokens (a real stream: the first content chunk comes one
delay after the request). ``--params-feed tcp://HOST:PORT`` makes it a decode node with
kvtier's params feed (``kvtier.wire.params_feed``): for every finished decode leg (a request
carrying ``kv_transfer_params``), streamed or not, it publishes the params it retained and
the request's token ids (prompt + generated) under a vLLM-shaped engine request id
(``chatcmpl-<X-Request-Id>-<8 hex>``), just before the stream's ``[DONE]``. Prompt ids: the
request's token-id prompt, else ``/tokenize``'s.

The two faces answer alike in shape, not in content: the in-process one is exact and
recorded (tests assert on every id and call), the server is cheap per request (a benchmark
measures the proxy, not the fake). ``benchmarks/`` may use this module (it runs the server
by path); it imports nothing from ``tests``, so running it as a script needs no path setup.

Threading model: ``FakeEngines`` is driven by the client's event loop (httpx calls
``handle_async_request`` there); a test reads ``calls`` between requests. The server is one
uvicorn event loop; its counter and the ZMQ PUB socket are touched only there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.wire.leases import RETAIN_KEY
from kvtier.wire.params_feed import FinishedParams

GEN = [901, 902, 903]  # what every decode generates
BLOCK_SIZE = 4
P_URL, P2_URL, D_URL, IDX_URL = ("http://p0.test:8001", "http://p1.test:8002",
                                 "http://d0.test:8003", "http://idx.test:9000")

Fault = str | int  # "connect" | "timeout" | an HTTP status


@dataclass
class Call:
    url: str  # scheme://host:port of the engine
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    raw: bytes = b""

    @property
    def kvp(self) -> dict[str, Any]:
        kvp: dict[str, Any] = self.body.get("kv_transfer_params") or {}
        return kvp

    @property
    def is_prefill(self) -> bool:
        return self.body.get("max_tokens") == 1 and bool(self.kvp.get("do_remote_decode"))


@dataclass
class FakeEngines(httpx.AsyncBaseTransport):
    calls: list[Call] = field(default_factory=list)
    faults: dict[str, list[Fault]] = field(default_factory=dict)
    lookup: list[dict[str, Any]] = field(default_factory=list)  # indexer "matches"
    source: dict[str, Any] | None = None  # indexer "source"
    indexer_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    feed: Callable[[str, FinishedParams], None] | None = None  # (engine url, message)
    stream_params: bool = False
    # token ids a Responses engine renders before the input that /tokenize does not (an
    # engine whose Responses rendering differs from its chat rendering)
    responses_render_prefix: list[int] = field(default_factory=list)
    # a decode node whose connector predates ``kvtier_decode_retain``: it keeps every turn
    ignore_retain: bool = False

    def fail(self, url: str, *faults: Fault) -> None:
        self.faults.setdefault(url, []).extend(faults)

    def completions(self, url: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.path.endswith("completions")
                and (url is None or c.url == url)]

    def prefills(self) -> list[Call]:
        return [c for c in self.completions() if c.is_prefill]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        path = request.url.path
        raw = await request.aread()
        body: dict[str, Any] = json.loads(raw) if raw else {}
        if path == "/health":
            return httpx.Response(200)
        if path.startswith("/v1/") and request.url.host == "idx.test":
            self.indexer_calls.append((path, body))
        if path == "/v1/route":
            src = {"tier": "CPU", **self.source} if self.source else None
            return httpx.Response(200, json={
                "block_size": BLOCK_SIZE, "source": src,
                "matches": [{"tier": "GPU", **m} for m in self.lookup],
                "target_matched_tokens": 0, "delta": src["matched_tokens"] if src else 0})
        self.calls.append(Call(url, path, body, {k.lower(): v for k, v in request.headers.items()},
                               raw))
        if self.ignore_retain and isinstance(body.get("kv_transfer_params"), dict):
            body = {**body, "kv_transfer_params": {
                k: v for k, v in body["kv_transfer_params"].items() if k != RETAIN_KEY}}
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": _chat_ids(body)})
        queued = self.faults.get(url)
        if queued:
            fault = queued.pop(0)
            if fault == "connect":
                raise httpx.ConnectError("refused", request=request)
            if fault == "timeout":
                raise httpx.ReadTimeout("timed out", request=request)
            if isinstance(fault, str):
                return _broken(fault, bool(body.get("stream")), request)
            return httpx.Response(int(fault), json={"error": {"message": "injected"}})
        if path.startswith("/v1/responses"):
            if (self.feed is not None and body.get("stream") and body.get("kv_transfer_params")
                    and path == "/v1/responses"):
                # vLLM's Responses request id is the body's request_id
                prompt = [*self.responses_render_prefix, *_responses_ids(body)]
                self.feed(url, FinishedParams(str(body.get("request_id", "resp_x")),
                                              _d_params(url, prompt, body["kv_transfer_params"]),
                                              (*prompt, *GEN)))
            return _responses(url, path, body, len(self.calls), self.responses_render_prefix)
        resp = _answer(url, path, body, self.stream_params)
        if self.feed is not None and body.get("stream") and path.endswith("completions"):
            prompt = _prompt_ids(path, body)
            rid = f"cmpl-{request.headers.get('x-request-id', '')}-0-1a2b3c4d"
            self.feed(url, FinishedParams(rid, _d_params(url, prompt,
                                                         body.get("kv_transfer_params")),
                                          (*prompt, *GEN)))
        return resp


def _responses_ids(body: dict[str, Any]) -> list[int]:
    """The prompt of a Responses request as this fake renders it: characters of the
    instructions and of every input message's content, like ``/tokenize`` of chat."""
    texts = [body["instructions"]] if body.get("instructions") else []
    inp = body.get("input")
    texts += [inp] if isinstance(inp, str) else [str(m.get("content", "")) for m in inp or []]
    return [ord(ch) for t in texts for ch in t]


def _responses(url: str, path: str, body: dict[str, Any], n: int,
               render_prefix: list[int] | None = None) -> httpx.Response:
    """vLLM's Responses API, enough for the router: ids name the engine that stored them;
    P/D legs (``kv_transfer_params``) answer like completions do, and
    ``enable_response_messages`` adds the prompt's and the answer's token ids."""
    host = url.split("//")[1].split(".")[0]
    if path != "/v1/responses":  # GET /v1/responses/{id}
        rid = path.rsplit("/", 1)[1]
        if not rid.startswith(f"resp_{host}_"):
            return httpx.Response(404, json={"error": {"message": "not found"}})
        return httpx.Response(200, json={"id": rid, "object": "response", "output": []})
    resp = {"id": f"resp_{host}_{n}", "object": "response", "status": "completed",
            "previous_response_id": body.get("previous_response_id"),
            "output": [{"type": "message", "content": [{"type": "output_text",
                                                        "text": "abc"}]}],
            "kv_transfer_params": {"remote_host": "10.9.9.9"}}
    kvp = body.get("kv_transfer_params")
    prompt = [*(render_prefix or []), *_responses_ids(body)]
    prefill = body.get("max_output_tokens") == 1 and bool((kvp or {}).get("do_remote_decode"))
    gen = GEN[:1] if prefill else GEN
    if prefill:
        resp["kv_transfer_params"] = {"do_remote_prefill": True, **_blocks(url, "P", len(prompt))}
    elif kvp is not None:
        resp["kv_transfer_params"] = _d_params(url, prompt, kvp)
    if body.get("enable_response_messages"):
        resp["input_messages"] = [{"message": "", "tokens": prompt, "type": "raw_message_tokens"}]
        resp["output_messages"] = [{"message": "abc", "tokens": gen,
                                    "type": "raw_message_tokens"}]
    if not body.get("stream"):
        return httpx.Response(200, json=resp)
    events = [(b"response.created", {"type": "response.created", "response": resp}),
              *((b"response.output_text.delta", {"type": "response.output_text.delta",
                                                 "delta": ch}) for ch in "abc"),
              (b"response.completed", {"type": "response.completed", "response": resp})]
    return httpx.Response(200, stream=_Events([b"event: " + k + b"\ndata: "
                                               + json.dumps(v).encode() + b"\n\n"
                                               for k, v in events]),
                          headers={"content-type": "text/event-stream"})


def _d_params(url: str, prompt: list[int], asked: dict[str, Any] | None = None,
              ) -> dict[str, Any]:
    # Bidirectional D: keeps prompt + generated KV (the last sampled token never ran), unless
    # the leg asked it to keep nothing (KVTierNixlConnector: no blocks named).
    kept = {"do_remote_decode": True, **_blocks(url, "D", len(prompt) + len(GEN) - 1)}
    if (asked or {}).get(RETAIN_KEY) is False:
        kept.update(remote_block_ids=[], remote_num_tokens=0, remote_blocks_expiry_time=None)
    return kept


def _chat_ids(body: dict[str, Any]) -> list[int]:
    return [ord(ch) for m in body.get("messages", []) for ch in str(m.get("content", ""))]


def _prompt_ids(path: str, body: dict[str, Any]) -> list[int]:
    if path.endswith("chat/completions"):
        return list(body.get("kv_transfer_params", {}).get("prompt_token_ids")
                    or _chat_ids(body))
    p = body["prompt"]
    return list(p) if isinstance(p, list) else [ord(ch) for ch in p]


def _blocks(url: str, engine: str, n: int) -> dict[str, Any]:
    return {"remote_block_ids": [list(range(100, 100 + -(-n // BLOCK_SIZE)))],
            "remote_engine_id": engine, "remote_request_id": f"{engine}-req",
            "remote_host": url.split("//")[1].split(":")[0], "remote_port": 5600,
            "remote_num_tokens": n}


def _answer(url: str, path: str, body: dict[str, Any],
            stream_params: bool = False) -> httpx.Response:
    chat = path.endswith("chat/completions")
    prompt = _prompt_ids(path, body)
    prefill = body.get("max_tokens") == 1 and bool(
        (body.get("kv_transfer_params") or {}).get("do_remote_decode"))
    gen = GEN[:1] if prefill else GEN
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": "abc"}
    else:
        choice["text"] = "abc"
    if body.get("return_token_ids"):
        choice["token_ids"] = gen
        if not chat:
            choice["prompt_token_ids"] = prompt
    resp: dict[str, Any] = {
        "id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
        "created": 0, "model": body.get("model"), "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(gen),
                  "total_tokens": len(prompt) + len(gen)}}
    if chat and body.get("return_token_ids"):
        resp["prompt_token_ids"] = prompt
    if prefill:
        resp["kv_transfer_params"] = {"do_remote_prefill": True,
                                      **_blocks(url, "P", len(prompt))}
    elif body.get("kv_transfer_params") is not None or body.get("return_token_ids"):
        resp["kv_transfer_params"] = _d_params(url, prompt, body.get("kv_transfer_params"))
    if body.get("stream"):
        return _sse(resp, chat, stream_params)
    return httpx.Response(200, json=resp)


def _sse(resp: dict[str, Any], chat: bool, stream_params: bool) -> httpx.Response:
    kind = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for i, piece in enumerate("abc"):
        last = i == 2
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": piece}, "finish_reason": "length" if last else None}
            if chat else {"index": 0, "text": piece, "finish_reason": "length" if last else None})
        chunk = {"id": resp["id"], "object": kind, "created": 0, "model": resp["model"],
                 "choices": [choice]}
        if last and stream_params and "kv_transfer_params" in resp:
            chunk["kv_transfer_params"] = resp["kv_transfer_params"]
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return httpx.Response(200, stream=_Events(events),
                          headers={"content-type": "text/event-stream"})


class _Events(httpx.AsyncByteStream):
    """A body that arrives event by event (bytes content would be read in one go); with
    ``then_break`` the connection breaks after the events."""

    def __init__(self, events: list[bytes], then_break: httpx.Request | None = None) -> None:
        self.events = events
        self.then_break = then_break

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for e in self.events:
            yield e
        if self.then_break is not None:
            raise httpx.RemoteProtocolError("peer closed connection", request=self.then_break)


_CHUNK = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'


def _broken(fault: str, stream: bool, request: httpx.Request) -> httpx.Response:
    sse = {"content-type": "text/event-stream"}
    if fault == "garbage":
        if stream:
            return httpx.Response(200, stream=_Events([b"<html>502 Bad Gateway</html>\n\n"]),
                                  headers=sse)
        return httpx.Response(200, content=b"<html>not json</html>")
    if fault == "error_event":
        return httpx.Response(200, stream=_Events([
            b'data: {"error": {"message": "engine overloaded", "code": 500}}\n\n',
            b"data: [DONE]\n\n"]), headers=sse)
    if fault == "midstream":
        return httpx.Response(200, stream=_Events([_CHUNK], then_break=request), headers=sse)
    if fault == "cut":
        return httpx.Response(200, stream=_Events([_CHUNK]), headers=sse)
    if fault == "bad_data":
        return httpx.Response(200, stream=_Events([_CHUNK, b'data: {"id":"x","choi\n\n',
                                                   b"data: [DONE]\n\n"]), headers=sse)
    if fault == "bad_event":
        return httpx.Response(200, stream=_Events([_CHUNK, b"\x00\xffjunk\n\n",
                                                   b"data: [DONE]\n\n"]), headers=sse)
    raise ValueError(f"unknown fault {fault!r}")


# ---- out of process: the load-generator target ------------------------------------------
PROMPT_IDS = list(range(40))  # what the server's /tokenize answers for any text
TOKEN = "tok "  # the text of every generated token: an answer of n tokens is TOKEN * n


class _ServerFaults:
    """What ``POST /fake/faults`` set on a server: a stall of its completions (``/health``
    still 200) and a count of streamed answers to turn to garbage mid-stream."""

    def __init__(self) -> None:
        self.stall: Any = None  # an asyncio.Event while stalled, set when it recovers
        self.garbage = 0
        self.garbled = 0  # answers garbled so far (which garbage shape the next one gets)

    def garble(self) -> bytes | None:
        """The garbage the next streamed answer turns to, or None (a good answer)."""
        if self.garbage <= 0:
            return None
        self.garbage -= 1
        self.garbled += 1
        # Alternately bytes that are not SSE, and a data line that is not JSON (cut short).
        return (b"\x00\xff\xfe<html>502</html>\n\n" if self.garbled % 2
                else b'data: {"id":"cmpl-x","object":"text_completion","choi\n\n')


def server_app(tokens: int, token_delay_s: float, name: str,
               params_feed: str | None = None, ledger_path: str | None = None) -> Any:
    """The out-of-process face as a Starlette app (see the module docstring)."""
    import asyncio
    import time
    import uuid

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    counter = {"n": 0}
    faults = _ServerFaults()
    # One line per leg answered (line-buffered: a SIGKILL loses no finished line).
    ledger = open(ledger_path, "a", buffering=1) if ledger_path else None  # noqa: SIM115

    def record(request: Request, body: dict[str, Any]) -> None:
        """The ledger line of a leg this engine answered in full (see ``read_ledger``)."""
        if ledger is None:
            return
        rid = request.headers.get("x-request-id", "-")
        p = body.get("kv_transfer_params") or {}
        if p.get("do_remote_decode"):
            ledger.write(f"P {rid} {name} -\n")
        elif p.get("do_remote_prefill"):
            # The prefill leg whose params this decode got: its request id must be ours.
            src = str(p.get("remote_request_id", "")).partition("@")[2]
            ledger.write(f"D {src or '-'} {name} "
                         f"{'ok' if src and rid.startswith(src) else 'mismatch'}\n")
        else:
            ledger.write(f"X {rid} {name} -\n")

    publish: Callable[[Request, dict[str, Any], bool, dict[str, Any] | None, int], None] | None
    publish = None
    if params_feed:
        import zmq

        sock = zmq.Context.instance().socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 4096)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(params_feed)

        def publish(request: Request, body: dict[str, Any], chat: bool,
                    kvp: dict[str, Any] | None, n: int) -> None:
            if kvp is None:
                return
            rid = request.headers.get("x-request-id") or uuid.uuid4().hex
            eid = (f"chatcmpl-{rid}-{uuid.uuid4().hex[:8]}" if chat
                   else f"cmpl-{rid}-0-{uuid.uuid4().hex[:8]}")
            prompt = body.get("prompt")
            ids = (prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
                   else PROMPT_IDS)
            msg = FinishedParams(eid, kvp, (*ids, *range(100, 100 + n)))
            try:
                sock.send_multipart(msg.frames(), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def kv(body: dict[str, Any], rid: str) -> dict[str, Any] | None:
        p = body.get("kv_transfer_params") or {}
        if p.get("do_remote_decode") or p.get("do_remote_prefill"):
            counter["n"] += 1
            return {"do_remote_prefill": bool(p.get("do_remote_decode")),
                    "do_remote_decode": not p.get("do_remote_decode"),
                    "remote_block_ids": [[1, 2, 3]], "remote_engine_id": name,
                    "remote_request_id": f"r{counter['n']}@{rid}", "remote_host": "127.0.0.1",
                    "remote_port": 5600, "remote_num_tokens": 40, "tp_size": 1}
        return None

    async def gen(request: Request) -> Response:
        body = await request.json()
        if faults.stall is not None:
            # Wedged: no answer until it recovers (its /health still says 200), and none
            # at all to a caller that gave up meanwhile.
            await faults.stall.wait()
            if await request.is_disconnected():
                return Response(status_code=499)
        chat = request.url.path.endswith("chat/completions")
        n = min(int(body.get("max_tokens") or tokens), tokens)
        rid = f"cmpl-{time.monotonic_ns()}"
        xrid = request.headers.get("x-request-id", "-")
        created = int(time.time())
        model = body.get("model", "fake")
        if body.get("stream"):
            kvp = kv(body, xrid) if publish is not None else None
            junk = faults.garble()

            async def events() -> AsyncIterator[bytes]:
                for i in range(n):
                    if token_delay_s:
                        await asyncio.sleep(token_delay_s)
                    if junk is not None and i == min(2, n - 1):
                        yield junk  # mid-stream; the rest follows as if nothing happened
                    if chat:
                        ch = {"index": 0, "delta": {"content": TOKEN}, "finish_reason":
                              "length" if i == n - 1 else None}
                    else:
                        ch = {"index": 0, "text": TOKEN, "finish_reason":
                              "length" if i == n - 1 else None}
                    obj = {"id": rid, "object": "chat.completion.chunk" if chat else
                           "text_completion", "created": created, "model": model, "choices": [ch]}
                    yield ("data: " + json.dumps(obj) + "\n\n").encode()
                if publish is not None:
                    publish(request, body, chat, kvp, n)
                if junk is None:
                    record(request, body)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        if token_delay_s:
            await asyncio.sleep(token_delay_s * n)
        if faults.garble() is not None:
            return Response(b'{"id":"cmpl-x","object":"text_completion","choi', status_code=200,
                            media_type="application/json")
        ch: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            ch["message"] = {"role": "assistant", "content": TOKEN * n}
        else:
            ch["text"] = TOKEN * n
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion",
               "created": created, "model": model, "choices": [ch],
               "usage": {"prompt_tokens": 40, "completion_tokens": n, "total_tokens": 40 + n},
               "kv_transfer_params": kv(body, xrid)}
        if publish is not None and body.get("kv_transfer_params"):
            publish(request, body, chat, out["kv_transfer_params"], n)
        if body.get("return_token_ids"):
            ch["token_ids"] = list(range(100, 100 + n))
            if chat:
                out["prompt_token_ids"] = list(range(40))
            else:
                ch["prompt_token_ids"] = list(range(40))
        record(request, body)
        return JSONResponse(out)

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def tokenize(_: Request) -> Response:
        return JSONResponse({"count": 40, "tokens": PROMPT_IDS, "max_model_len": 4096})

    async def set_faults(request: Request) -> Response:
        """``{"stall": true|false, "garbage": N}``, either or both."""
        body = await request.json()
        if "stall" in body:
            if body["stall"] and faults.stall is None:
                faults.stall = asyncio.Event()
            elif not body["stall"] and faults.stall is not None:
                faults.stall.set()
                faults.stall = None
        if "garbage" in body:
            faults.garbage = int(body["garbage"])
        return JSONResponse({"stall": faults.stall is not None, "garbage": faults.garbage})

    return Starlette(routes=[
        Route("/v1/completions", gen, methods=["POST"]),
        Route("/v1/chat/completions", gen, methods=["POST"]),
        Route("/health", health), Route("/v1/models", models),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/fake/faults", set_faults, methods=["POST"]),
    ])


@dataclass(frozen=True)
class Leg:
    """One ``--ledger`` line: a leg an engine answered in full. ``kind`` P (prefill), D (a
    decode given a prefill's params) or X (a whole answer: direct, or a decode without
    params); ``rid`` the router's request id (for D: the one of the prefill whose params it
    got); ``ok`` for D: whether those params came from a prefill of this same request."""

    kind: str
    rid: str
    engine: str
    ok: bool


def read_ledger(*paths: str) -> list[Leg]:
    """The legs the servers writing ``paths`` answered (a missing file: none)."""
    out = []
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) == 4:
                out.append(Leg(parts[0], parts[1], parts[2], parts[3] != "mismatch"))
    return out


def main() -> None:
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description="the fake vLLM P/D engine as an HTTP server")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-delay-ms", type=float, default=0.0)
    ap.add_argument("--name", default="fake")
    ap.add_argument("--params-feed", default=None, metavar="tcp://HOST:PORT",
                    help="bind kvtier's finished-request params feed here (a decode node)")
    ap.add_argument("--ledger", default=None, metavar="FILE",
                    help="append one line per leg answered in full (read_ledger)")
    a = ap.parse_args()
    uvicorn.run(server_app(a.tokens, a.token_delay_ms / 1e3, a.name, a.params_feed, a.ledger),
                host="127.0.0.1", port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
