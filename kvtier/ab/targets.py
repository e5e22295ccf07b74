"""The A/B harness's targets, evaluated from one run's records (never from constants).

Three targets, all about ``tiered-adaptive`` (what the harness exists to show):

1. **speedup at the longest context**: ``recompute``'s TTFT over ``tiered-adaptive``'s, both the
   median over the longest-context tenth of turns (`RunResult.ttft_at_longest`) — ≥ 5×;
2. **within 5% of the best single strategy** (median TTFT, this run; evaluated per regime by
   running one trace per regime);
3. **memory**: ``tiered-adaptive``'s device block-seconds ≤ 50% of ``device-ttl``'s, at a reuse
   rate ≥ 95% of ``device-ttl``'s.

A target whose strategies are missing from the run is reported as not evaluated.

Threading model: pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from kvtier.ab.records import RunResult

ADAPTIVE = "tiered-adaptive"


class Target(msgspec.Struct, frozen=True):
    name: str
    goal: str
    value: str
    met: bool | None  # None: not evaluated (a strategy is missing, or no turns)


def _median_ttft(r: RunResult) -> float:
    return r.summary()["ttft_p50_s"]


def evaluate(results: Sequence[RunResult]) -> list[Target]:
    by = {r.strategy: r for r in results}
    ad = by.get(ADAPTIVE)
    out: list[Target] = []

    rc = by.get("recompute")
    if ad is not None and rc is not None and ad.ok_turns and rc.ok_turns:
        x = rc.ttft_at_longest() / ad.ttft_at_longest()
        out.append(Target("speedup at the longest context", "≥ 5× vs recompute",
                          f"{x:.2f}× ({rc.ttft_at_longest() * 1e3:.0f} → "
                          f"{ad.ttft_at_longest() * 1e3:.0f} ms)", x >= 5.0))
    else:
        out.append(Target("speedup at the longest context", "≥ 5× vs recompute", "–", None))

    singles = {n: r for n, r in by.items() if n != ADAPTIVE and r.ok_turns}
    if ad is not None and ad.ok_turns and singles:
        best_name = min(singles, key=lambda n: _median_ttft(singles[n]))
        ratio = _median_ttft(ad) / _median_ttft(singles[best_name])
        out.append(Target("within 5% of the best single strategy", "median TTFT ≤ 1.05× best",
                          f"{ratio:.3f}× of {best_name} ({_median_ttft(ad) * 1e3:.0f} vs "
                          f"{_median_ttft(singles[best_name]) * 1e3:.0f} ms)", ratio <= 1.05))
    else:
        out.append(Target("within 5% of the best single strategy", "median TTFT ≤ 1.05× best",
                          "–", None))

    dt = by.get("device-ttl")
    if ad is not None and dt is not None and dt.device_block_seconds() > 0:
        mem = ad.device_block_seconds() / dt.device_block_seconds()
        # device-ttl reusing nothing (every wait outlived its TTL): any reuse matches it
        reuse = ad.reuse_rate() / dt.reuse_rate() if dt.reuse_rate() > 0 else math.inf
        shown = (f"{reuse:.1%} of its reuse" if math.isfinite(reuse) else
                 f"{ad.reuse_rate():.1%} reuse vs device-ttl's 0%")
        out.append(Target("device memory vs device-ttl", "≤ 50% block·s at ≥ 95% reuse",
                          f"{mem:.1%} block·s, {shown}", bool(mem <= 0.5 and reuse >= 0.95)))
    else:
        out.append(Target("device memory vs device-ttl", "≤ 50% block·s at ≥ 95% reuse", "–",
                          None))
    return out


def markdown(targets: Sequence[Target]) -> str:
    mark = {True: "met", False: "**missed**", None: "not evaluated"}
    lines = ["| target | goal | this run | |", "|---|---|---|---|"]
    lines += [f"| {t.name} | {t.goal} | {t.value} | {mark[t.met]} |" for t in targets]
    return "\n".join(lines)
