"""``kvtier demo`` (what ``./run demo`` runs): a short live ``kvtier ab`` where reuse pays.

Reuse skips recomputing the conversation so far; it pays only when prefilling that context
costs more than reading its KV. On the tiny model a 1k-token prefill takes ~0.1 s, about what
a KV read costs on this CPU stack, so the old demo (tiny, ~1k tokens) showed reuse as slower.
This one serves the ``bench`` preset (88M parameters; ~2.8 s to prefill 2k tokens on a 2-core
EPYC) with two agentic conversations whose context grows from ~1.5k to ~2.5k tokens, and
compares recompute, device retention (``device-ttl``: the decode node keeps the turn, the next
prefill reads it D->P), the host tier (``host-p2p``) and ``tiered-adaptive`` (host tier plus decode
leases: the router holds or releases each retained turn online, from a cost model fitted to the
three runs before it). It ends with the computed tokens each
strategy saved, the memory each held while the tools ran, and two plain sentences: how much
faster (or slower) the next turn was at the longest context, and how much device memory each
strategy held.

Threading model: runs on the caller's thread (the runner owns its helper threads).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from kvtier.ab.compare import paired_ttft
from kvtier.ab.live.ab import run_ab
from kvtier.ab.rawdoc import read_raw
from kvtier.ab.records import RunResult
from kvtier.ab.traces import LengthDist, SyntheticTraceConfig, WaitDist, synthetic

DEMO_STRATEGIES = "recompute,device-ttl,host-p2p,tiered-adaptive"
DEMO_MODEL = "bench"
DEMO_MAX_MODEL_LEN = 4096


def demo_trace() -> SyntheticTraceConfig:
    """Two conversations, four turns, context ~1.5k -> ~2.5k tokens, 2 s tool waits."""
    return SyntheticTraceConfig(
        name="demo-2x4-ctx2.5k", conversations=2, turns=4,
        first_prompt_tokens=LengthDist(mean=1536, spread=0.1),
        tool_output_tokens=LengthDist(mean=256, spread=0.2),
        response_tokens=LengthDist(mean=24, spread=0.0),
        wait=WaitDist(kind="fixed", median_s=2.0), concurrency=2, stagger_s=1.0, seed=4,
        max_context_tokens=3000)


def run_demo(args: argparse.Namespace) -> int:
    """``kvtier ab`` with the demo's fixed settings; only strategies, output directory and
    time scale come from the command line. Prints the verdict sentences after the report."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "demo-trace.jsonl"
    synthetic(demo_trace()).save(trace_path)
    ns = argparse.Namespace(
        model=getattr(args, "model", None) or DEMO_MODEL, strategies=args.strategies,
        trace=str(trace_path), out=args.out, time_scale=args.time_scale, simulate=False,
        conversations=2, turns=4, seed=0, decode_ttl=None, host_mib=None, prefill=1, decode=1,
        block_size=32, max_model_len=DEMO_MAX_MODEL_LEN, cost=None, no_progress=False,
        repeats=1)
    rc = run_ab(ns)
    try:
        doc = read_raw(out)
    except (OSError, ValueError):
        return rc
    results = msgspec.convert(doc["results"], list[RunResult])
    print()
    print(explain(results, int(doc["meta"].get("kv_bytes_per_token", 0)),
                  int(doc["meta"].get("block_size", 32))))
    return rc


def _mib(blocks: float, block_size: int, kvbpt: int) -> float:
    return blocks * block_size * kvbpt / 2**20


def speed_words(base_s: float, other_s: float) -> str:
    """``other`` against ``base`` (two times): "N× faster" only when it took less time,
    "N× slower" when more, "as fast" when equal."""
    if other_s < base_s:
        return f"{base_s / other_s:.1f}× faster"
    if other_s > base_s:
        return f"{other_s / base_s:.1f}× slower"
    return "as fast"


def explain(results: list[RunResult], kvbpt: int, block_size: int) -> str:
    """The demo's closing table and sentences, from the run's records only."""
    by = {r.strategy: r for r in results}
    base = by.get("recompute")
    lines = ["| strategy | TTFT p50 ms | TTFT longest ctx ms | computed tokens (saved) | "
             "device memory held, mean MiB | host memory held, mean MiB |",
             "|---|---|---|---|---|---|"]
    for r in results:
        s = r.summary()
        dur = r.duration_s() or 1.0
        saved = (base.summary()["computed_tokens"] - s["computed_tokens"]) if base else 0
        lines.append(
            f"| {r.strategy} | {s['ttft_p50_s'] * 1e3:,.0f} | {s['ttft_longest_s'] * 1e3:,.0f} "
            f"| {s['computed_tokens']:,} ({saved:,}) "
            f"| {_mib(s['device_block_s'] / dur, block_size, kvbpt):.1f} "
            f"| {s['host_gb_s'] * 1e9 / dur / 2**20:.1f} |")
    lines.append("")
    lines.append("Reuse skips recomputing the conversation so far: it pays when prefilling the "
                 "context costs more than reading its KV, and it costs memory held while the "
                 "tool runs.")
    if base is None or not base.ok_turns:
        return "\n".join(lines)
    longest = max(t.prompt_tokens for t in base.ok_turns)
    follow = [(t.conversation_id, t.turn) for t in base.follow_ups]
    parts = []
    for r in results:
        if r is base or not r.ok_turns:
            continue
        p = paired_ttft(r, base, follow)
        parts.append(f"{r.strategy} {r.ttft_at_longest() * 1e3:,.0f} ms "
                     f"({speed_words(base.ttft_at_longest(), r.ttft_at_longest())}; over "
                     f"all {p.ratio.n} follow-up turns {r.strategy}/recompute = "
                     f"{p.ratio.fmt(1, 2)}: {p.verdict})")
    if parts:
        lines.append(f"At the longest context (~{longest:,} tokens) the next turn's first token "
                     f"took {base.ttft_at_longest() * 1e3:,.0f} ms with recompute, "
                     + "; ".join(parts) + ".")
    held = []
    for r in results:
        dur = r.duration_s() or 1.0
        held.append(f"{r.strategy} {_mib(r.device_block_seconds() / dur, block_size, kvbpt):.1f} "
                    f"MiB (peak {_mib(r.device_blocks_peak(), block_size, kvbpt):.1f})")
    lines.append("While the tools ran, the decode node held on average: " + ", ".join(held)
                 + "; host tiers held what the table's last column says, in host memory.")
    for r in results:
        choices = r.hold_choices()
        if choices:
            held_n = sum(c["held"] for c in choices.values())
            released = sum(c["released"] for c in choices.values())
            reads = sum(c["dp_reads"] for c in choices.values())
            lines.append(f"{r.strategy} decided per turn, online: {held_n} turns held on the "
                         f"decode node, {released} released at once (the host copy or "
                         f"recompute was as cheap), {reads} next turns read from the decode node.")
    return "\n".join(lines)
