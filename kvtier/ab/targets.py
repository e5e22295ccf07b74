"""The A/B harness's targets, evaluated from one run's records through intervals.

All about ``tiered-adaptive`` (what the harness exists to show). Each target is decided only
from a 95% bootstrap interval (``kvtier.ab.stats``; per-turn values resampled by whole
conversation): *met* when the interval is on the goal's side of the bound, *missed* when it is
wholly on the other side, *not resolved* when it straddles the bound (or has too few values),
*not evaluated* when a strategy it needs is missing. No slack is added to any bound: the bounds
below are the targets as stated, nothing more.

1. **speedup at the longest context** ≥ 5×: per-turn ratios recompute / tiered-adaptive over
   tiered-adaptive's longest-context tenth of turns (paired with the same turns of recompute);
   met when the interval's lower bound is ≥ 5;
2. **within 5% of the best single strategy** (median TTFT, issue 30): per-turn ratios
   tiered-adaptive / best (the single strategy with the lowest median TTFT); met when the
   interval's upper bound is ≤ 1.05 *and* the point is ≤ 1.0, missed when the whole interval
   is above 1.0 (slower than the best), else not resolved;
3. **TTFT p90 not worse than the best single strategy's**: ratio of the p90s, each resampled
   on its own; met when the upper bound is ≤ 1.0, missed when the lower bound is > 1.0;
4. **turns per minute not lower** than the best single strategy's: per-repeat ratios; missed
   when the interval is wholly below 1.0, else met (needs ``--repeats`` ≥ 3);
5. **device memory vs device-ttl** (issue 30): mean device block·s ≤ device-ttl's, per-repeat
   ratios; met when the upper bound is ≤ 1.0, missed when the lower bound is > 1.0;
6. **device memory ≤ 50% of device-ttl's** (issue 18): block·s ratio's upper bound ≤ 0.5, at
   a reuse rate not lower than device-ttl's (per-repeat ratio not wholly below 1.0; any reuse
   matches a device-ttl that reused nothing).
7. **beats every fixed strategy** (issue 30's third "Done when"): against *each* fixed strategy
   of the run, either every per-turn median TTFT ratio has its upper bound < 1.0, or every
   per-repeat turns/min ratio has its lower bound > 1.0; missed when, on both metrics, some
   fixed strategy is better with the whole interval on its side, else not resolved. The
   value names the fixed strategy closest to tiered-adaptive on each metric.

Threading model: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvtier.ab.compare import paired_ttft, per_repeat, per_repeat_ratio
from kvtier.ab.records import RunResult
from kvtier.ab.stats import (
    Interval,
    at_least,
    at_most,
    paired_ratios,
    quantile_ratio_ci,
    ratio_ci,
    verdict,
)

ADAPTIVE = "tiered-adaptive"
# The stated bounds (issue 30's "Done when"; issue 18's memory share). Targets, not slack.
TTFT_MEDIAN_BOUND = 1.05   # upper bound of tiered-adaptive / best median TTFT ...
TTFT_MEDIAN_POINT = 1.0    # ... with its point estimate at most this
SPEEDUP_BOUND = 5.0
MEMORY_SHARE_BOUND = 0.5

STATUS = {True: "met", False: "missed", None: "not resolved"}


class Target(msgspec.Struct, frozen=True):
    name: str
    goal: str
    value: str
    met: bool | None  # None: not resolved or not evaluated (``status`` says which)
    status: str = "not evaluated"  # met | missed | not resolved | not evaluated
    interval: dict | None = None   # the interval the status was decided from


def _t(name: str, goal: str, value: str, met: bool | None, iv: Interval | None) -> Target:
    return Target(name, goal, value, met, STATUS[met], iv.to_dict() if iv else None)


def _none(name: str, goal: str, value: str = "–") -> Target:
    return Target(name, goal, value, None, "not evaluated", None)


def not_worse(iv: Interval, at: float = 1.0) -> bool | None:
    """A ratio where lower is better is not worse than ``at``: True when the interval's upper
    bound is ≤ ``at``, False when its lower bound is above, else None."""
    return at_most(iv, at)


def not_lower(iv: Interval, at: float = 1.0) -> bool | None:
    """A ratio where higher is better is not lower than ``at``: False when the whole interval
    is below ``at``, True otherwise; None without an interval."""
    if not iv.defined:
        return None
    return not iv.hi < at


def median_target(iv: Interval) -> bool | None:
    """Issue 30's TTFT target: upper bound ≤ 1.05 with the point ≤ 1.0 is met; an interval
    wholly above 1.0 (slower than the best) is missed; anything else is not resolved."""
    if not iv.defined:
        return None
    if iv.hi <= TTFT_MEDIAN_BOUND and iv.point <= TTFT_MEDIAN_POINT:
        return True
    if iv.lo > 1.0:
        return False
    return None


def _best(singles: dict[str, RunResult], key: str, highest: bool = False) -> str:
    pick = max if highest else min
    return pick(singles, key=lambda n: singles[n].summary()[key])


def _speedup(ad: RunResult | None, rc: RunResult | None) -> Target:
    name, goal = "speedup at the longest context", "≥ 5× vs recompute (per-turn, lower bound)"
    if ad is None or rc is None or not ad.ok_turns or not rc.ok_turns:
        return _none(name, goal)
    ts = sorted(ad.ok_turns, key=lambda t: t.prompt_tokens)
    top = ts[-max(1, round(len(ts) * 0.1)):]
    keys = [(t.conversation_id, t.turn) for t in top]
    p = paired_ttft(rc, ad, keys)
    return _t(name, goal, f"{p.ratio.fmt(1, 2)}× over {p.ratio.n} turns "
              f"({rc.ttft_at_longest() * 1e3:.0f} → {ad.ttft_at_longest() * 1e3:.0f} ms)",
              at_least(p.ratio, SPEEDUP_BOUND), p.ratio)


MEDIAN_NAME = "within 5% of the best single strategy"
MEDIAN_GOAL = "median TTFT ÷ best: upper bound ≤ 1.05, point ≤ 1.0 (per-turn ratio)"
P90_NAME = "TTFT p90 vs the best single strategy"
P90_GOAL = "p90 not worse: upper bound ≤ 1.0"
TPM_NAME = "turns per minute vs the best single strategy"
TPM_GOAL = "not lower: interval not wholly below 1.0 (per-repeat ratio)"
MEM_NAME = "device memory vs device-ttl"
MEM_GOAL = "mean block·s ≤ device-ttl's: upper bound ≤ 1.0 (per repeat)"
HALF_NAME = "device memory ≤ 50% of device-ttl's"
HALF_GOAL = "block·s upper bound ≤ 0.5 at reuse not lower than device-ttl's (per repeat)"
BEAT_NAME = "beats every fixed strategy"
BEAT_GOAL = ("against each fixed strategy: median TTFT ratio upper bound < 1.0 (per turn), "
             "or turns/min ratio lower bound > 1.0 (per repeat)")


def _within_median(ad: RunResult, singles: dict[str, RunResult]) -> Target:
    best = _best(singles, "ttft_p50_s")
    p = paired_ttft(ad, singles[best])
    return _t(MEDIAN_NAME, MEDIAN_GOAL, f"{p.ratio.fmt(1, 3)}× of {best} over {p.ratio.n} "
              f"turns ({p.verdict})", median_target(p.ratio), p.ratio)


def _within_p90(ad: RunResult, singles: dict[str, RunResult]) -> Target:
    best = _best(singles, "ttft_p90_s")
    b = singles[best]
    iv = quantile_ratio_ci([t.ttft_s for t in ad.ok_turns], [t.ttft_s for t in b.ok_turns], 0.9,
                           clusters_a=[t.conversation_id for t in ad.ok_turns],
                           clusters_b=[t.conversation_id for t in b.ok_turns])
    return _t(P90_NAME, P90_GOAL, f"{iv.fmt(1, 3)}× of {best} ({verdict(iv)})",
              not_worse(iv), iv)


def _throughput(ad: RunResult, singles: dict[str, RunResult]) -> Target:
    best = _best(singles, "turns_per_min", highest=True)
    iv = per_repeat_ratio(ad, singles[best], "turns_per_min")
    ok = not_lower(iv)
    word = "" if ok is None else (" (lower)" if ok is False else
                                  (" (higher)" if iv.lo > 1.0 else " (not lower)"))
    return _t(TPM_NAME, TPM_GOAL, f"{iv.fmt(1, 3)}× of {best} over {iv.n} repeats{word}",
              ok, iv)


def _beats_all(ad: RunResult, singles: dict[str, RunResult]) -> Target:
    """Target 7 (module docstring): the closest fixed strategy decides each metric."""
    ttft = {n: paired_ttft(ad, b).ratio for n, b in singles.items()}
    tpm = {n: per_repeat_ratio(ad, b, "turns_per_min") for n, b in singles.items()}
    if not all(iv.defined for iv in ttft.values()):
        return _none(BEAT_NAME, BEAT_GOAL)
    near_t = max(ttft, key=lambda n: ttft[n].hi)       # the one tiered-adaptive beats least
    faster = ttft[near_t].hi < 1.0
    slower = any(iv.lo > 1.0 for iv in ttft.values())
    parts = [f"TTFT p50 {ttft[near_t].fmt(1, 3)}× of {near_t}"]
    higher, lower, near_r = False, False, None
    if all(iv.defined for iv in tpm.values()):
        near_r = min(tpm, key=lambda n: tpm[n].lo)
        higher = tpm[near_r].lo > 1.0
        lower = any(iv.hi < 1.0 for iv in tpm.values())
        parts.append(f"turns/min {tpm[near_r].fmt(1, 3)}× of {near_r} over "
                     f"{tpm[near_r].n} repeats")
    else:
        parts.append("turns/min not decidable (fewer than 3 repeats)")
    met = True if (faster or higher) else (False if slower and lower else None)
    iv = tpm[near_r] if higher and near_r is not None else ttft[near_t]
    return _t(BEAT_NAME, BEAT_GOAL, "; ".join(parts) + f" (closest of {len(singles)} fixed)",
              met, iv)


def decode_capacity(meta: dict) -> int | None:
    """The decode nodes' KV blocks in all, where the run's regime capped them (else None)."""
    blocks = (meta.get("regime") or {}).get("decode_num_blocks")
    return int(blocks) * int(meta.get("decode", 1)) if blocks else None


def _memory(ad: RunResult | None, dt: RunResult | None,
            capacity: int | None = None) -> list[Target]:
    if ad is None or dt is None or dt.device_block_seconds() <= 0:
        return [_none(MEM_NAME, MEM_GOAL), _none(HALF_NAME, HALF_GOAL)]
    mem = per_repeat_ratio(ad, dt, "device_block_s")
    shown_mem = f"{mem.fmt(100, 1, '%')} of its block·s over {mem.n} repeats"
    over = [r for r in (ad, dt) if capacity is not None and r.device_blocks_peak() > capacity]
    if over:  # a ledger that held more than the node has is not a measurement of the node
        why = (f"{shown_mem}; not decidable: {over[0].strategy}'s device blocks "
               f"({over[0].meta.get('device_blocks_source', 'ledger')}) peak at "
               f"{over[0].device_blocks_peak()}, above the decode nodes' {capacity}")
        return [_t(MEM_NAME, MEM_GOAL, why, None, mem), _t(HALF_NAME, HALF_GOAL, why, None, mem)]
    dt_reuse = per_repeat(dt, "reuse_rate")
    if max(dt_reuse, default=0.0) > 0:
        reuse = ratio_ci(paired_ratios(dict(enumerate(per_repeat(ad, "reuse_rate"))),
                                       dict(enumerate(dt_reuse))))
        reuse_ok = not_lower(reuse)
        shown = f"{reuse.fmt(100, 1, '%')} of its reuse"
    else:  # device-ttl reused nothing (every wait outlived its TTL): any reuse matches it
        reuse_ok = True if ad.reuse_rate() > 0 else None
        shown = f"{ad.reuse_rate():.1%} reuse vs device-ttl's 0%"
    half = at_most(mem, MEMORY_SHARE_BOUND)
    both = False if False in (half, reuse_ok) else (True if half and reuse_ok else None)
    return [_t(MEM_NAME, MEM_GOAL, shown_mem, not_worse(mem), mem),
            _t(HALF_NAME, HALF_GOAL, f"{shown_mem}, {shown}", both, mem)]


def evaluate(results: Sequence[RunResult], decode_blocks: int | None = None,
             failed: Sequence[str] = ()) -> list[Target]:
    """Every target (``decode_blocks``: the decode nodes' KV capacity, ``decode_capacity``; a
    device-block count above it leaves the memory targets not resolved). ``failed``: the
    strategies of the run that failed (``meta["failed_strategies"]``): when a fixed one is
    among them the best single strategy is unknown, and the targets measured against it are
    not evaluated (a host-scarce run whose device-ttl failed would otherwise have judged
    tiered-adaptive against host-p2p)."""
    by = {r.strategy: r for r in results}
    ad = by.get(ADAPTIVE)
    singles = {n: r for n, r in by.items() if n != ADAPTIVE and r.ok_turns}
    out = [_speedup(ad, by.get("recompute"))]
    lost = sorted(n for n in failed if n != ADAPTIVE)
    if lost:
        why = f"– ({', '.join(lost)} failed: the best single strategy is unknown)"
        out += [_none(MEDIAN_NAME, MEDIAN_GOAL, why), _none(P90_NAME, P90_GOAL, why),
                _none(TPM_NAME, TPM_GOAL, why)]
    elif ad is not None and ad.ok_turns and singles:
        out += [_within_median(ad, singles), _within_p90(ad, singles), _throughput(ad, singles)]
    else:
        out += [_none(MEDIAN_NAME, MEDIAN_GOAL), _none(P90_NAME, P90_GOAL),
                _none(TPM_NAME, TPM_GOAL)]
    out += _memory(ad, by.get("device-ttl"), decode_blocks)
    if lost:
        out.append(_none(BEAT_NAME, BEAT_GOAL, why))
    elif ad is not None and ad.ok_turns and singles:
        out.append(_beats_all(ad, singles))
    else:
        out.append(_none(BEAT_NAME, BEAT_GOAL))
    return out


def best_single(results: Sequence[RunResult]) -> str | None:
    """The fixed strategy the median-TTFT target compares tiered-adaptive with (the lowest
    median TTFT among those with completed turns), or None without one."""
    singles = {r.strategy: r for r in results if r.strategy != ADAPTIVE and r.ok_turns}
    return _best(singles, "ttft_p50_s") if singles else None


def evaluate_run(results: Sequence[RunResult], meta: dict) -> list[Target]:
    """``evaluate`` with what a run's ``meta`` says: its decode capacity and failed strategies."""
    return evaluate(results, decode_capacity(meta), list(meta.get("failed_strategies") or ()))


def markdown(targets: Sequence[Target]) -> str:
    mark = {"met": "met", "missed": "**missed**", "not resolved": "not resolved",
            "not evaluated": "not evaluated"}
    lines = ["| target | goal | this run [95% CI] | verdict (from the interval) |",
             "|---|---|---|---|"]
    lines += [f"| {t.name} | {t.goal} | {t.value} | {mark.get(t.status, t.status)} |"
              for t in targets]
    return "\n".join(lines)

