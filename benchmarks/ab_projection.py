"""Issue 30's GPU projection: can tiered-adaptive beat every fixed strategy on a GPU?

Simulated, not measured. ``kvtier ab --simulate`` (the same decisions as the live router:
``kvtier.cost.learned``) on GPU-scale traces (the 8B shape, contexts of ~4k to ~17k tokens,
long-tailed tool waits) under two cost models of an H200:

- ``efa``: ``configs/cost-h200-8b.json`` (prefill and host reads fitted on the lent H200; the
  D->P and peer links taken from the seed's EFA transfer times: a device read costs about
  what a host read does);
- ``nvlink``: the same with the D->P read (and the P->D move) over NVLink inside one node,
  2 ms setup and 300 GB/s (``configs/cost-h200-8b-nvlink-projection.json``; not measured:
  the lent GPUs are single cards).

Each regime varies the decode node's KV blocks (how much a held turn costs running
decodes), the conversations at once, the waits (lognormal median and sigma, against a 60 s
device TTL) and each host tier's share of the KV working set::

    .venv/bin/python benchmarks/ab_projection.py run  [--out benchmarks/ab/DIR]
    .venv/bin/python benchmarks/ab_projection.py table benchmarks/ab/DIR   # projection.md

``run`` writes one ``kvtier ab --simulate`` output folder per regime and cost model (its
``report.json.gz`` is the raw result) and then the table; ``table`` regenerates the table from
those folders alone. Every row is printed, whatever it says.

Threading model: a single-threaded script.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import msgspec

from kvtier.ab.compare import paired_ttft, strategy_intervals
from kvtier.ab.rawdoc import has_raw, read_raw
from kvtier.ab.records import RunResult
from kvtier.ab.regimes import RegimeSettings, save_regime
from kvtier.ab.traces import LengthDist, SyntheticTraceConfig, WaitDist, synthetic

ROOT = Path(__file__).resolve().parents[1]
COSTS = {"efa": "configs/cost-h200-8b.json",
         "nvlink": "configs/cost-h200-8b-nvlink-projection.json"}
FIXED = ("recompute", "device-ttl", "host-p2p")
STRATEGIES = ",".join((*FIXED, "tiered-adaptive"))
# (decode KV blocks of 16 tokens, conversations at once, wait median s, wait sigma, host share)
REGIMES = ((3072, 8, 3.0, 1.2, 0.25), (4096, 12, 8.0, 1.5, 0.5), (8192, 8, 10.0, 2.0, 0.5),
           (16384, 8, 20.0, 1.5, 0.5), (16384, 8, 20.0, 1.5, 1.0))


def regime_name(r: tuple) -> str:
    blocks, conc, med, sigma, host = r
    return f"gpu-8b-mixed-d{blocks}-c{conc}-w{med:g}s{sigma:g}-h{host:g}"


def write_trace(r: tuple, path: Path) -> None:
    blocks, conc, med, sigma, host = r
    cfg = SyntheticTraceConfig(
        name=regime_name(r), conversations=conc + 4, turns=5,
        first_prompt_tokens=LengthDist(mean=4096, spread=0.1),
        tool_output_tokens=LengthDist(mean=2800, spread=0.4),
        response_tokens=LengthDist(mean=128, spread=0.3),
        wait=WaitDist(kind="lognormal", median_s=med, sigma=sigma, max_s=600.0),
        concurrency=conc, stagger_s=0.5, seed=23, max_context_tokens=18000)
    settings = RegimeSettings(
        description=f"projection: decode KV {blocks} blocks of 16, {conc} conversations at "
                    f"once, waits lognormal median {med:g} s sigma {sigma:g} (cap 600 s) "
                    f"against a 60 s device TTL, host tiers {host:.0%} of the working set",
        max_model_len=20480, host_fraction=host, decode_ttl_s=60.0, time_scale=1.0,
        decode_num_blocks=blocks, slo_ttft_p90_s=2.0)
    save_regime(synthetic(cfg), settings, path)


def run(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for r in REGIMES:
        trace = out / f"{regime_name(r)}.jsonl"
        write_trace(r, trace)
        for link, cost in COSTS.items():
            d = out / f"{regime_name(r)}-{link}"
            cmd = [sys.executable, "-m", "kvtier.cli", "ab", "--simulate", "--trace", str(trace),
                   "--model", str(ROOT / "benchmarks/gpu/model"), "--cost", str(ROOT / cost),
                   "--strategies", STRATEGIES, "--repeats", "3", "--block-size", "16",
                   "--no-progress", "--out", str(d)]
            print(" ".join(cmd[2:]), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    (out / "projection.md").write_text(table(out))


def _load(d: Path) -> list[RunResult]:
    doc = read_raw(d)
    return msgspec.convert(doc["results"], list[RunResult])


def table(out: Path) -> str:
    rows = ["| regime | link | p50 TTFT ms: recompute / device-ttl / host-p2p / tiered-adaptive "
            "| turns/min, same order | tiered-adaptive ÷ each fixed, paired median TTFT [95% CI] "
            "| beats every fixed one on TTFT? | its turns/min ÷ the best fixed one's |",
            "|---|---|---|---|---|---|---|"]
    for r in REGIMES:
        for link in COSTS:
            d = out / f"{regime_name(r)}-{link}"
            if not has_raw(d):
                rows.append(f"| {regime_name(r)} | {link} | not run | | | | |")
                continue
            res = {x.strategy: x for x in _load(d)}
            s = {k: strategy_intervals(v) for k, v in res.items()}
            order = (*FIXED, "tiered-adaptive")
            p50 = " / ".join(f"{s[k].ttft_p50.point * 1e3:.0f}" for k in order)
            tpm = " / ".join(f"{s[k].turns_per_min.point:.1f}" for k in order)
            ratios, faster = [], True
            for k in FIXED:
                p = paired_ttft(res["tiered-adaptive"], res[k]).ratio
                ratios.append(f"{k} {p.point:.3f} [{p.lo:.3f}, {p.hi:.3f}]")
                faster = faster and p.hi < 1.0
            best = max(s[k].turns_per_min.point for k in FIXED)
            rows.append(f"| {regime_name(r)} | {link} | {p50} | {tpm} | {'; '.join(ratios)} | "
                        f"{'yes' if faster else 'no'} | "
                        f"{s['tiered-adaptive'].turns_per_min.point / best:.3f} |")
    return "\n".join([
        "<!-- generated: benchmarks/ab_projection.py table (simulated, not measured) -->",
        "Simulated (`kvtier ab --simulate`, 3 repeats), **a projection, not a measurement**. "
        "TTFT verdict: the paired-median ratio's 95% interval wholly below 1.0 against each "
        "fixed strategy. Turns/min: the repeats of a deterministic simulation agree, so "
        "there is no interval and no verdict, only the ratio of point estimates.", "", *rows, ""])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default=str(ROOT / "benchmarks/ab/2026-12-07-projection-gpu-mixed-pressure-price"))
    t = sub.add_parser("table")
    t.add_argument("out")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        run(Path(a.out))
    else:
        print(table(Path(a.out)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
