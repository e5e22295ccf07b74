"""Strategies against each other, with intervals: what the report's comparison tables show.

- ``strategy_intervals(r)``: one strategy's TTFT p50 / p90 (bootstrap over its conversations,
  each resampled whole: ``kvtier.ab.stats``) and
  turns per minute (bootstrap over its repeats, when it has ``meta["per_repeat"]``);
- ``paired_ttft(a, b, keys=None)``: the median of per-turn TTFT ratios ``a / b`` over the turns
  both ran (same conversation, same turn, same repeat: ``RunResult.ttft_by_turn``), its
  interval (clustered by conversation), and the verdict ("faster" means ``a`` is faster);
- ``per_repeat_ratio(a, b, key)``: ``a``'s per-repeat value over ``b``'s, paired by repeat
  (the rotated sweep runs repeat *k* of every strategy in one round), with its interval;
- ``pairwise(results)``: ``paired_ttft`` for every ordered pair in report order;
- ``same_path(a, b)``: ``paired_ttft`` over only the turns both took by the same reuse path
  (device read, peer or local host read, recompute), one per path: what separates two
  strategies when their choices agree (their engines' configuration, their routers' steps);
- ``path_pairs(a, b)``: the same over every (``a``'s path, ``b``'s path) cell, with each side's
  median reused tokens: which of ``a``'s choices against ``b``'s make the overall ratio.

Every verdict comes from an interval (``kvtier.ab.stats``), never from two point estimates.

Threading model: pure functions.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.ab.records import RunResult, TurnRecord
from kvtier.ab.stats import (
    Interval,
    Verdict,
    paired,
    paired_ratios,
    quantile_ci,
    ratio_ci,
    verdict,
)


@dataclass(frozen=True)
class StrategyIntervals:
    strategy: str
    ttft_p50: Interval
    ttft_p90: Interval
    turns_per_min: Interval  # over repeats (n = repeats)


@dataclass(frozen=True)
class Paired:
    a: str
    b: str
    ratio: Interval        # median of per-turn a/b ratios
    verdict: Verdict       # "faster": a is faster than b


def strategy_intervals(r: RunResult) -> StrategyIntervals:
    ttft = [t.ttft_s for t in r.ok_turns]
    convs = [t.conversation_id for t in r.ok_turns]
    tpm = [p["turns_per_min"] for p in r.meta.get("per_repeat", ()) if "turns_per_min" in p]
    if not tpm:
        tpm = [r.turns_per_min()]
    return StrategyIntervals(r.strategy, quantile_ci(ttft, 0.5, clusters=convs),
                             quantile_ci(ttft, 0.9, clusters=convs), quantile_ci(tpm, 0.5))


def paired_ttft(a: RunResult, b: RunResult, keys: Iterable[tuple[str, int]] | None = None
                ) -> Paired:
    ta, tb = a.ttft_by_turn(), b.ttft_by_turn()
    if keys is not None:
        want = set(keys)
        ta = {k: v for k, v in ta.items() if k in want}
    keys, ratios = paired(ta, tb)
    iv = ratio_ci(ratios, clusters=[k[0] for k in keys])
    return Paired(a.strategy, b.strategy, iv, verdict(iv))


def same_path(a: RunResult, b: RunResult) -> list[tuple[str, Paired]]:
    """Per reuse path that ``a`` and ``b`` both took on a turn (same conversation, turn and
    repeat): the paired TTFT ratio ``a / b`` of those turns, paths in name order."""
    pb = {(t.conversation_id, t.turn): t.reuse_path for t in b.ok_turns}
    by: dict[str, list[tuple[str, int]]] = {}
    for t in a.ok_turns:
        k = (t.conversation_id, t.turn)
        if pb.get(k) == t.reuse_path:
            by.setdefault(str(t.reuse_path), []).append(k)
    return [(path, paired_ttft(a, b, keys)) for path, keys in sorted(by.items())]


@dataclass(frozen=True)
class PathPair:
    """Turns ``a`` took by ``path_a`` and ``b`` by ``path_b``: their paired TTFT ratio and
    each side's median reused tokens."""

    path_a: str
    path_b: str
    paired: Paired
    reused_a: float
    reused_b: float


def path_pairs(a: RunResult, b: RunResult) -> list[PathPair]:
    """Every turn both completed (same conversation, turn and repeat), grouped by the path
    each took: where ``same_path`` keeps the diagonal, this keeps every cell, most pairs
    first, so a gap can be traced to the choices (or block granularity) behind it."""
    tb = {(t.conversation_id, t.turn): t for t in b.ok_turns}
    by: dict[tuple[str, str], list[tuple[TurnRecord, TurnRecord]]] = {}
    for t in a.ok_turns:
        u = tb.get((t.conversation_id, t.turn))
        if u is not None:
            by.setdefault((str(t.reuse_path), str(u.reuse_path)), []).append((t, u))
    out = []
    for (pa, pb), tu in sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        keys = [(t.conversation_id, t.turn) for t, _ in tu]
        out.append(PathPair(pa, pb, paired_ttft(a, b, keys),
                            statistics.median(t.reused_tokens for t, _ in tu),
                            statistics.median(u.reused_tokens for _, u in tu)))
    return out


def path_pairs_markdown(results: Sequence[RunResult], b: str | None,
                        a: str = "tiered-adaptive") -> str:
    """``path_pairs`` of ``a`` against ``b`` as a table ("" when either is missing)."""
    by = {r.strategy: r for r in results}
    if b is None or a not in by or b not in by or a == b:
        return ""
    lines = [f"| {a} took | {b} took | pairs | median TTFT {a}/{b} [95% CI] | verdict for {a} "
             f"| median reused tokens, {a} / {b} |", "|---|---|---|---|---|---|"]
    for pp in path_pairs(by[a], by[b]):
        lines.append(f"| {pp.path_a} | {pp.path_b} | {pp.paired.ratio.n} | "
                     f"{pp.paired.ratio.fmt(1, 3)} | {_verdict_cell(pp.paired)} | "
                     f"{pp.reused_a:.0f} / {pp.reused_b:.0f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def per_repeat(r: RunResult, key: str) -> list[float]:
    """``key`` of each repeat (``meta["per_repeat"]``), or of the one run."""
    per = r.meta.get("per_repeat")
    if per:
        return [float(p[key]) for p in per if key in p]
    return [float(r.summary()[key])]


def per_repeat_ratio(a: RunResult, b: RunResult, key: str) -> Interval:
    """Median over repeats of ``a``'s ``key`` / ``b``'s, paired by repeat index."""
    va, vb = per_repeat(a, key), per_repeat(b, key)
    return ratio_ci(paired_ratios(dict(enumerate(va)), dict(enumerate(vb))))


def pairwise(results: Sequence[RunResult]) -> list[Paired]:
    """``paired_ttft(a, b)`` for every pair, ``a`` after ``b`` in report order."""
    out = []
    for i, a in enumerate(results):
        for b in results[:i]:
            out.append(paired_ttft(a, b))
    return out


def intervals_markdown(results: Sequence[RunResult]) -> str:
    """The per-strategy intervals table."""
    lines = ["| strategy | turns | TTFT p50 ms [95% CI] | TTFT p90 ms [95% CI] | "
             "turns/min [95% CI over repeats] |", "|---|---|---|---|---|"]
    for r in results:
        s = strategy_intervals(r)
        lines.append(f"| {r.strategy} | {len(r.ok_turns)} | {s.ttft_p50.fmt(1e3)} | "
                     f"{s.ttft_p90.fmt(1e3)} | {s.turns_per_min.fmt(1, 2)} |")
    return "\n".join(lines)


def _verdict_cell(p: Paired) -> str:
    """A paired ratio's verdict as a table shows it: bold when the interval decides."""
    return p.verdict if p.verdict == "not resolved" else f"**{p.verdict}**"


def same_path_markdown(results: Sequence[RunResult], a: str = "tiered-adaptive") -> str:
    """``same_path`` of strategy ``a`` against every other strategy ("" without ``a``)."""
    by = {r.strategy: r for r in results}
    if a not in by or len(by) < 2:
        return ""
    lines = [f"| B | path both took | pairs | median TTFT {a}/B [95% CI] | verdict for {a} |",
             "|---|---|---|---|---|"]
    for r in results:
        if r.strategy == a:
            continue
        for path, p in same_path(by[a], r):
            lines.append(f"| {r.strategy} | {path} | {p.ratio.n} | {p.ratio.fmt(1, 3)} | "
                         f"{_verdict_cell(p)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def pairwise_markdown(results: Sequence[RunResult]) -> str:
    """The paired per-turn ratio table (every pair)."""
    pairs = pairwise(results)
    if not pairs:
        return "(one strategy: nothing to pair)"
    lines = ["| A | B | pairs | median TTFT A/B [95% CI] | verdict for A |", "|---|---|---|---|---|"]
    for p in pairs:
        lines.append(f"| {p.a} | {p.b} | {p.ratio.n} | {p.ratio.fmt(1, 3)} | {_verdict_cell(p)} |")
    return "\n".join(lines)
