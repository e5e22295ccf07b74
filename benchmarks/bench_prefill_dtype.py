"""Prefill speed of one vLLM-CPU instance per serving dtype, side by side.

Starts one instance of a model (default: the ``bench`` preset) per dtype, one
after the other, each pinned to one core with its prefix cache off, and times
``max_tokens=1`` completions of random prompts at several lengths, interleaved
over repeats. Prints the median seconds and tokens/s per (dtype, length) and
the ratio to the first dtype. This is what picks the dtype the A/B harness
serves the bench model in.

    flock /tmp/kvtier-e2e.lock .venv/bin/python benchmarks/bench_prefill_dtype.py \
        --dtypes float16,float32 --lengths 512,2048,4000

Threading model: a single-threaded script; each stack is stopped before the next.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from kvtier.configs import load_config_file
from kvtier.devstack.models import build_model
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack


def _time_prefill(c: httpx.Client, url: str, model: str, n: int, rng: random.Random,
                  vocab: int) -> float:
    prompt = [rng.randrange(10, vocab) for _ in range(n)]
    t0 = time.perf_counter()
    r = c.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt,
                                              "max_tokens": 1, "temperature": 0})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--lengths", default="512,2048,4000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4608)
    ap.add_argument("--kv-config", default=None,
                    help="configs/ name to pass as --kv-transfer-config (default: none)")
    ap.add_argument("--extra", default="",
                    help="JSON object merged into the kv config's kv_connector_extra_config")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args()
    model = str(build_model(args.model)) if args.model in ("tiny", "bench") else args.model
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    lengths = [int(x) for x in args.lengths.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    results: dict[str, dict[int, list[float]]] = {}
    for dt in dtypes:
        kv = None
        if args.kv_config:
            kv = load_config_file(args.kv_config)
            kv.setdefault("kv_connector_extra_config", {}).update(json.loads(args.extra or "{}"))
        spec = StackSpec(model=model, prefill=1, decode=0, max_model_len=args.max_model_len,
                         kv_transfer_config=kv,
                         extra_args=("--dtype", dt, "--no-enable-prefix-caching"))
        with tempfile.TemporaryDirectory() as logs, LocalStack(spec, Path(logs)) as st, \
                httpx.Client(timeout=600) as c:
            url = st.instances[0].url
            rng = random.Random(0)
            _time_prefill(c, url, Path(model).name, 64, rng, vocab)  # warm-up
            per = results.setdefault(dt, {n: [] for n in lengths})
            for _ in range(args.repeats):
                for n in lengths:
                    per[n].append(_time_prefill(c, url, Path(model).name, n, rng, vocab))
    base = dtypes[0]
    print(f"{'dtype':>9} {'tokens':>7} {'median s':>9} {'tok/s':>8} {'vs ' + base:>10}")
    table = []
    for dt in dtypes:
        for n in lengths:
            m = statistics.median(results[dt][n])
            ratio = statistics.median(results[base][n]) / m
            table.append({"dtype": dt, "tokens": n, "median_s": m, "tok_per_s": n / m,
                          "speedup_vs_" + base: ratio, "samples_s": results[dt][n]})
            print(f"{dt:>9} {n:>7} {m:>9.3f} {n / m:>8.0f} {ratio:>9.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
