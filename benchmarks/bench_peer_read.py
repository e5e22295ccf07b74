"""Peer read cost on the local CPU stack: turn 2 pulled from a busy peer's host tier.

Why: in the decode-scarce A/B, tiered-adaptive's turns that read the decode node's host copy
were a few percent slower than device-ttl's reads of the retained device copy (AB.md). A peer
read is synchronous in the reader's scheduler and makes ZMQ round trips to the source's
``PeerServer`` thread, which shares its process (and the GIL) with a busy engine; a device
read is one-sided NIXL. This script times that path on its own.

It starts two kvtier-peer instances (``configs/kvtier-peer.json``). Per context length and
repeat: turn 1 on A (stored in A's host tier), then, while A decodes another request, turn
2 on B two ways, side by side: pulling the history from A's host tier (``remote_kv_source``)
and recomputing it (B's prefix cache and host tier hold nothing of it). Reports medians and
the ratio pull/recompute.

    .venv/bin/python benchmarks/bench_peer_read.py [--model tiny] [--ctx 1024,2048] [--reps 15]
        [--a-busy 400] [--out benchmarks/peer_read/RUN.json]
    .venv/bin/python benchmarks/bench_peer_read.py --table benchmarks/peer_read/table.md RUN.json...
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvtier.configs import load_config_file
from kvtier.devstack.models import build_model
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack
from kvtier.tier.accounting import PEER_PHASES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_dp_read import BusyDecode, ids
from tests.e2e.pd import complete, metric, reset_prefix_cache

BS = 32  # the kvtier-peer config's block size


def run(model: Path, ctxs: list[int], reps: int, a_busy: int, log_dir: Path,
        rows: list[dict]) -> None:
    spec = StackSpec(model=str(model), prefill=2, decode=0,
                     kv_transfer_config=load_config_file("kvtier-peer"), max_model_len=4096)
    name = model.name
    with LocalStack(spec, log_dir) as st, httpx.Client(timeout=180) as c:
        a, b = st.instances[0], st.instances[1]
        tier_b = f"http://127.0.0.1:{b.spec.tier_metrics_port}"
        for u in (a.url, b.url):
            complete(c, u, name, ids(0, 64), 1)  # warm up
        for ctx in ctxs:
            for rep in range(reps):
                first = ids(1000 * ctx + rep, ctx)
                out = complete(c, a.url, name, first, 32)["choices"][0]["token_ids"]
                held = (len(first) + len(out) - 1) // BS * BS
                second = first + out + ids(7 + rep, 64)
                src = {"remote_kv_source": {"pod": a.spec.name, "host": "127.0.0.1",
                                            "port": a.spec.tier_p2p_port, "num_tokens": held,
                                            "block_size": BS}}
                h0 = metric(c, b.url, "vllm:external_prefix_cache_hits_total")
                p0 = phases(c, tier_b)
                with BusyDecode.maybe(a.url, name, a_busy):
                    t0 = time.perf_counter()
                    complete(c, b.url, name, second, 1, src)
                    t_pull = time.perf_counter() - t0
                pulled = metric(c, b.url, "vllm:external_prefix_cache_hits_total") - h0
                fetch = {k: v - p0[k] for k, v in phases(c, tier_b).items()}
                if pulled < held:
                    raise SystemExit(f"ctx {ctx} rep {rep}: pulled {pulled:.0f} of {held} tokens")
                # the same turn recomputed on B: a different salt misses B's cache and tier
                with BusyDecode.maybe(a.url, name, a_busy):
                    t0 = time.perf_counter()
                    c.post(f"{b.url}/v1/completions", json={
                        "model": name, "prompt": second, "max_tokens": 1, "temperature": 0,
                        "cache_salt": f"recompute-{ctx}-{rep}"}).raise_for_status()
                    t_comp = time.perf_counter() - t0
                reset_prefix_cache(c, b.url)
                rows.append({"ctx": ctx, "rep": rep, "pull_s": t_pull, "recompute_s": t_comp,
                             "pulled_tokens": pulled, "fetch_s": fetch})
                print(f"  ctx {ctx} rep {rep}: pull {t_pull * 1e3:.1f} ms ({pulled:.0f} tok; "
                      + " ".join(f"{k} {v * 1e3:.2f}" for k, v in fetch.items())
                      + f" ms) recompute {t_comp * 1e3:.1f} ms", flush=True)


def phases(c: httpx.Client, tier_url: str) -> dict[str, float]:
    """B's seconds in peer fetches so far, by phase (``kvtier_tier_peer_fetch_seconds``)."""
    return {p: metric(c, tier_url, "kvtier_tier_peer_fetch_seconds_total", phase=p)
            for p in PEER_PHASES}


def summarize(rows: list[dict]) -> str:
    cols = " | ".join(f"{p} p50 ms" for p in PEER_PHASES)
    lines = [f"| ctx | reps | pull p50 ms | recompute p50 ms | pull/recompute p50 (paired) | "
             f"{cols} |", "|---|---|---|---|---|" + "---|" * len(PEER_PHASES)]
    for ctx in sorted({r["ctx"] for r in rows}):
        xs = [r for r in rows if r["ctx"] == ctx]
        pl = statistics.median(r["pull_s"] for r in xs) * 1e3
        rc = statistics.median(r["recompute_s"] for r in xs) * 1e3
        ratio = statistics.median(r["pull_s"] / r["recompute_s"] for r in xs)
        ph = " | ".join(f"{statistics.median(r['fetch_s'][p] for r in xs) * 1e3:.2f}"
                        if all("fetch_s" in r for r in xs) else "not recorded"
                        for p in PEER_PHASES)
        lines.append(f"| {ctx} | {len(xs)} | {pl:.1f} | {rc:.1f} | {ratio:.3f} | {ph} |")
    return "\n".join(lines)


def write_table(out: Path, runs: list[Path]) -> None:
    """Write ``out``: each raw JSON's command, commit and table, regenerated from its rows."""
    parts = ["# Peer read on the CPU stack (`benchmarks/bench_peer_read.py`)", "",
             f"Regenerated by `bench_peer_read.py --table {out} "
             + " ".join(str(r) for r in runs) + "`.", ""]
    for r in runs:
        d = json.loads(r.read_text())
        parts += [f"## {r.name}", "", f"- command: `{d['command']}`",
                  f"- commit: `{d['commit']}`, machine: {d['machine']}, A busy: {d['a_busy']} "
                  f"tokens" + (f", error: {d['error']}" if d.get("error") else ""), "",
                  summarize(d["rows"]), ""]
    out.write_text("\n".join(parts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, nargs="+", metavar=("OUT", "RUN"),
                    help="only write OUT (Markdown) from the raw JSON of each RUN")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--ctx", default="1024,2048")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--a-busy", type=int, default=400, metavar="TOKENS",
                    help="keep A decoding a request of this many tokens during each timed turn "
                         "2 (pull and recompute alike); 0: A idle")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.table:
        if len(args.table) < 2:
            ap.error("--table OUT RUN [RUN ...]")
        write_table(args.table[0], args.table[1:])
        return 0
    model = build_model(args.model)
    logs = Path(tempfile.mkdtemp(prefix="kvtier-peer-read-"))
    print(f"logs in {logs}", flush=True)
    rows: list[dict] = []
    error = None
    try:
        run(model, [int(x) for x in args.ctx.split(",")], args.reps, args.a_busy, logs, rows)
    except KeyboardInterrupt:
        error = "interrupted"
    table = summarize(rows) if rows else ""
    print(table)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        args.out.write_text(json.dumps({
            "command": " ".join(sys.argv), "commit": commit, "machine": platform.platform(),
            "a_busy": args.a_busy, "error": error, "rows": rows, "table": table}, indent=1))
    return 0 if error is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
