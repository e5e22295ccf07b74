"""The A/B harness's targets, evaluated from one run's records through intervals.

All about ``tiered-adaptive`` (what the harness exists to show). Each target is decided only
from a 95% bootstrap interval (``kvtier.ab.stats``): *met* when the whole interval is on the
goal's side of the bound, *missed* when the whole interval is on the other side, *not
resolved* when it straddles the bound (or has too few values), *not evaluated* when a
strategy it needs is missing.

1. **speedup at the longest context** ≥ 5×: per-turn ratios recompute / tiered-adaptive over
   tiered-adaptive's longest-context tenth of turns (paired with the same turns of recompute);
2. **within 5% of the best single strategy** (median TTFT): per-turn ratios tiered-adaptive /
   best (the single strategy with the lowest median TTFT), interval ≤ 1.05;
3. **TTFT p90 not worse than the best single strategy's** (within 5%): ratio of the p90s,
   each resampled on its own, interval ≤ 1.05;
4. **turns per minute not lower** than the best single strategy's (within 5%): per-repeat
   ratios, interval ≥ 0.95 (needs ``--repeats`` ≥ 3);
5. **memory**: device block-seconds ≤ 50% of ``device-ttl``'s (per-repeat ratios, interval
   ≤ 0.5) at a reuse rate ≥ 95% of ``device-ttl``'s (interval ≥ 0.95; any reuse matches a
   device-ttl that reused nothing).

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
TOLERANCE = 0.05

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


def _none(name: str, goal: str) -> Target:
    return Target(name, goal, "–", None, "not evaluated", None)


def _best(singles: dict[str, RunResult], key: str, highest: bool = False) -> str:
    pick = max if highest else min
    return pick(singles, key=lambda n: singles[n].summary()[key])


def _speedup(ad: RunResult | None, rc: RunResult | None) -> Target:
    name, goal = "speedup at the longest context", "≥ 5× vs recompute (per-turn, interval)"
    if ad is None or rc is None or not ad.ok_turns or not rc.ok_turns:
        return _none(name, goal)
    ts = sorted(ad.ok_turns, key=lambda t: t.prompt_tokens)
    top = ts[-max(1, round(len(ts) * 0.1)):]
    keys = [(t.conversation_id, t.turn) for t in top]
    p = paired_ttft(rc, ad, keys)
    return _t(name, goal, f"{p.ratio.fmt(1, 2)}× over {p.ratio.n} turns "
              f"({rc.ttft_at_longest() * 1e3:.0f} → {ad.ttft_at_longest() * 1e3:.0f} ms)",
              at_least(p.ratio, 5.0), p.ratio)


def _within_median(ad: RunResult, singles: dict[str, RunResult]) -> Target:
    name = "within 5% of the best single strategy"
    goal = "median TTFT ≤ 1.05× best (per-turn ratio, interval)"
    best = _best(singles, "ttft_p50_s")
    p = paired_ttft(ad, singles[best])
    return _t(name, goal, f"{p.ratio.fmt(1, 3)}× of {best} over {p.ratio.n} turns "
              f"({p.verdict})", at_most(p.ratio, 1 + TOLERANCE), p.ratio)


def _within_p90(ad: RunResult, singles: dict[str, RunResult]) -> Target:
    name = "TTFT p90 vs the best single strategy"
    goal = "p90 ≤ 1.05× best (interval)"
    best = _best(singles, "ttft_p90_s")
    iv = quantile_ratio_ci([t.ttft_s for t in ad.ok_turns],
                           [t.ttft_s for t in singles[best].ok_turns], 0.9)
    return _t(name, goal, f"{iv.fmt(1, 3)}× of {best} ({verdict(iv)})",
              at_most(iv, 1 + TOLERANCE), iv)


def _throughput(ad: RunResult, singles: dict[str, RunResult]) -> Target:
    name = "turns per minute vs the best single strategy"
    goal = "≥ 0.95× best (per-repeat ratio, interval)"
    best = _best(singles, "turns_per_min", highest=True)
    iv = per_repeat_ratio(ad, singles[best], "turns_per_min")
    return _t(name, goal, f"{iv.fmt(1, 3)}× of {best} over {iv.n} repeats",
              at_least(iv, 1 - TOLERANCE), iv)


def _memory(ad: RunResult | None, dt: RunResult | None) -> Target:
    name, goal = "device memory vs device-ttl", "≤ 50% block·s at ≥ 95% reuse (per repeat)"
    if ad is None or dt is None or dt.device_block_seconds() <= 0:
        return _none(name, goal)
    mem = per_repeat_ratio(ad, dt, "device_block_s")
    dt_reuse = per_repeat(dt, "reuse_rate")
    if max(dt_reuse, default=0.0) > 0:
        reuse = ratio_ci(paired_ratios(dict(enumerate(per_repeat(ad, "reuse_rate"))),
                                       dict(enumerate(dt_reuse))))
        reuse_ok = at_least(reuse, 1 - TOLERANCE)
        shown = f"{reuse.fmt(100, 1, '%')} of its reuse"
    else:  # device-ttl reused nothing (every wait outlived its TTL): any reuse matches it
        reuse_ok = True if ad.reuse_rate() > 0 else None
        shown = f"{ad.reuse_rate():.1%} reuse vs device-ttl's 0%"
    mem_ok = at_most(mem, 0.5)
    met = False if False in (mem_ok, reuse_ok) else (True if mem_ok and reuse_ok else None)
    return _t(name, goal, f"{mem.fmt(100, 1, '%')} block·s over {mem.n} repeats, {shown}",
              met, mem)


def evaluate(results: Sequence[RunResult]) -> list[Target]:
    by = {r.strategy: r for r in results}
    ad = by.get(ADAPTIVE)
    singles = {n: r for n, r in by.items() if n != ADAPTIVE and r.ok_turns}
    out = [_speedup(ad, by.get("recompute"))]
    if ad is not None and ad.ok_turns and singles:
        out += [_within_median(ad, singles), _within_p90(ad, singles), _throughput(ad, singles)]
    else:
        out += [_none("within 5% of the best single strategy", "median TTFT ≤ 1.05× best"),
                _none("TTFT p90 vs the best single strategy", "p90 ≤ 1.05× best"),
                _none("turns per minute vs the best single strategy", "≥ 0.95× best")]
    out.append(_memory(ad, by.get("device-ttl")))
    return out


def markdown(targets: Sequence[Target]) -> str:
    mark = {"met": "met", "missed": "**missed**", "not resolved": "not resolved",
            "not evaluated": "not evaluated"}
    lines = ["| target | goal | this run [95% CI] | verdict (from the interval) |",
             "|---|---|---|---|"]
    lines += [f"| {t.name} | {t.goal} | {t.value} | {mark.get(t.status, t.status)} |"
              for t in targets]
    return "\n".join(lines)

