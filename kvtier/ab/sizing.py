"""Sizing from the simulator: how many concurrent sessions a fleet holds at a TTFT p90 SLO.

The question: for this trace, a P/D fleet (``FleetSpec``: prefill and decode instances, their
KV capacity, host memory per pod) and a TTFT p90 SLO, how many sessions can run at once under
each retention strategy? ``size_for_slo`` answers it by simulation
(`kvtier.ab.simulator.simulate`).

- **Load.** ``scale_trace(trace, n)`` is the trace at ``n`` concurrent sessions, one session per
  conversation: conversations ``0..C-1`` of the trace, then copy 1 of each (``c~1``), copy 2
  (``c~2``), ... (per-conversation granularity: ``n = k·C`` is exactly ``k`` copies). A copy
  keeps its original's turns and waits, starts ``j · stagger_s`` after it (copy ``j``; so
  arrivals are not simultaneous, and ``k`` copies ramp up over ``(k-1)·stagger_s``), and has its
  own seed (derived from the original's seed and ``j``), so copies share no token prefix unless
  their originals did. Deterministic.
- **Metric.** TTFT is the first token the client sees: the prefill leg's answer plus any wait
  for decode KV room (``ttft_s + decode_wait_s``; the report's TTFT column is the prefill leg
  alone, as the live runner measures it). Its p90 is nearest-rank over every turn (the report's rule,
  `kvtier.ab.stats.nearest_rank`); the interval at the answer is a seeded bootstrap over those
  turns (turns of one conversation are not independent: if anything too narrow).
- **Search.** Sessions 1, 2, 4, ... (doubling, up to ``max_sessions``) until the p90 exceeds the
  SLO, then bisection between the last size that met it and the first that did not. The
  answer ``n`` always has ``p90(n) ≤ SLO < p90(n+1)`` (both reported) unless it is the cap.
  It is the *largest* such ``n`` only if the p90 grows with load; the simulator is
  deterministic but not necessarily monotone (more sessions shift every arrival and
  eviction), so a larger size may meet the SLO again. ``p90_monotone`` says whether the sizes
  simulated were in order. No size meeting it (``p90(1) > SLO``) gives 0, with ``p90(1)``.

What this inherits from the simulator: prefill contention (processor sharing), retention,
eviction and the reuse paths are modelled, and a decode admits a turn only when its blocks fit
(turns wait, first in first out, and the wait is part of their TTFT; retained KV stays pinned,
as in vLLM); preemption, vLLM's token budgets and chunking, link
contention and decode interference are not modelled (`kvtier.ab.simulator`).

Threading model: pure functions of their arguments, single-threaded (``progress`` is called
on the caller's thread after each simulation); the same inputs give the same answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise

import msgspec
import xxhash

from kvtier.ab.records import RunResult
from kvtier.ab.simulator import FleetSpec, simulate
from kvtier.ab.stats import nearest_rank, quantile_ci
from kvtier.ab.strategies import StrategySpec, builtin
from kvtier.ab.traces import ConversationSpec, Trace, validate
from kvtier.cost.model import CostModel
from kvtier.ids import ConversationId

DEFAULT_MAX_SESSIONS = 512
DEFAULT_STAGGER_S = 0.1  # copy j of a conversation starts j x this after it


def copy_seed(seed: int, copy: int) -> int:
    """Seed of copy ``copy`` of a conversation seeded ``seed`` (copy 0 keeps it)."""
    if copy == 0:
        return seed
    return xxhash.xxh64_intdigest(f"{seed}~{copy}".encode()) & 0x7FFFFFFF


def scale_trace(trace: Trace, sessions: int, stagger_s: float = DEFAULT_STAGGER_S) -> Trace:
    """``trace`` at ``sessions`` concurrent sessions: its conversations in order, then copy 1
    of each (id ``ID~1``), copy 2, ... (see the module docstring)."""
    c = len(trace.conversations)
    if sessions < 1 or c == 0:
        raise ValueError(f"need sessions >= 1 and a non-empty trace (sessions={sessions}, "
                         f"{c} conversations)")
    convs: list[ConversationSpec] = []
    for i in range(sessions):
        orig, j = trace.conversations[i % c], i // c
        convs.append(orig if j == 0 else ConversationSpec(
            ConversationId(f"{orig.conversation_id}~{j}"), round(orig.start_s + j * stagger_s, 6),
            copy_seed(orig.seed, j), list(orig.turns)))
    out = Trace(f"{trace.name} x{sessions} sessions", trace.vocab_size, convs)
    validate(out)
    return out


class Point(msgspec.Struct, frozen=True):
    """One simulation: the trace at ``sessions`` sessions under one strategy."""

    sessions: int
    ttft_p90_s: float
    device_block_s: float
    host_gb_s: float
    decode_queued: int  # turns that waited for decode KV blocks (admission queue)
    decode_wait_s: float  # their waits, summed
    turns: int


class StrategySizing(msgspec.Struct, frozen=True):
    """The answer for one strategy. ``sessions`` 0: not even one session meets the SLO."""

    strategy: str
    sessions: int  # concurrent sessions held at the SLO
    capped: bool  # the SLO still held at max_sessions: the answer is at least that
    at: Point | None  # the simulation at ``sessions`` (None when 0)
    ttft_p90_ci: tuple[float, float] | None  # bootstrap 95% interval of the p90 there
    next: Point | None  # at sessions + 1 (None when capped)
    host_bytes_per_pod: int
    p90_monotone: bool  # the p90 of the sizes simulated never fell as sessions grew
    simulated: list[Point]  # every size simulated, in order of size


class SizingAnswer(msgspec.Struct, frozen=True):
    trace: str
    conversations: int  # in the trace; sessions beyond these are copies
    slo_ttft_p90_s: float
    max_sessions: int
    stagger_s: float
    fleet: dict
    strategies: list[StrategySizing]

    def best(self) -> list[StrategySizing]:
        """The strategies that hold the most sessions (ties all)."""
        top = max((s.sessions for s in self.strategies), default=0)
        return [s for s in self.strategies if s.sessions == top]

    def markdown(self) -> str:
        """The table (one row per strategy) and one sentence naming the strategy that holds
        the most."""
        lines = [("| strategy | sessions held at SLO | TTFT p90 there | at next size | "
                  "device block·s | host GB·s |"), "|---|---|---|---|---|---|"]
        for s in self.strategies:
            held = f"≥ {s.sessions} (cap)" if s.capped else str(s.sessions)
            there = "–" if s.at is None else _secs(s.at.ttft_p90_s)
            if s.ttft_p90_ci is not None and s.at is not None:
                there += f" [{s.ttft_p90_ci[0]:.2f}, {s.ttft_p90_ci[1]:.2f}]"
            nxt = "–" if s.next is None else f"{_secs(s.next.ttft_p90_s)} ({s.next.sessions})"
            dev = "–" if s.at is None else f"{s.at.device_block_s:,.0f}"
            host = "–" if s.at is None else f"{s.at.host_gb_s:,.2f}"
            lines.append(f"| `{s.strategy}` | {held} | {there} | {nxt} | {dev} | {host} |")
        return "\n".join(lines) + "\n\n" + self.sentence()

    def sentence(self) -> str:
        slo = f"TTFT p90 ≤ {self.slo_ttft_p90_s:g} s"
        best = self.best()
        if not best or best[0].sessions == 0:
            return f"No strategy meets {slo} even at 1 session."
        names = " and ".join(f"`{s.strategy}`" for s in best)
        n = best[0].sessions
        held = f"at least {n} (the search cap)" if best[0].capped else str(n)
        verb = "hold" if len(best) > 1 else "holds"
        top = {s.strategy for s in best}
        others = ", ".join(f"`{s.strategy}` {s.sessions}" for s in self.strategies
                           if s.strategy not in top)
        return (f"{names} {verb} the most: {held} concurrent sessions at {slo}"
                + (f" ({others})." if others else "."))

    def report(self) -> str:
        """``sizing.md``: the question, the fleet, the table and what it leaves out."""
        f = self.fleet
        hosts = sorted({s.host_bytes_per_pod for s in self.strategies})
        queued = [f"`{s.strategy}` {s.at.decode_queued} ({s.at.decode_wait_s:,.1f} s)"
                  for s in self.strategies if s.at is not None and s.at.decode_queued]
        non_mono = [f"`{s.strategy}`" for s in self.strategies if not s.p90_monotone]
        loose = [f"`{s.strategy}`" for s in self.strategies
                 if s.ttft_p90_ci is not None and s.ttft_p90_ci[1] > self.slo_ttft_p90_s]
        lines = [
            "# Sizing at the TTFT SLO (simulated)", "",
            (f"How many concurrent sessions of trace `{self.trace}` ({self.conversations} "
             f"conversations; more sessions are copies, each starting {self.stagger_s:g} s after "
             f"the one before) a fleet of {f['prefill']} prefill and {f['decode']} decode "
             f"instance{'s' if f['decode'] > 1 else ''} ({f['device_blocks_per_decode']:,} KV "
             f"blocks of {f['block_size']} tokens per decode, host tier "
             f"{' / '.join(f'{h / 2**20:,.0f} MiB' for h in hosts)} per pod) holds at TTFT p90 ≤ "
             f"{self.slo_ttft_p90_s:g} s, by strategy. Search: doubling up to "
             f"{self.max_sessions} sessions, then bisection; below the cap, the p90 at the answer "
             "is ≤ the SLO and the p90 at one session more is above it. TTFT here is the first token "
             "the client sees (the prefill leg plus any wait for decode KV room); its p90 is "
             "nearest-rank over every turn, with a 95% bootstrap interval over the turns at the "
             "answer."), "",
            self.markdown(), "",
            ("A decode admits a turn only when its KV blocks fit; retained KV stays pinned "
             "until read, released or expired (vLLM's behaviour), and a waiting turn's wait "
             "delays the first token its client sees. Not modelled: preemption, vLLM's token budgets and chunking, "
             "link contention, decode interference (`kvtier/ab/simulator.py`).")]
        if queued:
            lines += ["", "Turns that waited for decode KV blocks at the answer (turns, total "
                      "wait): " + ", ".join(queued) + ": there decode memory, not prefill, "
                      "is part of what limits the fleet."]
        if loose:
            lines += ["", "The p90's interval at the answer reaches above the SLO for "
                      + ", ".join(loose) + ": this trace's turns do not settle it there."]
        if non_mono:
            lines += ["", "TTFT p90 fell as sessions grew somewhere in the search for "
                      + ", ".join(non_mono) + ": a size above the answer may meet the SLO "
                      "again (see `sizing.json`, `simulated`)."]
        return "\n".join(lines) + "\n"


def _secs(s: float) -> str:
    return f"{s:.2f} s"


def _point(n: int, r: RunResult) -> tuple[Point, list[float]]:
    # the first token the client sees: the prefill leg plus any wait for decode KV room
    ttft = [t.ttft_s + t.decode_wait_s for t in r.ok_turns]
    return Point(n, nearest_rank(ttft, 0.9), r.device_block_seconds(), r.host_gb_seconds(),
                 int(r.meta.get("decode_queued", 0)), float(r.meta.get("decode_wait_s", 0.0)),
                 len(ttft)), ttft


def size_strategy(trace: Trace, strategy: StrategySpec, fleet: FleetSpec, cost: CostModel,
                  slo_ttft_p90_s: float, max_sessions: int = DEFAULT_MAX_SESSIONS,
                  stagger_s: float = DEFAULT_STAGGER_S, online_ttl: bool = True,
                  progress: Callable[[str, int, float], None] | None = None) -> StrategySizing:
    """The sessions ``strategy`` holds at the SLO (search: the module docstring)."""
    if slo_ttft_p90_s <= 0 or max_sessions < 1:
        raise ValueError(f"need slo > 0 and max_sessions >= 1 ({slo_ttft_p90_s}, {max_sessions})")
    seen: dict[int, tuple[Point, list[float]]] = {}

    def run(n: int) -> Point:
        if n not in seen:
            r = simulate(scale_trace(trace, n, stagger_s), strategy, fleet, cost, online_ttl)
            seen[n] = _point(n, r)
            if progress is not None:
                progress(strategy.name, n, seen[n][0].ttft_p90_s)
        return seen[n][0]

    def meets(n: int) -> bool:
        p = run(n).ttft_p90_s
        return math.isfinite(p) and p <= slo_ttft_p90_s

    lo, hi = 0, None  # lo: largest size known to meet the SLO; hi: a larger size that does not
    n = 1
    while True:
        if meets(n):
            lo = n
            if n >= max_sessions:
                break
            n = min(2 * n, max_sessions)
        else:
            hi = n
            break
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid):
                lo = mid
            else:
                hi = mid
    capped = hi is None
    at = seen[lo][0] if lo else None
    ci = None
    if lo:
        iv = quantile_ci(seen[lo][1], 0.9)
        ci = (iv.lo, iv.hi) if iv.defined else None
    nxt = None if capped else run(lo + 1)
    points = [seen[k][0] for k in sorted(seen)]
    monotone = all(a.ttft_p90_s <= b.ttft_p90_s for a, b in pairwise(points))
    host = strategy.host_bytes if strategy.host_bytes is not None else fleet.host_bytes_per_pod
    return StrategySizing(strategy.name, lo, capped, at, ci, nxt, host, monotone, points)


def size_for_slo(trace: Trace, strategies: Sequence[StrategySpec | str], fleet: FleetSpec,
                 cost: CostModel, slo_ttft_p90_s: float, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 stagger_s: float = DEFAULT_STAGGER_S, online_ttl: bool = True,
                 progress: Callable[[str, int, float], None] | None = None) -> SizingAnswer:
    """For each strategy, the concurrent sessions of ``trace`` that ``fleet`` holds with a
    simulated TTFT p90 ≤ ``slo_ttft_p90_s`` (per-conversation granularity; see the module
    docstring for the search and what it assumes). ``progress(strategy, sessions, p90_s)``
    is called after each simulation."""
    specs = [builtin(s) if isinstance(s, str) else s for s in strategies]
    rows = [size_strategy(trace, s, fleet, cost, slo_ttft_p90_s, max_sessions, stagger_s,
                          online_ttl, progress) for s in specs]
    return SizingAnswer(trace.name, len(trace.conversations), slo_ttft_p90_s, max_sessions,
                        stagger_s, fleet.model_dump(), rows)
