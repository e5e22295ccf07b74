"""D->P read cost on the local CPU stack, under each thread-placement mode.

Why: in the A/B runs the D->P read (vLLM NixlConnector, bidirectional) was the slowest
reuse path on this CPU (fitted 0.58 s setup + 0.15 GB/s against ~4-6 GB/s NIXL measured
between bare processes). Found with this script (``--d-busy``): D's NIXL progress thread at
SCHED_IDLE starves while D decodes other requests, and a READ needs the target's progress;
kvtier.devstack.placement now uses nice 10 (``full``); ``full-idle`` is the old behaviour.

For each (placement, num_threads) variant this starts a 1P1D bench stack and, per context
length, runs turn 1 P/D (prefill on P, decode 32 tokens on D, D keeps its blocks), then
times turn 2's prefill on P two ways, side by side: reading the history from D (the D->P
path) and recomputing it (P's prefix cache reset before each). Reports medians and the
ratio read/recompute per variant; NIXL's own transfer time from vLLM's metrics.

    .venv/bin/python benchmarks/bench_dp_read.py [--model bench] [--ctx 1024,4096] [--reps 3]
        [--variants full:4,rebind:4,off:4,full:1] [--out benchmarks/dp_read.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvtier.configs import load_config_file
from kvtier.devstack.models import build_model
from kvtier.devstack.placement import SPINNER_NICE
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack
from kvtier.transfer_params import KVTransferParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.pd import complete, metric, reset_prefix_cache


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


class BusyDecode:
    """Keep D decoding another request while P reads from it (the A/B runs' condition: the
    decode node serves other conversations while a prefill pulls a finished turn)."""

    def __init__(self, url: str, model: str, tokens: int):
        self.url, self.model, self.tokens = url, model, tokens
        self._t: threading.Thread | None = None
        self._error: BaseException | None = None

    @classmethod
    def maybe(cls, url: str, model: str, tokens: int):
        """A BusyDecode when ``tokens`` > 0, else a context that does nothing."""
        return cls(url, model, tokens) if tokens else contextlib.nullcontext()

    def __enter__(self) -> BusyDecode:
        def go() -> None:
            body = {"model": self.model, "prompt": ids(99, 128), "max_tokens": self.tokens,
                    "temperature": 0, "ignore_eos": True}
            try:
                with httpx.Client(timeout=300) as c:
                    c.post(f"{self.url}/v1/completions", json=body).raise_for_status()
            except BaseException as e:  # noqa: BLE001 - re-raised in __exit__
                self._error = e
        self._t = threading.Thread(target=go, daemon=True)
        self._t.start()
        time.sleep(1.0)  # past its prefill, into decode
        return self

    def __exit__(self, *exc) -> None:
        if self._t is not None:
            self._t.join()
        if self._error is not None and exc[0] is None:
            # D was not busy after all: this sample would measure the idle case
            raise RuntimeError(f"the busy decode failed: {self._error}") from self._error


def run_variant(model: Path, placement: str, num_threads: int | None, ctxs: list[int],
                reps: int, log_dir: Path, rows: list[dict], d_busy: int = 0) -> None:
    """Measure one variant, appending to ``rows`` as it goes (kept if a later step fails)."""
    cfg = load_config_file("nixl-bidirectional")
    extra = {**cfg["kv_connector_extra_config"], "decoder_kv_blocks_ttl": 60}
    if num_threads is not None:
        extra["num_threads"] = num_threads
    cfg = {**cfg, "kv_connector_extra_config": extra}
    # "full-idle": full placement with the spinners at SCHED_IDLE (kvtier before nice 10)
    spec = StackSpec(model=str(model), prefill=1, decode=1, kv_transfer_config=cfg,
                     max_model_len=8192, cpu_placement=placement.removesuffix("-idle"),
                     spinner_nice=None if placement.endswith("-idle") else SPINNER_NICE)
    name = model.name
    with LocalStack(spec, log_dir) as st, httpx.Client(timeout=180) as c:
        p, d = st.prefill[0].url, st.decode[0].url
        complete(c, p, name, ids(0, 64), 1)  # warm up
        for ctx in ctxs:
            for rep in range(reps):
                first = ids(1000 * ctx + rep, ctx)
                pre = complete(c, p, name, first, 1, KVTransferParams.prefill_request().to_wire())
                dec = complete(c, d, name, first, 32, pre["kv_transfer_params"])
                held = KVTransferParams.from_wire(dec.get("kv_transfer_params"))
                if held is None or not held.nixl.has_remote_blocks:
                    raise SystemExit(f"D returned no retained blocks: {dec.get('kv_transfer_params')}")
                second = first + dec["choices"][0]["token_ids"] + ids(7 + rep, 64)
                reset_prefix_cache(c, p)
                x0 = metric(c, p, "vllm:nixl_xfer_time_seconds_sum")
                e0 = metric(c, p, "vllm:prompt_tokens_by_source_total",
                            source="external_kv_transfer")
                with BusyDecode.maybe(d, name, d_busy):
                    t0 = time.perf_counter()
                    pre2 = complete(c, p, name, second, 1,
                                    KVTransferParams.prefill_request(reuse=held.nixl).to_wire())
                    t_read = time.perf_counter() - t0
                xfer = metric(c, p, "vllm:nixl_xfer_time_seconds_sum") - x0
                ext = metric(c, p, "vllm:prompt_tokens_by_source_total",
                             source="external_kv_transfer") - e0
                complete(c, d, name, second, 1, pre2["kv_transfer_params"])  # D pulls, P frees
                reset_prefix_cache(c, p)
                with BusyDecode.maybe(d, name, d_busy):
                    t0 = time.perf_counter()
                    complete(c, p, name, second, 1)
                    t_comp = time.perf_counter() - t0
                reset_prefix_cache(c, p)
                rows.append({"ctx": ctx, "rep": rep, "read_s": t_read, "recompute_s": t_comp,
                             "nixl_xfer_s": xfer, "read_tokens": ext})
                print(f"  {placement}:{num_threads} ctx {ctx} rep {rep}: read {t_read:.3f}s "
                      f"(nixl {xfer:.3f}s, {ext:.0f} tok read) recompute {t_comp:.3f}s", flush=True)


def summarize(results: list[dict]) -> str:
    lines = ["| variant | ctx | read p50 (s) | nixl xfer p50 (s) | recompute p50 (s) | read/recompute |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if r.get("error"):
            lines.append(f"| {r['placement']}:{r['num_threads']} | failed: {r['error'][:80]} "
                         f"| | | | |")
        for ctx in sorted({x["ctx"] for x in r["rows"]}):
            xs = [x for x in r["rows"] if x["ctx"] == ctx]
            rd = statistics.median(x["read_s"] for x in xs)
            nx = statistics.median(x["nixl_xfer_s"] for x in xs)
            rc = statistics.median(x["recompute_s"] for x in xs)
            lines.append(f"| {r['placement']}:{r['num_threads']} | {ctx} | {rd:.3f} | {nx:.3f} | "
                         f"{rc:.3f} | {rd / rc:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--ctx", default="1024,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="full:4,full-idle:4,rebind:4,off:4,full:1",
                    help="placement:num_threads,... (placement full|full-idle|rebind|off; "
                         "full-idle: spinners at SCHED_IDLE, not nice 10; num_threads "
                         "'default' = vLLM's)")
    ap.add_argument("--d-busy", type=int, default=0, metavar="TOKENS",
                    help="keep D decoding a request of this many tokens during each timed "
                         "turn 2 (read and recompute alike); 0: D idle")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = build_model(args.model)
    ctxs = [int(x) for x in args.ctx.split(",")]
    results = []
    logs = Path(tempfile.mkdtemp(prefix="kvtier-dp-read-"))
    for v in args.variants.split(","):
        placement, _, nt = v.partition(":")
        num_threads = None if nt in ("", "default") else int(nt)
        print(f"variant {placement}:{nt or 'default'} (logs {logs / v.replace(':', '-')})",
              flush=True)
        rec: dict = {"placement": placement, "num_threads": num_threads, "d_busy": args.d_busy,
                     "rows": []}
        results.append(rec)
        try:
            run_variant(model, placement, num_threads, ctxs, args.reps,
                        logs / v.replace(":", "-"), rec["rows"], args.d_busy)
        except KeyboardInterrupt:
            rec["error"] = "interrupted"
            break
        except Exception as e:  # one variant failing (a hung read, a start failure) keeps the rest
            rec["error"] = f"{type(e).__name__}: {e}"
            print(f"variant {v} failed: {rec['error']}", flush=True)
    table = summarize(results)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"results": results, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
