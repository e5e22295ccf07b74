"""One engine's prefill latency under each A/B strategy's ``--kv-transfer-config``.

Why: in the host-scarce A/B, turns that took the same path under ``tiered-adaptive`` and
``device-ttl`` were 1.15x slower under ``tiered-adaptive`` (its router's log: the prefill leg
itself took longer), and in mixed waits it stayed 1.035x of ``host-p2p``. This takes the
router, the decode node and the KV moves out: one prefill instance of the tiny model per
strategy (``StrategySpec.kv_transfer_config``, the MultiConnector the A/B deploys), the same
unique prompts (``cache_salt``: nothing is reused), ``max_tokens=1``; strategies in turn,
``--rounds`` times, so a slow spell of the machine does not fall on one strategy only.

    .venv/bin/python benchmarks/bench_engine_overhead.py \
        --strategies device-ttl,tiered,tiered-adaptive,host-p2p --rounds 3 \
        --json benchmarks/engine_overhead/RUN.json

Prints each round's median and each strategy's median over all rounds. A run's JSON as the
README's Markdown table (each strategy's median over all rounds, then per round)::

    .venv/bin/python benchmarks/bench_engine_overhead.py --table benchmarks/engine_overhead/RUN.json

Threading model: a single-threaded script; each stack is stopped before the next starts.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from kvtier.ab.strategies import parse_list
from kvtier.devstack.models import build_model
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="recompute,host-p2p,device-ttl,tiered-adaptive")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=40, help="per engine start (5 warm-up)")
    ap.add_argument("--tokens", type=int, default=1500, help="prompt tokens")
    ap.add_argument("--json", help="write the raw latencies here")
    ap.add_argument("--table", metavar="JSON", help="print a run's JSON as a Markdown table")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    specs = parse_list(args.strategies)
    model = str(build_model("tiny"))
    name = Path(model).name
    rounds: list[dict] = []
    for rnd in range(args.rounds):
        for strat in specs:
            spec = StackSpec(model=model, prefill=1, decode=0, max_model_len=4096,
                             kv_transfer_config=strat.kv_transfer_config())
            with LocalStack(spec, Path(tempfile.mkdtemp(prefix="kvtier-ovh-"))) as stack, \
                    httpx.Client(timeout=600) as c:
                (a,) = stack.instances
                ts = []
                for i in range(args.requests):
                    rng = random.Random(i)
                    prompt = [rng.randrange(10, 4000) for _ in range(args.tokens)]
                    body = {"model": name, "prompt": prompt, "max_tokens": 1,
                            "temperature": 0, "cache_salt": uuid.uuid4().hex}
                    t0 = time.perf_counter()
                    c.post(f"{a.url}/v1/completions", json=body).raise_for_status()
                    ts.append(time.perf_counter() - t0)
            ts = ts[5:]
            rounds.append({"round": rnd, "strategy": strat.name, "latency_s": ts})
            print(f"round {rnd} {strat.name}: median {statistics.median(ts) * 1e3:.1f} ms",
                  flush=True)
    overall = {s.name: statistics.median(x for r in rounds if r["strategy"] == s.name
                                         for x in r["latency_s"]) for s in specs}
    for k, v in overall.items():
        print(f"{k}: median {v * 1e3:.1f} ms over {args.rounds} rounds")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "machine": platform.platform(), "rounds": rounds,
            "median_s": overall}, indent=1))


def table(doc: dict) -> str:
    """A run's JSON (``--json``) as Markdown: median ms over all rounds, then per round."""
    names = list(doc["median_s"])
    lines = ["| strategy | median ms, all rounds | per round |", "|---|---|---|"]
    for n in names:
        per = [statistics.median(r["latency_s"]) * 1e3 for r in doc["rounds"]
               if r["strategy"] == n]
        lines.append(f"| {n} | {doc['median_s'][n] * 1e3:.1f} | "
                     + ", ".join(f"{x:.1f}" for x in per) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
