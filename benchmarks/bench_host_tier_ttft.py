"""E2E TTFT: turn-2 prefill served from a peer's host tier vs recomputed.

Two prefill instances of the ``bench`` model with ``configs/kvtier-peer.json``.
For each of N conversations: turn 1 (a few thousand random tokens, G
generated) on A lands in A's host tier; turn 2 (turn 1's prompt + generated
ids + a short new message) goes to B twice, after B's device cache is reset:

- recompute: a unique ``cache_salt`` (no cache of any kind can serve it);
- peer: ``remote_kv_source`` naming A's tier (B pulls the blocks over NIXL).

TTFT is measured as the latency of a ``max_tokens=1`` request (time to the
first token, no decode). Prints medians and the speedup; target ≥ 3x.

    flock /tmp/kvtier-e2e.lock .venv/bin/python benchmarks/bench_host_tier_ttft.py --tokens 3000

Threading model: a single-threaded script; the stack is stopped at exit.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from kvtier.configs import load_config_file
from kvtier.devstack.models import build_model
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack


def _post(c: httpx.Client, url: str, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = c.post(f"{url}/v1/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000, help="turn-1 prompt tokens")
    ap.add_argument("--generate", type=int, default=64, help="turn-1 generated tokens")
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    model = str(build_model("bench"))
    name = Path(model).name
    spec = StackSpec(model=model, prefill=2, decode=0, max_model_len=8192, kv_cache_gib=2,
                     kv_transfer_config=load_config_file("kvtier-peer"))
    rows = []
    with LocalStack(spec, Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))) as stack, \
            httpx.Client(timeout=600) as c:
        a, b = stack.instances
        for i in range(args.conversations):
            rng = random.Random(i)
            prompt = [rng.randrange(10, 8000) for _ in range(args.tokens)]
            _, t1 = _post(c, a.url, {"model": name, "prompt": prompt, "max_tokens": args.generate,
                                     "temperature": 0, "return_token_ids": True,
                                     "ignore_eos": True})
            gen = t1["choices"][0]["token_ids"]
            turn2 = prompt + gen + [rng.randrange(10, 8000) for _ in range(32)]
            held = (len(prompt) + len(gen) - 1) // 32 * 32
            base = {"model": name, "prompt": turn2, "max_tokens": 1, "temperature": 0,
                    "return_token_ids": True}
            c.post(f"{b.url}/reset_prefix_cache").raise_for_status()
            t_re, r_re = _post(c, b.url, {**base, "cache_salt": uuid.uuid4().hex})
            c.post(f"{b.url}/reset_prefix_cache").raise_for_status()
            src = {"remote_kv_source": {"pod": a.spec.name, "host": "127.0.0.1",
                                        "port": a.spec.tier_p2p_port, "num_tokens": held,
                                        "block_size": 32}}
            t_peer, r_peer = _post(c, b.url, {**base, "kv_transfer_params": src})
            same = r_re["choices"][0]["token_ids"] == r_peer["choices"][0]["token_ids"]
            rows.append({"turn2_tokens": len(turn2), "pulled_tokens": held,
                         "recompute_s": t_re, "peer_s": t_peer, "same_token": same})
            print(f"conv {i}: turn 2 = {len(turn2)} tokens, recompute {t_re * 1e3:.0f} ms, "
                  f"peer host tier {t_peer * 1e3:.0f} ms, same first token: {same}")
    re_ms = statistics.median(r["recompute_s"] for r in rows) * 1e3
    peer_ms = statistics.median(r["peer_s"] for r in rows) * 1e3
    print(f"median TTFT: recompute {re_ms:.0f} ms, from peer host tier {peer_ms:.0f} ms, "
          f"speedup {re_ms / peer_ms:.2f}x (target >= 3x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows,
                                               "median_recompute_ms": re_ms,
                                               "median_peer_ms": peer_ms}, indent=2))


if __name__ == "__main__":
    main()
