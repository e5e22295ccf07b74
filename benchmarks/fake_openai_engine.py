"""A minimal, fast OpenAI-compatible engine: a load-generator target.

Used ONLY by benchmarks/bench_router.py to isolate the router's own cost from
model time (not a test fake: tests run against real vLLM). It answers
``/v1/completions`` and ``/v1/chat/completions`` (streaming and not) with a
fixed number of tokens, ``/health``, ``/v1/models`` and ``/tokenize``, and
mimics vLLM's P/D fields: a prefill leg (``do_remote_decode``) gets
``kv_transfer_params`` back; ``return_token_ids`` adds token ids.

``--token-delay-ms`` spaces the tokens (a real stream: the first content chunk comes one delay
after the request). ``--params-feed tcp://127.0.0.1:PORT`` makes it a decode node with
kvtier's params feed (what ``KVTierNixlConnector`` publishes, ``kvtier.wire.params_feed``):
for every finished decode leg (a request carrying ``kv_transfer_params``), streamed or not,
it publishes the params it retained and the request's token ids (prompt + generated) under
a vLLM-shaped engine request id (``chatcmpl-<X-Request-Id>-<8 hex>``), just before the
stream's ``[DONE]``. Prompt ids: the request's token-id prompt, else ``/tokenize``'s.

    python benchmarks/fake_openai_engine.py --port 9100 --tokens 16 \
        [--token-delay-ms 2] [--params-feed tcp://127.0.0.1:9190]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

PROMPT_IDS = list(range(40))  # what /tokenize answers for any text


def build(tokens: int, token_delay_s: float, name: str,
          params_feed: str | None = None) -> Starlette:
    counter = {"n": 0}
    publish = None
    if params_feed:
        import zmq

        from kvtier.wire.params_feed import FinishedParams

        sock = zmq.Context.instance().socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 4096)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(params_feed)

        def publish(request: Request, body: dict, chat: bool, kvp: dict | None,
                    n: int) -> None:
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

    def kv(body: dict) -> dict | None:
        p = body.get("kv_transfer_params") or {}
        if p.get("do_remote_decode") or p.get("do_remote_prefill"):
            counter["n"] += 1
            return {"do_remote_prefill": bool(p.get("do_remote_decode")),
                    "do_remote_decode": not p.get("do_remote_decode"),
                    "remote_block_ids": [[1, 2, 3]], "remote_engine_id": name,
                    "remote_request_id": f"r{counter['n']}", "remote_host": "127.0.0.1",
                    "remote_port": 5600, "remote_num_tokens": 40, "tp_size": 1}
        return None

    async def gen(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        n = min(int(body.get("max_tokens") or tokens), tokens)
        rid = f"cmpl-{time.monotonic_ns()}"
        created = int(time.time())
        model = body.get("model", "fake")
        if body.get("stream"):
            kvp = kv(body) if publish is not None else None

            async def events():
                for i in range(n):
                    if token_delay_s:
                        await asyncio.sleep(token_delay_s)
                    if chat:
                        ch = {"index": 0, "delta": {"content": "tok "}, "finish_reason":
                              "length" if i == n - 1 else None}
                    else:
                        ch = {"index": 0, "text": "tok ", "finish_reason":
                              "length" if i == n - 1 else None}
                    obj = {"id": rid, "object": "chat.completion.chunk" if chat else
                           "text_completion", "created": created, "model": model, "choices": [ch]}
                    yield ("data: " + json.dumps(obj) + "\n\n").encode()
                if publish is not None:
                    publish(request, body, chat, kvp, n)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        if token_delay_s:
            await asyncio.sleep(token_delay_s * n)
        ch: dict = {"index": 0, "finish_reason": "length"}
        if chat:
            ch["message"] = {"role": "assistant", "content": "tok " * n}
        else:
            ch["text"] = "tok " * n
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion",
               "created": created, "model": model, "choices": [ch],
               "usage": {"prompt_tokens": 40, "completion_tokens": n, "total_tokens": 40 + n},
               "kv_transfer_params": kv(body)}
        if publish is not None and body.get("kv_transfer_params"):
            publish(request, body, chat, out["kv_transfer_params"], n)
        if body.get("return_token_ids"):
            ch["token_ids"] = list(range(100, 100 + n))
            if chat:
                out["prompt_token_ids"] = list(range(40))
            else:
                ch["prompt_token_ids"] = list(range(40))
        return JSONResponse(out)

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def tokenize(_: Request) -> Response:
        return JSONResponse({"count": 40, "tokens": PROMPT_IDS, "max_model_len": 4096})

    return Starlette(routes=[
        Route("/v1/completions", gen, methods=["POST"]),
        Route("/v1/chat/completions", gen, methods=["POST"]),
        Route("/health", health), Route("/v1/models", models),
        Route("/tokenize", tokenize, methods=["POST"]),
    ])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-delay-ms", type=float, default=0.0)
    ap.add_argument("--name", default="fake")
    ap.add_argument("--params-feed", default=None, metavar="tcp://HOST:PORT",
                    help="bind kvtier's finished-request params feed here (a decode node)")
    a = ap.parse_args()
    uvicorn.run(build(a.tokens, a.token_delay_ms / 1e3, a.name, a.params_feed),
                host="127.0.0.1", port=a.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
