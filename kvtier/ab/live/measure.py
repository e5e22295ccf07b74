"""How the live runner measures one turn (`kvtier.ab.live.runner`): the router's transport tap,
the ledger of what decode nodes pin, and the turn's record.

- `LegTap` is the router's transport: it forwards everything and records each upstream
  completion leg (`Leg`) by the turn's ``x-request-id``: when the engine answered, how many
  prompt tokens it did not compute, and the answer's ``kv_transfer_params``.
- `DeviceLedger`: what decode nodes pin between turns, from the decode legs'
  ``kv_transfer_params`` (``remote_num_tokens`` kept for ``decoder_kv_blocks_ttl``, freed when a
  prefill reads it or at the TTL).
- `complete_turn` sends one turn through the router (a running stack's router, whose legs are
  not seen, gets it streamed: ``kvtier.ab.live.running.stream_turn``); `turn_record` makes its
  `TurnRecord` from the router's reuse headers and the legs; `split_transfer` shares the run's measured
  transfer time over the turns that read KV.

Threading model: `LegTap` and `DeviceLedger` are called from the router's event loop and the
conversation threads at once; each guards its state with its own lock. The functions are pure
apart from the ledger they are handed.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from kvtier.ab.records import TurnRecord
from kvtier.ids import Outcome, ReusePath
from kvtier.wire.reuse_headers import ReuseReport, parse_reuse_headers


@dataclass
class Leg:
    """One upstream completion leg of a turn, as the router's transport saw it."""

    inst: str
    role: str                 # "prefill" | "decode" | "direct"
    t0: float
    t1: float                 # perf_counter when the engine's answer was read in full
    ok: bool                  # 200 with a JSON body
    kv_out: dict | None       # the answer's kv_transfer_params
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens the engine did not compute
    # (prefix cache or loaded KV), as vLLM counted them; None when it did not say
    cached_tokens: int | None = None


class LegTap(httpx.AsyncBaseTransport):
    """Router transport that forwards everything and records completion legs by request id.

    Only what the router's reuse headers cannot tell: when the prefill leg answered (TTFT), how
    many prompt tokens the engine actually did not compute (its ``cached_tokens``: the router's
    header says what it planned, a failed or partial load makes the engine compute more) and
    what the decode node kept (the decode answer's ``kv_transfer_params``, which the router
    strips from its own answer)."""

    def __init__(self, roles: Mapping[str, tuple[str, str]]) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.roles = roles  # url -> (instance name, role)
        self.legs: dict[str, list[Leg]] = {}
        self._lock = threading.Lock()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        rid = request.headers.get("x-request-id")
        if rid is None or request.method != "POST" or not request.url.path.endswith("completions"):
            return await self.inner.handle_async_request(request)
        body = json.loads(await request.aread() or b"{}")
        t0 = time.perf_counter()
        resp = await self.inner.handle_async_request(request)
        raw = await resp.aread()
        t1 = time.perf_counter()
        try:
            out = json.loads(raw) if resp.status_code == 200 else None
        except ValueError:
            out = None
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        name, _ = self.roles.get(base, (base, "?"))
        # The leg's role from what the router asked for, not the instance's configured role:
        # a direct fallback may land on a prefill instance.
        kvp: dict[str, Any] | None = body.get("kv_transfer_params")
        if kvp is None:
            role = "direct"
        else:
            role = "prefill" if kvp.get("do_remote_decode") else "decode"
        ok = isinstance(out, dict)
        kv_out = out.get("kv_transfer_params") if isinstance(out, dict) else None
        leg = Leg(name, role, t0, t1, ok, kv_out if isinstance(kv_out, dict) else None,
                  _cached_tokens(out))
        with self._lock:
            self.legs.setdefault(rid, []).append(leg)
        headers = [(k, v) for k, v in resp.headers.raw
                   if k.lower() not in (b"content-length", b"transfer-encoding")]
        return httpx.Response(resp.status_code, headers=headers, content=raw,
                              extensions=resp.extensions)

    def take(self, rid: str) -> list[Leg]:
        with self._lock:
            return self.legs.pop(rid, [])

    async def aclose(self) -> None:
        await self.inner.aclose()


class DeviceLedger:
    """What decode nodes pin between turns (see the module docstring)."""

    def __init__(self, block_size: int, ttl_s: float | None) -> None:
        self.bs, self.ttl = block_size, ttl_s
        # conversation -> [(blocks, freed_at)]: D pins each turn's KV until read or TTL
        self._held: dict[str, list[tuple[int, float]]] = {}
        self._lock = threading.Lock()

    def retained(self, conv: str, tokens: int, now: float) -> None:
        if self.ttl:
            with self._lock:
                self._held.setdefault(conv, []).append((math.ceil(tokens / self.bs),
                                                        now + self.ttl))

    def read(self, conv: str) -> None:
        """A prefill read the latest retained KV: D frees it."""
        with self._lock:
            held = self._held.get(conv)
            if held:
                held.pop()

    def blocks(self, now: float) -> int:
        with self._lock:
            return sum(b for h in self._held.values() for b, until in h if until > now)


def complete_turn(c: httpx.Client, model: str, cid: str, rid: str, prompt: list[int],
              max_tokens: int) -> tuple[list[int], ReuseReport]:
    """One turn through the router: token-list prompt, exact ids back (see router/client.py),
    and the router's reuse decision from the answer's headers. ``ignore_eos`` makes the turn
    generate exactly the trace's response length."""
    body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "return_token_ids": True, "conversation_id": cid}
    r = c.post("/v1/completions", json=body, headers={"x-request-id": rid})
    r.raise_for_status()
    ids = r.json()["choices"][0].get("token_ids")
    if not isinstance(ids, list):
        # the router's answer is malformed: a bad value, not a caller passing a wrong type
        raise ValueError("router answer has no token_ids")  # noqa: TRY004
    return ids, parse_reuse_headers(r.headers)


def turn_record(strategy: str, conv_id: str, i: int, t_start: float, t0: float, t1: float,
            legs: list[Leg], prompt: int, gen: list[int] | None, reuse: ReuseReport | None,
            err: str, ledger: DeviceLedger | None, cid: str, *,
            first_token: float | None = None) -> TurnRecord:
    """One turn's record: reuse from the router's headers (``reuse``; None when the turn
    failed), TTFT and what the decode node kept from the legs. Without a prefill leg (a
    running stack's router, whose legs are not seen) TTFT is ``first_token`` (the
    ``perf_counter`` at the first streamed token) minus ``t0``, else the whole turn; without
    a ``ledger`` nothing is counted as retained."""
    path, reused, outcome = ((reuse.path, reuse.tokens, reuse.outcome) if reuse is not None
                             else (ReusePath.NONE, 0, Outcome.NONE))
    pre = next((g for g in legs if g.role == "prefill" and g.ok), None)
    if pre is not None and pre.cached_tokens is not None:
        reused = pre.cached_tokens  # what the engine did, over what the router planned
    dec = next((g for g in reversed(legs) if g.role in ("decode", "direct") and g.ok), None)
    if pre is not None:
        ttft = pre.t1 - t0
    else:
        ttft = (first_token if first_token is not None else t1) - t0
    if ledger is not None and path is ReusePath.DP_READ:
        ledger.read(cid)
    if ledger is not None and dec is not None and dec.role == "decode":
        kvp = dec.kv_out or {}
        n = kvp.get("remote_num_tokens")
        if kvp.get("remote_block_ids") and isinstance(n, int):
            ledger.retained(cid, n, time.perf_counter())
    # The enum members themselves: they are str, equal to (and serialized as) their values.
    return TurnRecord(strategy, conv_id, i, prompt, reused, path, max(0, prompt - reused),
                      ttft, t1 - t0, 0.0, t_start, outcome,
                      len(gen) if gen is not None else 0, gen is not None, err)


def _cached_tokens(answer: object) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an engine answer, if it has one."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and n >= 0 else None


def split_transfer(records: list[TurnRecord], total_s: float) -> None:
    """Share ``total_s`` of measured NIXL transfer time over the turns that read KV, by the
    tokens each read (vLLM exports no per-request transfer time)."""
    if not (total_s > 0):
        return
    movers = [r for r in records if r.ok and ReusePath(r.reuse_path).is_read
              and r.reused_tokens > 0]
    tokens = sum(r.reused_tokens for r in movers)
    for r in movers:
        r.transfer_s = total_s * r.reused_tokens / tokens
