"""The pressure regimes of `kvtier ab`: generate their files, and tabulate their reports.

    # write benchmarks/traces/regime-{decode-scarce,host-scarce,mixed-waits}.jsonl
    .venv/bin/python benchmarks/ab_regimes.py gen [--out-dir benchmarks/traces]

    # one table per regime (for benchmarks/AB.md) from `kvtier ab` output directories
    .venv/bin/python benchmarks/ab_regimes.py table decode=/tmp/ab-dec host=/tmp/ab-host ...

A regime file is a trace whose header line carries the stack settings that put it under
pressure (`kvtier.ab.regimes.RegimeSettings`); `kvtier ab --trace FILE` applies them (a flag
on the command line wins). Generation is deterministic (fixed seeds): `gen` rewrites the same
bytes. Every trace uses vocabulary 4096 and stays under 3,000 tokens of context, so it runs on
the tiny and the bench model alike (but for the GPU run's file, below); the regimes' pressure
is in the settings:

- **decode-scarce**: 8 conversations at once, short waits (median 3 s); the decode node has
  160 blocks of KV (5,120 tokens at block size 32: `--num-gpu-blocks-override` on decode
  only) against ~8 x 2.5k tokens of live context, so blocks retained for waiting turns
  compete with running requests (queueing, preemption); device TTL 60 s.
- **host-scarce**: 6 conversations, waits of ~20 s (median) against a 30 s device TTL; each
  instance's host tier holds 25% of the trace's KV working set, so host copies are evicted
  before their turn comes back.
- **mixed-waits**: long-tailed waits (lognormal, median 6 s, sigma 1.8, cap 900 s; as drawn:
  p10 0.8 s, median 13 s, p90 49 s, longest 136 s), so neither a fixed TTL nor "host only" is
  right for every conversation. Real seconds at time scale 1 (~3.5 min of trace); a CI-sized
  run uses `--time-scale 0.05`.
- **gpu-8b-16k** (issue 29's GPU A/B): 1P1D on the one lent GPU, the 8B shape with dummy
  weights, 3 conversations at once of 4 turns growing from ~4k to ~16k tokens of context,
  tool waits of ~2 s; every instance's KV cache fixed at 8 GiB (`--kv-cache-memory-bytes`,
  so both start at once) and the decode node's capped at 3,072 blocks (49k tokens at block
  size 16) against 3 x 16k of live and retained context, so retained turns compete with
  running decodes; eager mode (no CUDA graphs: starts in seconds, decode slower).
- **gpu-h200-8b-short** (not a pressure regime): the short `kvtier ab` of the lent H200, two
  vLLM instances on its one GPU, the 8B shape with dummy weights, contexts of 4k-12k tokens
  (`benchmarks/gpu/device.sh` with `BENCH=ab`).

Threading model: a single-threaded script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from kvtier.ab.rawdoc import read_raw
from kvtier.ab.records import RunResult
from kvtier.ab.regimes import RegimeSettings, save_regime
from kvtier.ab.traces import LengthDist, SyntheticTraceConfig, WaitDist, synthetic

REGIMES: dict[str, tuple[SyntheticTraceConfig, RegimeSettings]] = {
    "regime-decode-scarce": (
        SyntheticTraceConfig(
            name="regime-decode-scarce", conversations=8, turns=6,
            first_prompt_tokens=LengthDist(mean=1024, spread=0.2),
            tool_output_tokens=LengthDist(mean=256, spread=0.4),
            response_tokens=LengthDist(mean=32, spread=0.5),
            wait=WaitDist(kind="lognormal", median_s=3.0, sigma=0.5, max_s=20.0),
            concurrency=8, stagger_s=0.5, seed=18, max_context_tokens=3000),
        RegimeSettings(
            description="decode memory scarce: 8 concurrent conversations, decode KV capped at "
                        "160 blocks, retained turns compete with running requests",
            max_model_len=4096, decode_num_blocks=160, decode_ttl_s=60.0, time_scale=1.0,
            slo_ttft_p90_s=5.0)),
    "regime-host-scarce": (
        SyntheticTraceConfig(
            name="regime-host-scarce", conversations=6, turns=6,
            first_prompt_tokens=LengthDist(mean=1024, spread=0.2),
            tool_output_tokens=LengthDist(mean=300, spread=0.4),
            response_tokens=LengthDist(mean=32, spread=0.5),
            wait=WaitDist(kind="lognormal", median_s=20.0, sigma=0.6, max_s=120.0),
            concurrency=3, stagger_s=1.0, wave_interval_s=15.0, seed=19,
            max_context_tokens=3000),
        RegimeSettings(
            description="host memory scarce: each host tier holds 25% of the KV working set; "
                        "waits (~20 s) outlive a 30 s device TTL in the tail",
            max_model_len=4096, host_fraction=0.25, decode_ttl_s=30.0, time_scale=1.0,
            slo_ttft_p90_s=5.0)),
    "regime-mixed-waits": (
        SyntheticTraceConfig(
            name="regime-mixed-waits", conversations=6, turns=8,
            first_prompt_tokens=LengthDist(mean=768, spread=0.2),
            tool_output_tokens=LengthDist(mean=200, spread=0.4),
            response_tokens=LengthDist(mean=32, spread=0.5),
            wait=WaitDist(kind="lognormal", median_s=6.0, sigma=1.8, max_s=900.0),
            concurrency=3, stagger_s=1.0, wave_interval_s=10.0, seed=20,
            max_context_tokens=3000),
        RegimeSettings(
            description="mixed waits: lognormal tool waits, median 6 s, sigma 1.8, cap 900 s "
                        "(seconds to minutes); use --time-scale 0.05 for a CI-sized run",
            max_model_len=4096, time_scale=1.0, slo_ttft_p90_s=5.0)),
    # Issue 29's GPU A/B (benchmarks/gpu/device.sh BENCH=ab AB_TRACE=gpu-8b-16k).
    "gpu-8b-16k": (
        SyntheticTraceConfig(
            name="gpu-8b-16k", conversations=3, turns=4,
            first_prompt_tokens=LengthDist(mean=4096, spread=0.1),
            tool_output_tokens=LengthDist(mean=4150, spread=0.1),
            response_tokens=LengthDist(mean=64, spread=0.3),
            wait=WaitDist(kind="lognormal", median_s=2.0, sigma=0.5, max_s=10.0),
            concurrency=3, stagger_s=0.5, seed=22, max_context_tokens=18000),
        RegimeSettings(
            description="one GPU, 1P1D sharing it: the 8B shape with dummy weights, contexts "
                        "of ~4k-16k tokens, decode KV capped at 3,072 blocks of 16 (49k "
                        "tokens) against 3 conversations of up to 16k; every P/D move runs "
                        "over NIXL between two processes on the one GPU (outside TTFT "
                        "except D->P reads; D->P reads at 0.06 GB/s with UCX's defaults, "
                        "16 GB/s with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on: the report's link "
                        "section gives the run's own)",
            max_model_len=20480, host_mib=16384, decode_ttl_s=60.0, time_scale=1.0,
            decode_num_blocks=3072,
            extra_args=("--load-format", "dummy", "--gpu-memory-utilization", "0.3",
                        "--kv-cache-memory-bytes", "8589934592", "--enforce-eager"),
            slo_ttft_p90_s=2.0)),
    # Not a pressure regime: the short GPU run of the H200 (benchmarks/gpu/device.sh BENCH=ab).
    # Two instances share the one GPU (40% of its memory each), the Llama-3.1-8B shape with
    # dummy weights (benchmarks/gpu/model), contexts of 4k-12k tokens.
    "gpu-h200-8b-short": (
        SyntheticTraceConfig(
            name="gpu-h200-8b-short", conversations=4, turns=4,
            first_prompt_tokens=LengthDist(mean=4096, spread=0.2),
            tool_output_tokens=LengthDist(mean=1024, spread=0.4),
            response_tokens=LengthDist(mean=64, spread=0.5),
            wait=WaitDist(kind="lognormal", median_s=2.0, sigma=0.5, max_s=10.0),
            concurrency=2, stagger_s=0.5, seed=21, max_context_tokens=12000),
        RegimeSettings(
            description="H200, one GPU, two vLLM instances (1P1D) sharing it: the 8B shape with "
                        "dummy weights; the P->D move runs over the in-machine NIXL link "
                        "(~0.5 GB/s VRAM->VRAM between processes) and is outside TTFT",
            max_model_len=16384, host_mib=16384, decode_ttl_s=60.0, time_scale=1.0,
            extra_args=("--load-format", "dummy", "--gpu-memory-utilization", "0.4",
                        "--enforce-eager"),
            slo_ttft_p90_s=2.0)),
}


def gen(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (cfg, settings) in REGIMES.items():
        path = out_dir / f"{name}.jsonl"
        save_regime(synthetic(cfg), settings, path)
        paths.append(path)
    return paths


def load(d: Path) -> tuple[dict, list[RunResult]]:
    doc = read_raw(d)
    return doc["meta"], msgspec.convert(doc["results"], list[RunResult])


def table(args: list[str]) -> None:
    """The regime tables, as `kvtier ab-report --all` renders them (`regime-table.md`)."""
    from kvtier.ab.live.regen import load_run, regime_table

    for arg in args:
        name, _, d = arg.partition("=")
        print("\n" + regime_table(name, load_run(Path(d))))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    g = sub.add_parser("gen", help="write the regime files")
    g.add_argument("--out-dir", default=str(Path(__file__).parent / "traces"))
    t = sub.add_parser("table", help="tabulate kvtier ab reports: NAME=DIR ...")
    t.add_argument("runs", nargs="+")
    # the old form, `ab_regimes.py NAME=DIR ...`, still tabulates
    if argv and "=" in argv[0]:
        argv = ["table", *argv]
    a = ap.parse_args(argv)
    if a.cmd == "gen":
        for p in gen(Path(a.out_dir)):
            print(p)
        return 0
    if a.cmd == "table":
        table(a.runs)
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
