"""Calibrate kvtier's cost model on one GPU: prefill time vs (new, cached) tokens, KV bytes per token,
host-tier store/load over pinned PCIe, and the GPU's own ceilings.

Runs standalone with torch + numpy (the lent H200 has no vllm/msgspec/pydantic); imports only the
sibling ``gpu_shapes.py``. Random-weight Llama/Qwen-layout decoder layers in bf16, no model download.

What is timed (and what is not):
- One decoder layer = RMSNorm, fused QKV GEMM, RoPE, write of the new K/V into a preallocated per-layer
  cache (what vLLM's reshape_and_cache does; equivalent to concatenating cached and new K/V), SDPA over
  cached+new keys with lower-right causal masking (new token i sees every cached token and new tokens <= i),
  O GEMM, residual, RMSNorm, fused gate/up GEMM, SiLU*up, down GEMM, residual.
- The grid times the first ``--sub-layers`` layers of the stack (each with its own weights and KV cache)
  and scales by layers/sub_layers; ``full_stack_check`` times the whole stack at a few points and
  reports the ratio measured/scaled, so the scaling is checked, not assumed.
- Not timed: tokenizer, HTTP, scheduler, sampling, embedding lookup and LM head (one token), chunked
  prefill, CUDA graphs, tensor parallelism. These are what a serving engine adds on top.

Threading model: single-threaded script; one CUDA stream (the default one).

Usage (smoke on CPU):  python benchmarks/gpu/calibrate_gpu.py --device cpu --smoke --out /tmp/cal.json
On the H200:           python3 benchmarks/gpu/calibrate_gpu.py --out $OUT/results-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_shapes import SHAPES, ModelShape, median, prefill_grid, scale_layers  # noqa: E402

DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------------------------- timing
class Timer:
    """Times a callable on ``device``: CUDA events on GPU, perf_counter on CPU; warm-up, median."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any], warmup: int, reps: int) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        out: list[float] = []
        for _ in range(reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out


# -------------------------------------------------------------------------------------------- attention
def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 math attention, lower-right causal, GQA by repetition. q [1,H,n,d], k/v [1,KV,T,d]."""
    n, total = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.arange(total, device=q.device)[None, :] <= (torch.arange(n, device=q.device)[:, None] + total - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ vf


def _attn_lower_right_gqa(q, k, v):
    from torch.nn.attention.bias import causal_lower_right

    n, total = q.shape[2], k.shape[2]
    if n == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, total), enable_gqa=True)


def _attn_flash_op(q, k, v):
    # aten's flash kernel treats is_causal with L != S as lower-right aligned (as CausalBias relies on).
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=True)[0]


def _attn_lower_right_repeat(q, k, v):
    from torch.nn.attention.bias import causal_lower_right

    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    n, total = q.shape[2], k.shape[2]
    if n == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, total))


def _attn_explicit_mask(q, k, v):
    n, total = q.shape[2], k.shape[2]
    mask = torch.arange(total, device=q.device)[None, :] <= (torch.arange(n, device=q.device)[:, None] + total - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


ATTENTION_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "flash_op": _attn_flash_op,
    "sdpa_lower_right_gqa": _attn_lower_right_gqa,
    "sdpa_lower_right_repeat": _attn_lower_right_repeat,
    "sdpa_explicit_mask": _attn_explicit_mask,
}


def choose_attention(device: torch.device, timer: Timer, smoke: bool) -> tuple[str, dict[str, Any]]:
    """Check every implementation against the float32 reference (fresh random inputs, n < T and n == T),
    time the correct ones on a long-context case, and return the fastest correct one."""
    heads, kv_heads, hd = 8, 2, 128
    report: dict[str, Any] = {"candidates": []}
    bench_n, bench_t = (64, 512) if smoke else (2048, 16384)
    for name, fn in ATTENTION_IMPLS.items():
        entry: dict[str, Any] = {"impl": name}
        try:
            errs = []
            for n, total in ((48, 200), (130, 130), (1, 77)):
                q = torch.randn(1, heads, n, hd, device=device, dtype=DTYPE)
                k = torch.randn(1, kv_heads, total, hd, device=device, dtype=DTYPE)
                v = torch.randn(1, kv_heads, total, hd, device=device, dtype=DTYPE)
                out = fn(q, k, v)
                ref = _reference_attention(q, k, v)
                errs.append(float((out.float() - ref).norm() / ref.norm()))
            entry["rel_err"] = max(errs)
            entry["ok"] = bool(all(math.isfinite(e) and e < 2e-2 for e in errs))
            if entry["ok"]:
                q = torch.randn(1, 64, bench_n, hd, device=device, dtype=DTYPE)
                k = torch.randn(1, 8, bench_t, hd, device=device, dtype=DTYPE)
                v = torch.randn(1, 8, bench_t, hd, device=device, dtype=DTYPE)
                entry["bench_ms"] = 1e3 * median(timer.time(lambda: fn(q, k, v), warmup=2, reps=5))
        except Exception as exc:  # a backend that refuses the shape is a finding, not a crash
            entry["ok"] = False
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        report["candidates"].append(entry)
    ok = [c for c in report["candidates"] if c["ok"]]
    if not ok:
        raise RuntimeError(f"no attention implementation matched the reference: {report}")
    best = min(ok, key=lambda c: c["bench_ms"])
    report["chosen"] = best["impl"]
    report["bench_case"] = {"heads": 64, "kv_heads": 8, "new": bench_n, "total": bench_t}
    return best["impl"], report


# ---------------------------------------------------------------------------------------------- layers
class Layer:
    """Weights and KV cache of one decoder layer (random, bf16)."""

    def __init__(self, shape: ModelShape, max_tokens: int, device: torch.device, gen: torch.Generator) -> None:
        def w(rows: int, cols: int) -> torch.Tensor:
            t = torch.empty(rows, cols, device=device, dtype=DTYPE)
            return t.normal_(0.0, 1.0 / math.sqrt(rows), generator=gen)

        self.shape = shape
        self.ln1 = torch.ones(shape.hidden, device=device, dtype=DTYPE)
        self.ln2 = torch.ones(shape.hidden, device=device, dtype=DTYPE)
        self.w_qkv = w(shape.hidden, shape.q_dim + 2 * shape.kv_dim)
        self.w_o = w(shape.q_dim, shape.hidden)
        self.w_gate_up = w(shape.hidden, 2 * shape.intermediate)
        self.w_down = w(shape.intermediate, shape.hidden)
        # [2 (K,V), 1, kv_heads, max_tokens, head_dim]; random (never zeros) so "cached" K/V is real data.
        self.kv = torch.empty(2, 1, shape.kv_heads, max_tokens, shape.head_dim, device=device, dtype=DTYPE)
        self.kv.normal_(0.0, 1.0, generator=gen)


def rope_tables(max_tokens: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (1_000_000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.arange(max_tokens, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos().to(DTYPE), ang.sin().to(DTYPE)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def layer_forward(layer: Layer, x: torch.Tensor, cached: int, cos: torch.Tensor, sin: torch.Tensor,
                  attn: Callable[..., torch.Tensor]) -> torch.Tensor:
    s = layer.shape
    n = x.shape[0]
    total = cached + n
    h = F.rms_norm(x, (s.hidden,), layer.ln1, 1e-6)
    qkv = h @ layer.w_qkv
    q, k, v = qkv.split((s.q_dim, s.kv_dim, s.kv_dim), dim=-1)
    c, si = cos[cached:total, None, :], sin[cached:total, None, :]
    q = apply_rope(q.view(n, s.heads, s.head_dim), c, si)
    k = apply_rope(k.view(n, s.kv_heads, s.head_dim), c, si)
    layer.kv[0, 0, :, cached:total].copy_(k.transpose(0, 1))
    layer.kv[1, 0, :, cached:total].copy_(v.view(n, s.kv_heads, s.head_dim).transpose(0, 1))
    o = attn(q.transpose(0, 1).unsqueeze(0), layer.kv[0, :, :, :total], layer.kv[1, :, :, :total])
    x = x + o[0].transpose(0, 1).reshape(n, s.q_dim) @ layer.w_o
    h = F.rms_norm(x, (s.hidden,), layer.ln2, 1e-6)
    gate, up = (h @ layer.w_gate_up).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ layer.w_down


# ------------------------------------------------------------------------------------------ benchmarks
def measure_ceilings(device: torch.device, timer: Timer, smoke: bool) -> dict[str, float]:
    n = 512 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=DTYPE)
    b = torch.randn(n, n, device=device, dtype=DTYPE)
    t = median(timer.time(lambda: a @ b, warmup=3, reps=10))
    nbytes = (1 << 20) if smoke else (1 << 30)
    src = torch.randn(nbytes // 2, device=device, dtype=DTYPE)
    dst = torch.empty_like(src)
    tc = median(timer.time(lambda: dst.copy_(src), warmup=3, reps=10))
    return {"bf16_matmul_n": n, "bf16_matmul_tflops": 2 * n**3 / t / 1e12,
            "d2d_copy_bytes": nbytes, "d2d_copy_tb_s_read_plus_write": 2 * nbytes / tc / 1e12}


def measure_shape(shape: ModelShape, args: argparse.Namespace, device: torch.device, timer: Timer,
                  attn: Callable[..., torch.Tensor], deadline: float) -> dict[str, Any]:
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    grid = prefill_grid(args.totals, args.news)
    max_tokens = max(n + c for n, c in grid)
    full_layers = shape.layers if args.full_stack_checks else args.sub_layers
    t0 = time.perf_counter()
    layers = [Layer(shape, max_tokens, device, gen) for _ in range(full_layers)]
    cos, sin = rope_tables(max_tokens, shape.head_dim, device)
    timer.sync()
    result: dict[str, Any] = {
        "config": shape.hf_config(), "note": shape.note,
        "kv_bytes_per_token": shape.kv_bytes_per_token(),
        "kv_bytes_per_token_measured": layers[0].kv[:, :, :, :1].numel() * layers[0].kv.element_size()
        * shape.layers,
        "params": shape.params(), "params_per_layer": shape.params_per_layer(),
        "layers_built": full_layers, "build_s": time.perf_counter() - t0,
        "timing_method": (f"grid: first {args.sub_layers} of {shape.layers} layers timed, scaled by "
                          f"{shape.layers}/{args.sub_layers}; full_stack_check: all {shape.layers} layers"),
        "prefill": [], "full_stack_check": [], "skipped": [],
    }

    def run(k: int, n: int, cached: int) -> tuple[list[float], bool]:
        x0 = torch.randn(n, shape.hidden, device=device, dtype=DTYPE, generator=gen)
        holder: dict[str, torch.Tensor] = {}

        def fwd() -> None:
            x = x0
            for layer in layers[:k]:
                x = layer_forward(layer, x, cached, cos, sin, attn)
            holder["x"] = x

        times = timer.time(fwd, warmup=args.warmup, reps=args.reps)
        return times, bool(torch.isfinite(holder["x"]).all())

    for n, cached in grid:
        if time.perf_counter() > deadline:
            result["skipped"].append({"new_tokens": n, "cached_tokens": cached, "why": "time budget"})
            continue
        times, finite = run(args.sub_layers, n, cached)
        sec = scale_layers(median(times), args.sub_layers, shape.layers)
        result["prefill"].append({
            "new_tokens": n, "cached_tokens": cached, "layers_timed": args.sub_layers,
            "seconds": sec, "seconds_layers_timed": median(times), "reps_s": times, "finite": finite,
            "tflops": shape.prefill_flops(n, cached) / sec / 1e12,
        })
        print(f"  {shape.name:11s} new={n:6d} cached={cached:6d}  {1e3 * sec:9.1f} ms "
              f"({result['prefill'][-1]['tflops']:.0f} TFLOP/s)", flush=True)
    if args.full_stack_checks:
        by_point = {(p["new_tokens"], p["cached_tokens"]): p for p in result["prefill"]}
        for n, cached in args.full_stack_checks:
            if (n, cached) not in by_point or time.perf_counter() > deadline:
                result["skipped"].append({"full_stack": [n, cached], "why": "not in grid or time budget"})
                continue
            saved = (args.warmup, args.reps)
            args.warmup, args.reps = 1, args.full_reps
            times, finite = run(shape.layers, n, cached)
            args.warmup, args.reps = saved
            scaled = by_point[(n, cached)]["seconds"]
            result["full_stack_check"].append({
                "new_tokens": n, "cached_tokens": cached, "layers_timed": shape.layers,
                "seconds_full": median(times), "seconds_scaled": scaled,
                "ratio_full_over_scaled": median(times) / scaled, "reps_s": times, "finite": finite})
            print(f"  {shape.name:11s} FULL new={n:6d} cached={cached:6d}  {1e3 * median(times):9.1f} ms "
                  f"(scaled {1e3 * scaled:.1f} ms)", flush=True)
    layers.clear()  # free the device memory before the copy phase (fwd() is done with it)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def measure_host_copies(shape: ModelShape, tokens_list: list[int], device: torch.device, timer: Timer,
                        block_tokens: int, per_block_max_tokens: int) -> list[dict[str, Any]]:
    """Host-tier store (device -> pinned host) and load (pinned host -> device) of N tokens' KV.

    Variants: one contiguous copy; one copy per layer (layer-wise staging); a device-side gather of
    ``block_tokens``-token blocks from a paged per-layer pool into a staging buffer followed by one
    copy per layer; and (up to ``per_block_max_tokens``) one copy per block per layer per K/V, the
    naive launch-bound way.
    """
    out: list[dict[str, Any]] = []
    pin = device.type == "cuda"
    per_layer_tok = shape.kv_bytes_per_token_per_layer() // 2  # elements of bf16 per token per layer
    for tokens in tokens_list:
        nbytes = tokens * shape.kv_bytes_per_token()
        dev = torch.randn(nbytes // 2, device=device, dtype=DTYPE)
        host = torch.empty(nbytes // 2, dtype=DTYPE, pin_memory=pin)
        dev_layers = dev.view(shape.layers, tokens * per_layer_tok)
        host_layers = host.view(shape.layers, tokens * per_layer_tok)

        def rec(variant: str, direction: str, fn: Callable[[], Any], reps: int = 7) -> None:
            times = timer.time(fn, warmup=2, reps=reps)
            s = median(times)
            out.append({"shape": shape.name, "tokens": tokens, "bytes": nbytes, "variant": variant,
                        "direction": direction, "seconds": s, "gb_s": nbytes / s / 1e9, "reps_s": times})

        rec("contiguous", "store_d2h", lambda: host.copy_(dev, non_blocking=True))
        rec("contiguous", "load_h2d", lambda: dev.copy_(host, non_blocking=True))

        def per_layer_store() -> None:
            for i in range(shape.layers):
                host_layers[i].copy_(dev_layers[i], non_blocking=True)

        def per_layer_load() -> None:
            for i in range(shape.layers):
                dev_layers[i].copy_(host_layers[i], non_blocking=True)

        rec("per_layer", "store_d2h", per_layer_store)
        rec("per_layer", "load_h2d", per_layer_load)
        blocks = max(1, tokens // block_tokens)
        pool_blocks = 4 * blocks
        block_elems = block_tokens * per_layer_tok
        pool = torch.randn(pool_blocks, block_elems, device=device, dtype=DTYPE)  # one layer's paged pool
        ids = torch.randperm(pool_blocks, device=device)[:blocks]
        staging = torch.empty(blocks, block_elems, device=device, dtype=DTYPE)
        host_stage = host[: shape.layers * blocks * block_elems].view(shape.layers, blocks, block_elems)

        def gather_store() -> None:
            for i in range(shape.layers):  # the same pool stands in for every layer's pool
                torch.index_select(pool, 0, ids, out=staging)
                host_stage[i].copy_(staging, non_blocking=True)

        def scatter_load() -> None:
            for i in range(shape.layers):
                staging.copy_(host_stage[i], non_blocking=True)
                pool.index_copy_(0, ids, staging)

        rec("gather_per_layer", "store_d2h", gather_store)
        rec("gather_per_layer", "load_h2d", scatter_load)
        if tokens <= per_block_max_tokens:
            half = block_elems // 2
            id_list = ids.tolist()

            def per_block_store() -> None:
                for i in range(shape.layers):
                    for j, b in enumerate(id_list):
                        host_stage[i, j, :half].copy_(pool[b, :half], non_blocking=True)
                        host_stage[i, j, half:].copy_(pool[b, half:], non_blocking=True)

            rec("per_block", "store_d2h", per_block_store, reps=3)
        print(f"  host {shape.name:11s} {tokens:6d} tok {nbytes / 2**20:8.1f} MiB: " + ", ".join(
            f"{r['variant']}/{r['direction']} {1e3 * r['seconds']:.2f} ms"
            for r in out if r["tokens"] == tokens and r["shape"] == shape.name), flush=True)
        # drop the buffers (rebinding, not del: the timed closures above refer to them)
        dev = host = pool = staging = None
    return out


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "results-h200.json"))
    p.add_argument("--shapes", default="llama8b,qwen25_32b,qwen3_32b")
    p.add_argument("--totals", default="2048,4096,8192,12288,16384,24576,32768")
    p.add_argument("--news", default="128,512,2048,8192")
    p.add_argument("--sub-layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--full-reps", type=int, default=3)
    p.add_argument("--full-stack-checks", default="8192:0,2048:22528,32768:0",
                   help="new:cached points timed on the whole stack ('' for none)")
    p.add_argument("--host-shapes", default="llama8b,qwen3_32b")
    p.add_argument("--host-tokens", default="256,1024,4096,16384")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--per-block-max-tokens", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new points after this")
    p.add_argument("--smoke", action="store_true", help="tiny shape and sizes (CPU test of the script)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.host_shapes = "smoke", "smoke"
        args.totals, args.news, args.host_tokens = "64,256", "16,64", "32,128"
        args.full_stack_checks, args.sub_layers, args.reps = "64:0,64:192", 2, 2
        args.per_block_max_tokens = 64
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.host_shapes = [s for s in args.host_shapes.split(",") if s]
    args.totals = [int(t) for t in args.totals.split(",")]
    args.news = [int(t) for t in args.news.split(",")]
    args.host_tokens = [int(t) for t in args.host_tokens.split(",")]
    args.full_stack_checks = [tuple(int(v) for v in p.split(":")) for p in args.full_stack_checks.split(",") if p]
    for name in args.shapes + args.host_shapes:
        if name not in SHAPES:
            p.error(f"unknown shape {name}; known: {sorted(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    timer = Timer(device)
    torch.manual_seed(0)
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "device": str(device), "argv": sys.argv[1:],
                           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count,
                   cuda=torch.version.cuda)
    results: dict[str, Any] = {"schema": "kvtier.gpu_calibration/1", "env": env, "shapes": {},
                               "host_copies": [],
                               "nixl": {"measured": False, "note": (
                                   "not re-measured: docs/FACTS.md (lent H200, 2026-12-02) measured NIXL/UCX READ "
                                   "VRAM->VRAM between two processes on the one GPU at 0.5-0.6 GB/s, which says "
                                   "nothing about NVLink/RDMA; the link is a model parameter")}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        results["elapsed_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(results, indent=1))

    results["ceilings"] = measure_ceilings(device, timer, args.smoke)
    print(f"ceilings: {results['ceilings']}", flush=True)
    impl, results["attention"] = choose_attention(device, timer, args.smoke)
    print(f"attention: chosen {impl}: " + "; ".join(
        f"{c['impl']} ok={c['ok']} err={c.get('rel_err', float('nan')):.1e} ms={c.get('bench_ms', float('nan')):.2f}"
        + (f" {c['error']}" if "error" in c else "") for c in results["attention"]["candidates"]), flush=True)
    save()
    attn = ATTENTION_IMPLS[impl]
    with torch.inference_mode():
        for name in args.host_shapes:
            results["host_copies"] += measure_host_copies(SHAPES[name], args.host_tokens, device, timer,
                                                          args.block_tokens, args.per_block_max_tokens)
            save()
        for name in args.shapes:
            print(f"shape {name}", flush=True)
            results["shapes"][name] = measure_shape(SHAPES[name], args, device, timer, attn, deadline)
            save()
    save()
    print(f"wrote {out} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
