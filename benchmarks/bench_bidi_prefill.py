"""Is a recompute prefill slower in a bidirectional-NIXL stack? Same prompts, several stacks.

For each ``--kv-transfer-config`` file named on the command line (in configs/, without .json)
this starts a 1P1D tiny-model stack. It sends 8 fresh 2,000-token prompts (max_tokens 1,
nothing to reuse) straight to the prefill instance, then 8 more through the router's P/D
flow, one at a time. It prints each request's milliseconds and the median of the last 6 (the
first two warm up)::

    python benchmarks/bench_bidi_prefill.py nixl-unidirectional nixl-bidirectional

Why: in both host-scarce A/B runs (in the git history of benchmarks/AB.md) a prefill that reused nothing
was 2-3x slower at equal length in the stacks that retain on the decode node. This checks
whether bidirectional mode alone costs that on an idle stack.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer

MODEL_DIR = str(Path.home() / ".cache/kvtier/models/tiny")
PROMPT_TOKENS, REQUESTS, WARMUP = 2000, 8, 2


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def timed(c: httpx.Client, url: str, seed0: int) -> list[float]:
    out = []
    for k in range(REQUESTS):
        body = {"model": MODEL_DIR, "prompt": ids(seed0 + k, PROMPT_TOKENS), "max_tokens": 1,
                "temperature": 0}
        t = time.perf_counter()
        c.post(url + "/v1/completions", json=body).raise_for_status()
        out.append(time.perf_counter() - t)
    return out


def measure(config: str) -> dict[str, object]:
    spec = StackSpec(model=MODEL_DIR, prefill=1, decode=1,
                     kv_transfer_config=load_config_file(config))
    logs = Path(tempfile.mkdtemp(prefix=f"bidi-{config}-"))
    with LocalStack(spec, logs) as st, httpx.Client(timeout=120) as c:
        direct = timed(c, st.prefill[0].url, 1000)
        insts = [{"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
                 for i in st.instances]
        cfg = RouterConfig.model_validate({"instances": insts, "port": 0, "log_json": False})
        with RouterServer(cfg) as r:
            pd = timed(c, r.url, 2000)
    ms = lambda xs: [round(x * 1e3) for x in xs]  # noqa: E731
    return {"direct_ms": round(statistics.median(direct[WARMUP:]) * 1e3),
            "pd_ms": round(statistics.median(pd[WARMUP:]) * 1e3),
            "direct_all": ms(direct), "pd_all": ms(pd)}


def main(configs: list[str]) -> None:
    out = {}
    for name in configs:
        out[name] = measure(name)
        print(name, out[name], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:] or ["nixl-unidirectional", "nixl-bidirectional"])
