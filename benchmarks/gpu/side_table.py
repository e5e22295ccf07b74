"""Markdown tables of one side-by-side run (side_bench.sh via device.sh BENCH=side), from its JSON.

Reads DIR/side.json (probe_side.py), DIR/bench_copy.json and DIR/bench_scatter.json when there,
DIR/device.txt for the card; writes DIR/side-by-side.md. Every figure in it comes from those
files; the targets are issue 29's, each marked met or missed.

usage: .venv/bin/python benchmarks/gpu/side_table.py benchmarks/gpu/results/DATE-CARD
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

KV_BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B shape: 32 layers x K,V x 8 heads x 128 x bf16


NAN = {"median_ms": float("nan"), "min_ms": float("nan"), "max_ms": float("nan")}


def ms(d: dict) -> str:
    return f"{d['median_ms']:.1f} ({d['min_ms']:.1f}–{d['max_ms']:.1f})"


def filled(side: dict) -> dict:
    """The TTFT columns, a server that did not start given NaN (shown as nan, never met)."""
    for d in side["ttft"].values():
        for k in ("recompute", "hbm", "kvtier", "vllm_offload"):
            d.setdefault(k, NAN)
        d.setdefault("outputs_equal", {})
        for k in ("kvtier", "vllm_offload"):
            d["outputs_equal"].setdefault(k, None)
    return side


def hbm_valid(d: dict) -> bool:
    """(d) is a full HBM hit only where it beats both host tiers: BASE's KV cache (~60k tokens
    at 0.3 of an H100) cannot hold a 32k prompt beside the salted 32k recompute run just before
    it, so part of the prompt is recomputed there and (d) is no upper bound."""
    return bool(d["hbm"]["median_ms"] < min(d["kvtier"]["median_ms"], d["vllm_offload"]["median_ms"]))


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def card(folder: Path) -> str:
    dev = folder / "device.txt"
    if dev.exists():
        m = re.search(r"torch \S+ (NVIDIA [^\n]+)", dev.read_text())
        if m:
            return m.group(1).strip()
    bc = folder / "bench_copy.json"
    if bc.exists():
        return str(json.loads(bc.read_text()).get("device", "unknown card"))
    return "unknown card"


def ttft_section(side: dict) -> list[str]:
    out = ["## Next turn's TTFT, ms: median (min–max) of "
           f"{side['reps']} repeats", "",
           "| tokens | (c) recompute | (a) kvtier host tier | (b) vLLM OffloadingConnector "
           "| (d) HBM prefix hit | a ÷ b | c ÷ a | a ÷ d | outputs equal (a, b) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for n, d in side["ttft"].items():
        a, b = d["kvtier"]["median_ms"], d["vllm_offload"]["median_ms"]
        c, h = d["recompute"]["median_ms"], d["hbm"]["median_ms"]
        eq = d["outputs_equal"]
        hb = ms(d["hbm"]) + ("" if hbm_valid(d) else " (not a full hit)")
        ad = f"{a / h:.2f}" if hbm_valid(d) else "n/a"
        out.append(f"| {int(n):,} | {ms(d['recompute'])} | {ms(d['kvtier'])} | "
                   f"{ms(d['vllm_offload'])} | {hb} | {a / b:.2f} | {c / a:.2f} | "
                   f"{ad} | {eq['kvtier']}, {eq['vllm_offload']} |")
    out += ["", "Effective load bandwidth from host memory, GB/s: the history's KV bytes "
            f"({KV_BYTES_PER_TOKEN:,} B/token) over (tier TTFT − HBM-hit TTFT), medians; an "
            "estimate that charges the tier with everything it adds to the turn.", "",
            "| tokens | kvtier | vLLM OffloadingConnector |", "|---|---|---|"]
    for n, d in side["ttft"].items():
        h = d["hbm"]["median_ms"]
        row = []
        for k in ("kvtier", "vllm_offload"):
            extra = d[k]["median_ms"] - h
            row.append(f"{int(n) * KV_BYTES_PER_TOKEN / (extra * 1e-3) / 1e9:.1f}"
                       if extra > 0 and hbm_valid(d) else "n/a")
        out.append(f"| {int(n):,} | {row[0]} | {row[1]} |")
    return out


def itl_section(side: dict) -> list[str]:
    itl = side.get("itl")
    if not itl:
        return ["## Decode ITL while each tier stores", "", "Not measured in this run."]
    s = itl["servers"]
    out = ["## Decode ITL while each tier stores, ms",
           "", f"One streamed greedy generation of {itl['gen_tokens']} tokens per round, "
           f"{itl['rounds']} rounds rotated over the servers, while a second client sends a fresh "
           f"{itl['bg_prompt_tokens']}-token prompt every {itl['bg_interval_s']} s (prefilled, and "
           "stored to host memory by the tiers). Same load on every server.", "",
           "| server | p50 | p90 | p90 ÷ base | gaps | background requests |",
           "|---|---|---|---|---|---|"]
    base = s.get("base", {}).get("p90_ms")
    for k, v in s.items():
        r = f"{v['p90_ms'] / base:.3f}" if base else "n/a"
        out.append(f"| {k} | {v['p50_ms']:.2f} | {v['p90_ms']:.2f} | {r} | {v['gaps']} | "
                   f"{v['background_requests']} |")
    return out


def copy_section(folder: Path) -> list[str]:
    out: list[str] = []
    bc = folder / "bench_copy.json"
    if bc.exists():
        d = json.loads(bc.read_text())
        out += ["## kvtier's copies against pinned cudaMemcpy (bench_copy.py, same call)", "",
                "| tokens | store | load | scattered store | scattered load | pinned d2h GB/s "
                "| pinned h2d GB/s |", "|---|---|---|---|---|---|---|"]
        for c in d["cases"]:
            pd, ph = c["pinned_d2h"]["median_ms"], c["pinned_h2d"]["median_ms"]
            out.append(f"| {c['tokens']:,} | {pd / c['tier_store']['median_ms']:.0%} | "
                       f"{ph / c['tier_load']['median_ms']:.0%} | "
                       f"{pd / c['tier_store_scattered']['median_ms']:.0%} | "
                       f"{ph / c['tier_load_scattered']['median_ms']:.0%} | "
                       f"{c['pinned_d2h']['GBps']:.1f} | {c['pinned_h2d']['GBps']:.1f} |")
        out.append("")
    bs = folder / "bench_scatter.json"
    if bs.exists():
        d = json.loads(bs.read_text())
        out += ["## Scattered-block store at 3k tokens (bench_scatter.py), % of pinned by median "
                "(min–max ms)", "", "| pattern | pinned ms | " + " | ".join(
                    d["patterns"][0]["variants"]) + " |",
                "|---|---|" + "---|" * len(d["patterns"][0]["variants"])]
        for p in d["patterns"]:
            cells = [f"{v['vs_pinned']:.0%} ({min(v['ms']):.1f}–{max(v['ms']):.1f}"
                     f"{'' if v['bytes_equal'] else ', BYTES DIFFER'})"
                     for v in p["variants"].values()]
            out.append(f"| {p['pattern']} | {p['pinned_d2h_ms']:.2f} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def targets(side: dict, folder: Path) -> list[str]:
    t = side["ttft"]
    out = ["## Targets (issue 29)", ""]
    ratios = {n: d["kvtier"]["median_ms"] / d["vllm_offload"]["median_ms"] for n, d in t.items()}
    out.append(f"- kvtier ≤ 1.0× vLLM's OffloadingConnector at every length: "
               f"{verdict(all(r <= 1.0 for r in ratios.values()))} ("
               + ", ".join(f"{int(n):,}: {r:.2f}×" for n, r in ratios.items()) + ")")
    for n, want in (("16000", 3.0), ("32000", 5.0)):
        if n in t:
            for k in ("kvtier", "vllm_offload"):
                r = t[n]["recompute"]["median_ms"] / t[n][k]["median_ms"]
                out.append(f"- {k} vs recompute ≥ {want:.0f}× at {int(n):,}: "
                           f"{verdict(r >= want)} ({r:.2f}×)")
    for n, d in t.items():
        if int(n) >= 16000 and not hbm_valid(d):
            out.append(f"- within 1.5× of the HBM hit at {int(n):,}: **not measured** ((d) "
                       f"{d['hbm']['median_ms']:.1f} ms was not a full HBM hit; see hbm_valid)")
        elif int(n) >= 16000:
            for k in ("kvtier", "vllm_offload"):
                r = d[k]["median_ms"] / d["hbm"]["median_ms"]
                out.append(f"- {k} within 1.5× of the HBM hit at {int(n):,}: "
                           f"{verdict(r <= 1.5)} ({r:.2f}×)")
    itl = side.get("itl", {}).get("servers", {})
    if "base" in itl:
        for k in ("kvtier", "vllm_offload"):
            if k in itl:
                r = itl[k]["p90_ms"] / itl["base"]["p90_ms"]
                out.append(f"- {k}'s stores add ≤ 5% to decode ITL p90: {verdict(r <= 1.05)} "
                           f"({(r - 1) * 100:+.1f}%)")
    bs = folder / "bench_scatter.json"
    if bs.exists():
        for p in json.loads(bs.read_text())["patterns"]:
            v = p["variants"].get("graph")
            if v:
                out.append(f"- scattered-block store at 3k ≥ 80% of pinned by median "
                           f"({p['pattern']}): {verdict(v['vs_pinned'] >= 0.8)} "
                           f"({v['vs_pinned']:.0%})")
    return out


def main() -> None:
    folder = Path(sys.argv[1])
    side = filled(json.loads((folder / "side.json").read_text()))
    lines = [f"# Side by side on one GPU: {card(folder)}", "",
             "Generated by `benchmarks/gpu/side_table.py` from the JSON in this folder "
             "(`side.json`, `bench_copy.json`, `bench_scatter.json`; the device's output in "
             "`device.txt`). vLLM 0.26.0 (CUDA), Llama-3.1-8B shape with dummy weights, one engine "
             "per column set, the same prompts.", ""]
    lines += ttft_section(side) + [""] + itl_section(side) + [""] + copy_section(folder)
    lines += targets(side, folder)
    (folder / "side-by-side.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
