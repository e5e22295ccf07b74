"""What one A/B run records, and the metrics derived from it.

The live runner (``kvtier.ab.live.runner``) and the simulator
(``kvtier.ab.simulator``) both emit these records, so the report and the
simulator's error are computed by one piece of code.

Per turn (``TurnRecord``): prompt/reused/computed tokens, the reuse path the
router chose (``dp_read``: D->P read of the previous turn's KV on the decode
node; ``p2p``: peer host tier; ``local``: the prefill's own cache; ``none``),
TTFT, end-to-end latency and the KV transfer time.

Over time (``MemorySample``): device blocks retained for conversations between
turns and host-tier bytes held. Integrals are sample-and-hold (left Riemann
sums): a value holds from its sample until the next one, and the last sample
holds until ``meta["t_end"]`` when that is known. When the decode nodes count
their own block-seconds (``meta["device_block_s_counted"]``, from
``kvtier_decode_block_seconds_held_total``) that count is used instead, and
``meta["device_blocks_source"]`` says which one a run has.

Per run, from the engines' own metrics (``meta["engine"]``, per role, deltas over
the run; ``engine_summary`` reads them): queue time and inter-token latency
histograms, preemptions, peak running and waiting requests.

Threading model: plain values; derived metrics are pure functions.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from kvtier.ab.stats import histogram_quantile_resolved
from kvtier.ids import Outcome, ReusePath

REUSE_PATHS: tuple[ReusePath, ...] = tuple(ReusePath)  # report column order

# Context-length buckets (prompt tokens, upper bounds) for TTFT medians.
DEFAULT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class TurnRecord(msgspec.Struct):
    strategy: str
    conversation_id: str
    turn: int
    prompt_tokens: int
    reused_tokens: int           # tokens whose KV came from elsewhere or the local cache
    reuse_path: ReusePath
    computed_tokens: int         # prompt tokens the prefill computed
    ttft_s: float
    e2e_s: float
    transfer_s: float = 0.0      # KV read time inside the prefill (0 for none/local)
    t_start: float = 0.0         # seconds since the run started
    outcome: Outcome = Outcome.NONE  # what became of the retained device KV (router's word)
    response_tokens: int = 0
    ok: bool = True
    error: str = ""
    # why the router did not read retained device KV for this turn (its ``served`` log's
    # ``refusal``: stale, expired, unproven, below_threshold); "" when it read or had none
    refusal: str = ""
    # With decode leases, what the router chose for this turn's retained device KV (its
    # ``served`` log line): hold it ``hold_s`` seconds (0: released at once; None: not
    # retained under a lease), on which ``hold_basis`` (renew, conversation, fleet, default),
    # from ``hold_samples`` observed waits; ``hold_why`` the adaptive policy's explanation.
    hold_s: float | None = None
    hold_basis: str = ""
    hold_samples: int = 0
    hold_why: str = ""
    # Seconds the turn waited, after its prefill, for KV blocks on its decode instance before
    # it started decoding; part of ``ttft_s``. Set by the simulator (0 in live runs, whose
    # decode queue time is in the engines' metrics, ``meta["engine"]``).
    decode_wait_s: float = 0.0


class MemorySample(msgspec.Struct):
    strategy: str
    t: float                      # seconds since the run started
    device_blocks_retained: int
    host_bytes_held: int


class RunResult(msgspec.Struct):
    strategy: str
    turns: list[TurnRecord] = msgspec.field(default_factory=list)
    memory: list[MemorySample] = msgspec.field(default_factory=list)
    meta: dict = msgspec.field(default_factory=dict)

    # -- derived -------------------------------------------------------------------------
    @property
    def ok_turns(self) -> list[TurnRecord]:
        return [t for t in self.turns if t.ok]

    @property
    def follow_ups(self) -> list[TurnRecord]:
        """Turns after a conversation's first: the ones reuse can help."""
        return [t for t in self.ok_turns if t.turn > 0]

    def device_block_seconds(self) -> float:
        """Device blocks retained, integrated over the run (per run: the mean over repeats);
        the decode nodes' own count when every run has one."""
        counted = self.meta.get("device_block_s_counted")
        if isinstance(counted, list) and counted:
            return statistics.fmean(float(c) for c in counted)
        if isinstance(counted, (int, float)):
            return float(counted)
        return self._per_run_integral(lambda s: float(s.device_blocks_retained))

    def device_blocks_peak(self) -> int:
        return max((s.device_blocks_retained for s in self.memory), default=0)

    def duration_s(self) -> float:
        """Wall seconds the run took (summed over repeats)."""
        windows = self.meta.get("repeat_windows")
        if windows:
            return float(sum(b - a for a, b in windows))
        return float(self.meta.get("t_end") or _span(self))

    def turns_per_min(self) -> float:
        d = self.duration_s()
        return 60.0 * len(self.ok_turns) / d if d > 0 else float("nan")

    def refusals(self) -> dict[str, int]:
        """Follow-up turns by the router's reason for not reading retained device KV."""
        out: dict[str, int] = {}
        for t in self.turns:
            if t.refusal:
                out[t.refusal] = out.get(t.refusal, 0) + 1
        return out

    def hold_choices(self) -> dict[str, dict]:
        """Per conversation, the device holds the router chose (decode leases): turns held
        (hold > 0) and released at once (hold 0), the hold seconds chosen, the bases, and
        the follow-up turns that read the device copy. Conversations with no choice logged
        are left out."""
        out: dict[str, dict] = {}
        by_conv: dict[str, list[TurnRecord]] = {}
        for t in self.turns:
            by_conv.setdefault(t.conversation_id, []).append(t)
        for conv, ts in by_conv.items():
            ts.sort(key=lambda t: t.turn)
            chosen = [t for t in ts if t.hold_s is not None]
            if not chosen:
                continue
            holds = [float(t.hold_s) for t in chosen]  # type: ignore[arg-type]
            bases: dict[str, int] = {}
            for t in chosen:
                bases[t.hold_basis or "?"] = bases.get(t.hold_basis or "?", 0) + 1
            out[conv] = {
                "turns": len(ts), "held": sum(1 for h in holds if h > 0),
                "released": sum(1 for h in holds if h <= 0),
                "hold_s": holds, "bases": bases,
                "sequence": [(t.turn, float(t.hold_s), t.hold_basis)  # type: ignore[arg-type]
                             for t in chosen],
                "dp_reads": sum(1 for t in ts if t.ok and t.reuse_path == ReusePath.DP_READ),
            }
        return out

    def ttft_by_turn(self) -> dict[tuple[str, int], float]:
        """TTFT keyed by (conversation, turn): the key that pairs a turn with the same turn
        of another strategy (merged repeats keep their ``~k`` suffix, so pairs share a
        repeat)."""
        return {(t.conversation_id, t.turn): t.ttft_s for t in self.ok_turns}

    def host_gb_seconds(self) -> float:
        return self._per_run_integral(lambda s: s.host_bytes_held / 1e9)

    def _per_run_integral(self, value: Callable[[MemorySample], float]) -> float:
        windows = self.meta.get("repeat_windows")
        if not windows:
            return _integrate([(s.t, value(s)) for s in self.memory], self.meta.get("t_end"))
        return statistics.fmean(
            _integrate([(s.t, value(s)) for s in self.memory if a <= s.t < b], b)
            for a, b in windows)

    def reuse_rate(self) -> float:
        """Share of follow-up turns' prompt tokens that were not recomputed."""
        fu = self.follow_ups
        total = sum(t.prompt_tokens for t in fu)
        return sum(t.reused_tokens for t in fu) / total if total else 0.0

    def hit_rate(self) -> float:
        """Share of follow-up turns that reused anything."""
        fu = self.follow_ups
        return sum(1 for t in fu if t.reuse_path != ReusePath.NONE) / len(fu) if fu else 0.0

    def expiry_rate(self) -> float:
        """Share of follow-up turns whose retained KV had expired when they came."""
        fu = self.follow_ups
        return sum(1 for t in fu if t.outcome == Outcome.EXPIRED) / len(fu) if fu else 0.0

    def reuse_by_path(self) -> dict[str, int]:
        """Reused tokens per path (all turns)."""
        out: dict[str, int] = {p.value: 0 for p in REUSE_PATHS}
        for t in self.ok_turns:
            out[str(t.reuse_path)] = out.get(str(t.reuse_path), 0) + t.reused_tokens
        return out

    def turns_by_path(self) -> dict[str, int]:
        out: dict[str, int] = {p.value: 0 for p in REUSE_PATHS}
        for t in self.ok_turns:
            out[str(t.reuse_path)] = out.get(str(t.reuse_path), 0) + 1
        return out

    def ttft_by_bucket(self, buckets: Sequence[int] = DEFAULT_BUCKETS) -> dict[int, float]:
        """Median TTFT per context bucket (prompt tokens <= bound), non-empty buckets only."""
        groups: dict[int, list[float]] = {}
        for t in self.ok_turns:
            groups.setdefault(bucket_of(t.prompt_tokens, buckets), []).append(t.ttft_s)
        return {b: statistics.median(v) for b, v in sorted(groups.items())}

    def ttft_at_longest(self, top_fraction: float = 0.1) -> float:
        """Median TTFT over the longest-context turns (top ``top_fraction``, at least one)."""
        ts = sorted(self.ok_turns, key=lambda t: t.prompt_tokens)
        if not ts:
            return float("nan")
        n = max(1, round(len(ts) * top_fraction))
        return statistics.median(t.ttft_s for t in ts[-n:])

    def summary(self) -> dict:
        ok = self.ok_turns
        ttft = [t.ttft_s for t in ok]
        e2e = [t.e2e_s for t in ok]
        return {
            "strategy": self.strategy,
            "turns": len(self.turns),
            "errors": len(self.turns) - len(ok),
            "ttft_p50_s": _q(ttft, 0.5),
            "ttft_p90_s": _q(ttft, 0.9),
            "ttft_p99_s": _q(ttft, 0.99),
            "turns_per_min": self.turns_per_min(),
            "ttft_longest_s": self.ttft_at_longest(),
            "e2e_p50_s": _q(e2e, 0.5),
            "prompt_tokens": sum(t.prompt_tokens for t in ok),
            "computed_tokens": sum(t.computed_tokens for t in ok),
            "reused_tokens": sum(t.reused_tokens for t in ok),
            "transfer_s": sum(t.transfer_s for t in ok),
            "reuse_rate": self.reuse_rate(),
            "hit_rate": self.hit_rate(),
            "expiry_rate": self.expiry_rate(),
            "device_block_s": self.device_block_seconds(),
            "device_blocks_peak": self.device_blocks_peak(),
            "device_blocks_source": self.meta.get("device_blocks_source", "ledger"),
            "host_gb_s": self.host_gb_seconds(),
            "reuse_by_path": self.reuse_by_path(),
            "turns_by_path": self.turns_by_path(),
            "refusals": self.refusals(),
            **self._hold_summary(),
            **engine_summary(self.meta.get("engine")),
        }

    def _hold_summary(self) -> dict:
        """Turns the router held / released at once under decode leases (only when any)."""
        holds = [t.hold_s for t in self.turns if t.hold_s is not None]
        if not holds:
            return {}
        return {"turns_held": sum(1 for h in holds if h > 0),
                "turns_released": sum(1 for h in holds if h <= 0)}


REPEAT_GAP_S = 1.0  # between repeats on the merged time axis, so no two share an instant


def repeat_meta(r: RunResult, key: str) -> list[Any]:
    """``r.meta[key]`` of each repeat: ``merge_repeats`` keeps a list of them, a single run
    has its one value ([] when the run has none)."""
    v = r.meta.get(key)
    if v is None:
        return []
    return v if isinstance(v, list) else [v]


def merge_repeats(runs: Sequence[RunResult]) -> RunResult:
    """Several runs of one strategy on one trace as one result: turns pooled (medians over all
    of them), memory integrals averaged per run. Repeat k > 0 renames its conversations
    ``ID~k`` and every repeat is shifted to its own window of the time axis
    (``meta["repeat_windows"]``), so per-run bookkeeping (waits, overlaps, integrals) never
    mixes two repeats. ``meta["per_repeat"]`` keeps each repeat's own summary numbers."""
    if not runs:
        raise ValueError("no runs to merge")
    if len({r.strategy for r in runs}) != 1:
        raise ValueError(f"runs of different strategies: {sorted({r.strategy for r in runs})}")
    if len(runs) == 1:
        return runs[0]
    turns: list[TurnRecord] = []
    memory: list[MemorySample] = []
    windows: list[tuple[float, float]] = []
    offset = 0.0
    for k, r in enumerate(runs):
        sfx = f"~{k}" if k else ""
        turns += [msgspec.structs.replace(t, conversation_id=t.conversation_id + sfx,
                                          t_start=t.t_start + offset) for t in r.turns]
        memory += [msgspec.structs.replace(m, t=m.t + offset) for m in r.memory]
        # the run's own end (its integrals stop there), inside everything it recorded
        span = _span(r)
        end = r.meta.get("t_end") or span
        windows.append((offset, offset + end))
        offset += max(end, span) + REPEAT_GAP_S
    keys = ("ttft_p50_s", "ttft_p90_s", "ttft_longest_s", "turns_per_min", "reuse_rate",
            "device_block_s", "host_gb_s")
    per = [{k: summ[k] for k in keys} for summ in (r.summary() for r in runs)]
    meta = {**runs[0].meta, "repeats": len(runs), "repeat_windows": windows,
            "t_end": windows[-1][1], "per_repeat": per,
            "engine": merge_engine([r.meta.get("engine") for r in runs])}
    for key in ("router_cost", "router_stalls", "path_switches", "services", "cpu",
                "peer_fetch"):
        if any(key in r.meta for r in runs):
            meta[key] = [r.meta.get(key) for r in runs]  # each repeat's router (and indexer)
    counted = [r.meta.get("device_block_s_counted") for r in runs]
    if all(isinstance(c, (int, float)) for c in counted):
        meta["device_block_s_counted"] = counted
    else:
        meta.pop("device_block_s_counted", None)
        if any(c is not None for c in counted):
            meta["device_blocks_source"] = "ledger (decode metrics missing in some repeats)"
    return RunResult(runs[0].strategy, turns, memory, meta)


# ---------------------------------------------------------------- engine metrics -------
# meta["engine"][role] = {"queue": H, "itl": H, "preemptions": n, "peak_running": n,
# "peak_waiting": n}; H = {"buckets": [[le, count], ...], "sum": s, "count": n}: cumulative
# Prometheus buckets (``le`` a string, "+Inf" included), deltas over the run, summed over the
# role's instances.
ENGINE_HISTOGRAMS = ("queue", "itl")


def _add_hist(a: dict | None, b: dict | None) -> dict | None:
    if not a:
        return b
    if not b:
        return a
    counts: dict[str, float] = {}
    for le, c in [*a.get("buckets", []), *b.get("buckets", [])]:
        counts[str(le)] = counts.get(str(le), 0.0) + float(c)
    return {"buckets": sorted(([le, c] for le, c in counts.items()), key=lambda x: float(x[0])),
            "sum": float(a.get("sum", 0.0)) + float(b.get("sum", 0.0)),
            "count": float(a.get("count", 0.0)) + float(b.get("count", 0.0))}


def merge_engine(parts: Sequence[dict | None]) -> dict:
    """Several runs' (or instances') ``meta["engine"]`` as one: histograms and preemptions
    add, peaks take the maximum."""
    out: dict[str, dict] = {}
    for part in parts:
        for role, m in (part or {}).items():
            o = out.setdefault(role, {})
            for h in ENGINE_HISTOGRAMS:
                merged = _add_hist(o.get(h), m.get(h))
                if merged is not None:
                    o[h] = merged
            o["preemptions"] = o.get("preemptions", 0.0) + float(m.get("preemptions", 0.0))
            for k in ("peak_running", "peak_waiting"):
                o[k] = max(float(o.get(k, 0.0)), float(m.get(k, 0.0)))
    return out


def engine_summary(engine: dict | None) -> dict:
    """The engine numbers of the summary (NaN where the run did not record them)."""
    nan = float("nan")

    def mean(h: dict | None) -> float:
        # A negative total is not a time: vLLM 0.32 observes a request that failed its KV load
        # (failure_policy=fail) with a queue time of 0 minus its arrival on the monotonic
        # clock (about -uptime: a live host-scarce run, 2026-12-06, summed -101,678 s over 2).
        if not h or not h.get("count") or h["sum"] < 0:
            return nan
        return h["sum"] / h["count"]

    def p90(h: dict | None) -> float:
        if not h:
            return nan
        return histogram_quantile_resolved([(float(le), float(c)) for le, c in h["buckets"]],
                                           0.9)

    e = engine or {}
    pre, dec = e.get("prefill", {}), e.get("decode", {})
    return {
        "prefill_queue_mean_s": mean(pre.get("queue")),
        "prefill_queue_p90_s": p90(pre.get("queue")),
        "decode_queue_mean_s": mean(dec.get("queue")),
        "decode_queue_p90_s": p90(dec.get("queue")),
        "decode_itl_mean_s": mean(dec.get("itl")),
        "decode_itl_p90_s": p90(dec.get("itl")),
        "preemptions": sum(float(m.get("preemptions", 0.0)) for m in e.values()) if e else nan,
        "decode_peak_running": float(dec.get("peak_running", nan)),
        "decode_peak_waiting": float(dec.get("peak_waiting", nan)),
    }


def _span(r: RunResult) -> float:
    ends = [t.t_start + t.e2e_s for t in r.turns if math.isfinite(t.e2e_s)]
    ends += [m.t for m in r.memory]
    return max(ends, default=0.0)


def bucket_of(tokens: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    for b in buckets:
        if tokens <= b:
            return b
    return buckets[-1] if tokens <= buckets[-1] else tokens


def _q(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    # nearest-rank on a sorted list: deterministic and exact for small runs
    i = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[i]


def _integrate(points: Iterable[tuple[float, float]], t_end: float | None) -> float:
    pts = sorted(points)
    if not pts:
        return 0.0
    total = 0.0
    for (t0, v0), (t1, _) in zip(pts, pts[1:]):
        total += v0 * (t1 - t0)
    if t_end is not None and t_end > pts[-1][0]:
        total += pts[-1][1] * (t_end - pts[-1][0])
    return total


def encode(results: Sequence[RunResult]) -> bytes:
    return msgspec.json.encode(list(results))


def decode(data: bytes) -> list[RunResult]:
    return msgspec.json.decode(data, type=list[RunResult])
