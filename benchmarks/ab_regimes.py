"""Collect `kvtier ab` reports of several regimes into one table (for benchmarks/AB.md).

Each argument is ``NAME=DIR`` where DIR holds a ``report.json`` written by ``kvtier ab``.
Prints, per regime: each strategy's median TTFT, reuse rate and device block-seconds, and
the A/B targets (``kvtier.ab.targets``) evaluated from that regime's records.

    .venv/bin/python benchmarks/ab_regimes.py main=/tmp/ab2 short=/tmp/ab-short-waits \\
        long=/tmp/ab-long-waits small=/tmp/ab-small-deltas

Threading model: a single-threaded script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from kvtier.ab.records import RunResult
from kvtier.ab.targets import evaluate, markdown


def load(d: Path) -> tuple[dict, list[RunResult]]:
    doc = json.loads((d / "report.json").read_text())
    return doc["meta"], msgspec.convert(doc["results"], list[RunResult])


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for arg in argv:
        name, _, d = arg.partition("=")
        meta, results = load(Path(d))
        env = meta.get("environment", {})
        print(f"\n### {name}: {meta.get('trace')} (time scale {meta.get('time_scale')}, "
              f"commit {str(env.get('git_commit', '?'))[:10]})\n")
        print("| strategy | TTFT p50 ms | TTFT longest ms | reuse rate | device block·s | "
              "host GB·s | errors |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            s = r.summary()
            print(f"| {r.strategy} | {s['ttft_p50_s'] * 1e3:.0f} | {s['ttft_longest_s'] * 1e3:.0f} "
                  f"| {s['reuse_rate']:.1%} | {s['device_block_s']:,.0f} | {s['host_gb_s']:.3g} "
                  f"| {s['errors']} |")
        print()
        print(markdown(evaluate(results)))
        if meta.get("adaptive"):
            for k, a in meta["adaptive"].items():
                print(f"\n{k}: TTL {a.get('decode_ttl_s')} s; {a.get('ttl_choice', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
