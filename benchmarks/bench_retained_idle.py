"""What a decode node that only retains turns costs the prefill beside it, with and without
``retained_idle_step_ms`` (``kvtier.connectors.params_feed``, "Idle steps").

While a decode node retains a finished turn's blocks, vLLM's engine keeps stepping about
every millisecond even when a step schedules nothing (a scheduler pass, a call into the
worker, a stats message to the API server). For each value of the knob this starts a 1P1D
tiny-model stack (``nixl-bidirectional-lease`` with the knob set), then:

1. sends ``REQUESTS`` fresh 2,000-token prompts straight to the prefill (max_tokens 1,
   nothing to reuse), one at a time, while the decode node retains nothing;
2. makes the decode node retain ``HELD`` turns (hand-rolled P->D exchanges, 60 s leases) and
   samples the CPU of every thread of the decode node's processes for ``SAMPLE_S`` seconds
   (``thread_cpu.threads``: ``utime + stime`` from /proc, by thread name and nice level:
   NIXL's progress thread spins at nice 10 whatever happens, the engine's steps at nice 0);
3. sends ``REQUESTS`` more fresh prompts to the prefill while those turns are retained.

It prints one JSON object (``--out FILE`` writes it too): per knob value the prefill's
milliseconds (each request, and the median after ``WARMUP``) without and with retained
turns, and the decode node's CPU share per thread group over the sample::

    .venv/bin/python benchmarks/bench_retained_idle.py --out benchmarks/retained-idle.json

Run it on an otherwise idle machine; the figures are medians of one run, not a verdict.
Linux only.

Threading model: a single-threaded script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from thread_cpu import threads

from kvtier.configs import load_config_file
from kvtier.devstack.placement import descendants
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack
from kvtier.transfer_params import KVTransferParams
from kvtier.wire.leases import PARAM_KEY

MODEL_DIR = str(Path.home() / ".cache/kvtier/models/tiny")
PROMPT_TOKENS, REQUESTS, WARMUP, HELD, SAMPLE_S = 2000, 12, 2, 4, 8.0


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def complete(c: httpx.Client, url: str, prompt: list[int], max_tokens: int,
             params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_DIR, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    r = c.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def prefills(c: httpx.Client, url: str, seed0: int) -> list[float]:
    out = []
    for k in range(REQUESTS):
        t = time.perf_counter()
        complete(c, url, ids(seed0 + k, PROMPT_TOKENS), 1)
        out.append(time.perf_counter() - t)
    return out


def decode_cpu(root: int) -> dict[str, float]:
    """Share of one core each (thread name, nice) group of the decode node used."""
    pids = [root, *descendants(root)]
    a = {p: threads(p) for p in pids}
    time.sleep(SAMPLE_S)
    groups: dict[str, float] = {}
    for p in pids:
        before = a[p]
        for t, (name, nice, cpu) in threads(p).items():
            used = (cpu - before.get(t, (name, nice, cpu))[2]) / SAMPLE_S
            key = f"{name} (nice {nice})"
            groups[key] = round(groups.get(key, 0.0) + used, 3)
    groups["total nice 0"] = round(sum(v for k, v in groups.items() if k.endswith("(nice 0)")), 3)
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def measure(idle_ms: float) -> dict[str, Any]:
    cfg = load_config_file("nixl-bidirectional-lease")
    cfg["kv_connector_extra_config"] = {**cfg["kv_connector_extra_config"],
                                        "retained_idle_step_ms": idle_ms}
    spec = StackSpec(model=MODEL_DIR, prefill=1, decode=1, kv_transfer_config=cfg)
    logs = Path(tempfile.mkdtemp(prefix=f"retained-idle-{idle_ms}-"))
    with LocalStack(spec, logs) as st, httpx.Client(timeout=120) as c:
        p_url, d_url = st.prefill[0].url, st.decode[0].url
        free = prefills(c, p_url, 1000)
        for k in range(HELD):
            prompt = ids(5000 + k, PROMPT_TOKENS)
            pre = complete(c, p_url, prompt, 1, KVTransferParams.prefill_request().to_wire())
            complete(c, d_url, prompt, 8, {**pre["kv_transfer_params"], PARAM_KEY: 60.0})
        cpu = decode_cpu(st.decode[0].proc.pid)
        held = prefills(c, p_url, 3000)
    ms = lambda xs: [round(x * 1e3, 1) for x in xs]  # noqa: E731
    return {"retained_idle_step_ms": idle_ms,
            "prefill_ms_median_nothing_retained": round(statistics.median(free[WARMUP:]) * 1e3, 1),
            "prefill_ms_median_turns_retained": round(statistics.median(held[WARMUP:]) * 1e3, 1),
            "prefill_ms_nothing_retained": ms(free), "prefill_ms_turns_retained": ms(held),
            "decode_cpu_share_while_retaining": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", default="0,5", help="retained_idle_step_ms values (ms)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = []
    for v in (float(x) for x in args.values.split(",")):
        runs.append(measure(v))
        print(json.dumps({k: v for k, v in runs[-1].items() if "median" in k or "cpu" in k}),
              flush=True)
    doc = {"prompt_tokens": PROMPT_TOKENS, "requests": REQUESTS, "warmup": WARMUP,
           "turns_retained": HELD, "sample_s": SAMPLE_S, "cores": os.cpu_count(),
           "git_commit": os.environ.get("KVTIER_GIT_COMMIT"), "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
