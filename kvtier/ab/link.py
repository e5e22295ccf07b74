"""The D->P link an A/B run measured: what its device reads moved, beside a device copy.

A strategy whose follow-up turns read the decode node's KV (``dp_read``) moves
``reused_tokens x kv_bytes_per_token`` per turn; the prefill's NIXL transfer time
(``vllm:nixl_xfer_time_seconds_sum``, shared over the reading turns by
``kvtier.ab.live.measure.split_transfer``) is the time it took. Their ratio is the link's
bandwidth as the run saw it. The figure is given only for strategies whose every read was a
D->P read: vLLM exports no per-request transfer time, so a strategy that also read from a
peer's host tier shares one total over both paths and its D->P share cannot be told apart.

The anchor is a device-to-device copy measured in the same call on the same card
(``d2d_copy.json`` beside the run's raw document, written by ``benchmarks/gpu/device.sh``):
on one GPU, both instances share the card, so a D->P read at device-copy speed is the most
the link could give.

``peer_fetch_table`` is the other link a follow-up turn can take: a peer fetch from another
instance's host tier, as the reading host tiers timed it (``meta["peer_fetch"]``, from
``kvtier_tier_peer_fetch_seconds_total{phase}``), mean milliseconds per fetch by phase.

Threading model: pure functions; call from any thread.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.ab.records import RunResult, repeat_meta
from kvtier.ids import ReusePath
from kvtier.tier.accounting import PEER_PHASES

ANCHOR_NAME = "d2d_copy.json"


@dataclass(frozen=True)
class LinkFigure:
    """One strategy's D->P reads over the whole run (every repeat)."""

    strategy: str
    turns: int
    tokens: int
    gbytes: float
    seconds: float

    @property
    def gb_s(self) -> float:
        return self.gbytes / self.seconds


def dp_reads(results: Sequence[RunResult], kv_bytes_per_token: int) -> list[LinkFigure]:
    """Strategies with D->P reads and transfer time, all of whose reads were D->P."""
    out = []
    for r in results:
        reads = [t for t in r.turns if t.ok and ReusePath(t.reuse_path).is_read
                 and t.reused_tokens > 0]
        dp = [t for t in reads if t.reuse_path == ReusePath.DP_READ]
        seconds = sum(t.transfer_s for t in dp)
        if not dp or len(dp) != len(reads) or not seconds > 0:
            continue
        tokens = sum(t.reused_tokens for t in dp)
        out.append(LinkFigure(r.strategy, len(dp), tokens,
                              tokens * kv_bytes_per_token / 1e9, seconds))
    return out


def read_anchor(run_dir: Path) -> dict | None:
    """The device copy measured beside the run, or None."""
    p = Path(run_dir) / ANCHOR_NAME
    try:
        doc = json.loads(p.read_text())
        return doc if float(doc["gb_s"]) > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def link_table(results: Sequence[RunResult], meta: dict,
               anchor: dict | None = None) -> list[str]:
    """The D->P reads' bandwidth, explained, as a table, beside ``anchor`` when given
    ([] when no strategy's reads qualify)."""
    kvb = int(meta.get("kv_bytes_per_token") or 0)
    figs = dp_reads(results, kvb) if kvb else []
    if not figs:
        return []
    ucx = (meta.get("environment") or {}).get("ucx_env") or {}
    lines = ["KV moved by D->P reads (reused tokens x "
             f"{kvb:,} B/token) over the prefill's NIXL transfer time for them "
             "(`vllm:nixl_xfer_time_seconds_sum`), every repeat together"
             + (f"; UCX settings: {', '.join(f'`{k}={v}`' for k, v in ucx.items())}"
                if ucx else "; no UCX setting given") + ".", "",
             "| strategy | D->P reads | tokens | GB | NIXL s | GB/s |"
             + (" ÷ device copy |" if anchor else ""),
             "|---|---|---|---|---|---|" + ("---|" if anchor else "")]
    for f in figs:
        row = (f"| {f.strategy} | {f.turns} | {f.tokens:,} | {f.gbytes:.2f} | "
               f"{f.seconds:.3f} | {f.gb_s:.3g} |")
        if anchor:
            row += f" {100 * f.gb_s / float(anchor['gb_s']):.2g}% |"
        lines.append(row)
    if anchor:
        lines += ["", f"Device-to-device copy on the same card in the same call "
                  f"(`{ANCHOR_NAME}`, {anchor.get('device', '?')}): "
                  f"{float(anchor['gb_s']):,.0f} GB/s ({int(anchor.get('bytes', 0)):,} B, "
                  f"median of {len(anchor.get('ms') or [])})."]
    return lines


def link_section(results: Sequence[RunResult], meta: dict,
                 anchor: dict | None = None) -> list[str]:
    """The report's "D->P link" section: ``link_table`` under its heading ([] without)."""
    table = link_table(results, meta, anchor)
    if not table:
        return []
    return ["## The D->P link, as this run's reads saw it", "", *table, ""]


def peer_fetch_table(results: Sequence[RunResult]) -> list[str]:
    """Each strategy's peer fetches per reading instance, every repeat together: how many,
    and the mean milliseconds each phase took in the reader ([] when no strategy fetched)."""
    rows = []
    for r in results:
        totals: dict[str, dict[str, float]] = {}
        for part in repeat_meta(r, "peer_fetch"):
            for pod, d in (part or {}).items():
                t = totals.setdefault(pod, {})
                for k, v in d.items():
                    t[k] = t.get(k, 0.0) + float(v)
        for pod, t in sorted(totals.items()):
            n = t.get("fetches", 0.0)
            if n > 0:
                ms = [1e3 * t.get(p, 0.0) / n for p in PEER_PHASES]
                rows.append(f"| {r.strategy} | {pod} | {n:.0f} | "
                            + " | ".join(f"{x:.2f}" for x in ms) + f" | {sum(ms):.2f} |")
    if not rows:
        return []
    return ["Peer fetches, as the reading instance's host tier timed them "
            "(`kvtier_tier_peer_fetch_seconds_total` ÷ `kvtier_tier_peer_fetches_total`, every "
            "repeat together): mean ms per fetch, by phase.", "",
            "| strategy | reader | fetches | " + " | ".join(PEER_PHASES) + " | total |",
            "|---|---|---|" + "---|" * (len(PEER_PHASES) + 1), *rows]
