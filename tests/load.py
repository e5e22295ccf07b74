"""Streaming clients under load, and what each answer was: the fault-under-load test's client.

``Load(url, clients, tokens).run(session, seconds)`` keeps ``clients`` streaming requests in
flight against a router for ``seconds`` (each client sends its next request as soon as its last one
ended), then lets the requests in flight finish (each bounded by ``timeout_s``). Every fourth
client names a conversation and keeps it across its turns (the conversation store is on the
path); odd clients use chat, even ones completions.

Each answer is one ``Verdict``:

- ``ok``: 200, every event SSE with a JSON object, a ``finish_reason``, ``[DONE]`` last, and
  exactly the text the fake engine generates (``tests.fakes.engine.TOKEN`` x ``tokens``);
- ``error``: what a client sees as an error: an HTTP error status, or a stream carrying an
  error event (then ended);
- ``cut``: a 200 stream that ended (or whose connection broke) without ``[DONE]`` or
  without a ``finish_reason``, and no error event: silently cut;
- ``wrong``: a 200 stream with something that is not an SSE JSON event (garbage), or whose
  text differs;
- ``hung``: no end within ``timeout_s``.

Threading model: one asyncio loop (``run`` is a coroutine); a ``Tally`` is only touched there.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import aiohttp

from tests.fakes.engine import TOKEN


class Verdict(StrEnum):
    OK = "ok"
    ERROR = "error"
    CUT = "cut"
    WRONG = "wrong"
    HUNG = "hung"


@dataclass
class Tally:
    """The answers of one run: counts per verdict, an example of each bad one, and the
    router's request id of every ``ok`` answer (to check its legs in the engines' ledgers)."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    ok_rids: list[str] = field(default_factory=list)

    def add(self, verdict: Verdict, rid: str, why: str = "") -> None:
        self.counts[verdict] += 1
        if verdict is Verdict.OK:
            self.ok_rids.append(rid)
        elif why:
            self.examples.setdefault(verdict, why[:300])

    def row(self) -> dict[str, int]:
        return {v.value: self.counts[v] for v in Verdict}


def judge(body: bytes, expected: str) -> tuple[Verdict, str]:
    """The verdict on a complete 200 stream's bytes (the connection ended cleanly)."""
    text: list[str] = []
    finished = done = errored = False
    events = body.split(b"\n\n")
    if events[-1].strip():
        tail = "partial event at the end"
    else:
        tail = ""
    for raw in events[:-1]:
        if done:
            return Verdict.WRONG, f"event after [DONE]: {raw[:80]!r}"
        if not raw.startswith(b"data: "):
            return Verdict.WRONG, f"not an SSE data event: {raw[:80]!r}"
        data = raw[6:]
        if data == b"[DONE]":
            done = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            return Verdict.WRONG, f"data is not JSON: {raw[:80]!r}"
        if not isinstance(obj, dict):
            return Verdict.WRONG, f"data is not an object: {raw[:80]!r}"
        if "error" in obj:
            errored = True
            continue
        for ch in obj.get("choices") or []:
            piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            text.append(piece or "")
            finished = finished or bool(ch.get("finish_reason"))
    if errored:
        return Verdict.ERROR, "error event"
    if tail or not done or not finished:
        return Verdict.CUT, tail or ("no [DONE]" if not done else "no finish_reason")
    got = "".join(text)
    if got != expected:
        return Verdict.WRONG, f"text {got[:80]!r}"
    return Verdict.OK, ""


class Load:
    def __init__(self, url: str, clients: int, tokens: int, timeout_s: float = 20.0) -> None:
        self.url = url
        self.clients = clients
        self.tokens = tokens
        self.timeout_s = timeout_s
        self.expected = TOKEN * tokens

    def _request(self, client: int, turn: int) -> tuple[str, dict[str, object]]:
        text = f"client {client} turn {turn}"
        body: dict[str, object] = {"model": "fake", "max_tokens": self.tokens, "stream": True}
        if client % 4 == 0:
            body["conversation_id"] = f"c{client}"
        if client % 2:
            body["messages"] = [{"role": "user", "content": text}]
            return "/v1/chat/completions", body
        body["prompt"] = text
        return "/v1/completions", body

    async def one(self, session: aiohttp.ClientSession, client: int, turn: int,
                  tally: Tally) -> None:
        path, body = self._request(client, turn)
        rid = "-"
        try:
            async with asyncio.timeout(self.timeout_s):
                async with session.post(self.url + path, json=body) as r:
                    rid = r.headers.get("x-request-id", "-")
                    if r.status != 200:
                        tally.add(Verdict.ERROR, rid, f"HTTP {r.status}")
                        return
                    try:
                        raw = await r.read()
                    except aiohttp.ClientError as e:
                        # A 200 whose connection broke: cut, unless it said why first.
                        tally.add(Verdict.CUT, rid, f"connection broke: {e!r}")
                        return
        except TimeoutError:
            tally.add(Verdict.HUNG, rid, f"no end in {self.timeout_s} s")
            return
        except aiohttp.ClientError as e:
            tally.add(Verdict.ERROR, rid, f"no answer: {e!r}")
            return
        verdict, why = judge(raw, self.expected)
        tally.add(verdict, rid, why)

    async def run(self, session: aiohttp.ClientSession, seconds: float,
                  also: Callable[[], bool] = lambda: True) -> Tally:
        """Load for ``seconds`` and until ``also()`` says enough (a fault that needs traffic
        to show: the load outlasts it)."""
        tally = Tally()
        end = time.monotonic() + seconds

        async def client(i: int) -> None:
            turn = 0
            while time.monotonic() < end or not also():
                await self.one(session, i, turn, tally)
                turn += 1

        await asyncio.gather(*(client(i) for i in range(self.clients)))
        return tally
