"""How the live runner measures one turn (`kvtier.ab.live.runner`): the router's legs as its
log tells them, the ledger of what decode nodes pin, and the turn's record.

- `logged_legs`: a turn's upstream completion legs (`Leg`) from the router process's
  ``served`` line (``kvtier.ab.live.probes.RouterLog``): when the prefill leg answered (the
  router's ``prefill_ms`` and ``ms``, placed on this process's clock by the answer's arrival),
  how many prompt tokens the prefill engine did not compute (its ``cached_tokens``) and how
  many tokens the decode node said it kept (its answer's ``remote_num_tokens``).
- `DeviceLedger`: what decode nodes pin between turns, from what the decode legs kept
  (``remote_num_tokens`` kept for ``decoder_kv_blocks_ttl``, freed when a prefill reads it or
  at the TTL).
- `complete_turn` sends one turn through the router, whole (a running stack's router, whose
  log is its own, gets it streamed: ``kvtier.ab.live.running.stream_turn``); `turn_record`
  makes its `TurnRecord` from the router's reuse headers and the legs; `split_transfer`
  shares the run's measured transfer time over the turns that read KV.

Threading model: `DeviceLedger` is called from the conversation threads and the sampler at
once; it guards its state with its own lock. The functions are pure apart from the ledger
they are handed.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import httpx

from kvtier.ab.live.probes import ServedTurn
from kvtier.ab.records import TurnRecord
from kvtier.ids import Outcome, ReusePath
from kvtier.wire.reuse_headers import ReuseReport, parse_reuse_headers


@dataclass
class Leg:
    """One upstream completion leg of a turn, as the router's ``served`` line tells it."""

    inst: str
    role: str                 # "prefill" | "decode" | "direct"
    t0: float
    t1: float                 # perf_counter here at which the engine's answer was in
    ok: bool
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens the engine did not compute
    # (prefix cache or loaded KV), as vLLM counted them; None when it did not say
    cached_tokens: int | None = None
    # what a decode node said it keeps for the next turn (its answer's remote_num_tokens,
    # with remote blocks); None: nothing
    retained_tokens: int | None = None


def logged_legs(st: ServedTurn, t0: float, t1: float) -> list[Leg]:
    """A turn's legs from the router's ``served`` line (``st``), on this process's clock:
    the client sent at ``t0`` and had the answer at ``t1``. The prefill leg answered the
    router's tail before the answer (``ms - prefill_ms``: the decode leg and the router's own
    work after it), so the router's clock never has to agree with this one. No prefill leg in
    the line (a turn served on one instance, or a line not found): none here."""
    legs = []
    if st.prefill and st.prefill_ms is not None and st.ms is not None:
        tail_s = max(0.0, st.ms - st.prefill_ms) / 1e3
        legs.append(Leg(st.prefill, "prefill", t0, max(t0, t1 - tail_s), True,
                        st.cached_tokens))
    if st.decode:
        legs.append(Leg(st.decode, "decode" if st.prefill else "direct", t0, t1, True,
                        retained_tokens=st.retained_tokens))
    return legs


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
    running stack's router, whose log is its own) TTFT is ``first_token`` (the
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
    if ledger is not None and dec is not None and dec.role == "decode" \
            and dec.retained_tokens is not None:
        ledger.retained(cid, dec.retained_tokens, time.perf_counter())
    # The enum members themselves: they are str, equal to (and serialized as) their values.
    return TurnRecord(strategy, conv_id, i, prompt, reused, path, max(0, prompt - reused),
                      ttft, t1 - t0, 0.0, t_start, outcome,
                      len(gen) if gen is not None else 0, gen is not None, err)


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
