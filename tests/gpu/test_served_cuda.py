"""The CUDA host-tier configs served by vLLM: a turn's history comes back from host memory.

Starts vLLM (CUDA build, the Llama-3.1-8B shape of ``benchmarks/gpu/model`` with dummy
weights, eager, a fixed 4 GiB KV cache so both start at once) with each CUDA host-tier
config of ``configs/``: ``vllm-offload-cpu`` (vLLM's own ``OffloadingConnector``: the host tier
kvtier ships for CUDA, ``docs/gpu.md`` says why; the ``vllm-offload`` strategy of the A/B) and
``cuda-kvtier-host`` (kvtier's own tier on CUDA, which peer fetch needs). On each: turn 1 (3,000 prompt tokens, 16 generated); turn 2 (turn 1's
prompt and answer plus 500 new tokens) once with a fresh ``cache_salt`` (nothing can be
reused: the recomputed reference), then, after ``/reset_prefix_cache`` empties device
memory, without one: its history must come from host memory (``cached_tokens`` covers turn
1's prompt, vLLM counts external hits) and its greedy output must equal the recomputed one.

Threading model: one module-scoped fixture owns both servers; tests run sequentially.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.configs import load_config_file

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "benchmarks" / "gpu" / "model"
CONFIGS = {"cuda-kvtier-host": 8311, "vllm-offload-cpu": 8312}
START_S = 420.0
BLOCK = 16

def _post(url: str, body: dict | None = None) -> dict:
    import httpx

    r = httpx.post(url, json=body, timeout=120) if body is not None else \
        httpx.post(url, timeout=60)
    r.raise_for_status()
    return r.json() if r.content else {}


def _complete(url: str, prompt: list[int], n: int, **extra: object) -> tuple[list[int], int]:
    doc = _post(f"{url}/v1/completions", {
        "model": "m8b", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra})
    usage = doc.get("usage") or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return list(doc["choices"][0]["token_ids"]), cached


def _external_hits(url: str) -> float:
    import httpx

    from kvtier.ab.live.scrape import metric

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return metric(text, "vllm:external_prefix_cache_hits_total")  # summed over label sets


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    import httpx

    work = tmp_path_factory.mktemp("served")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "PYTHONUNBUFFERED": "1"}
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        for name, port in CONFIGS.items():
            kv = load_config_file(name)
            logf = work / f"{name}.log"
            procs[name] = (subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(MODEL), "--served-model-name", "m8b", "--load-format", "dummy",
                 "--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization", "0.3",
                 "--kv-cache-memory-bytes", str(4 << 30), "--block-size", str(BLOCK),
                 "--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--host", "127.0.0.1", "--port", str(port),
                 "--kv-transfer-config", json.dumps(kv)],
                # from a scratch folder: a checkout's kvtier/ (no connectors/) must not shadow
                # the installed package
                cwd=work, env={**env, "KVTIER_METRICS_PORT": str(port + 100)},
                stdout=logf.open("w"), stderr=subprocess.STDOUT, process_group=0), logf)
        urls = {n: f"http://127.0.0.1:{p}" for n, p in CONFIGS.items()}
        deadline = time.monotonic() + START_S
        for name, url in urls.items():
            proc, logf = procs[name]
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"{name}: vLLM exited {proc.returncode}:\n"
                                + logf.read_text()[-4000:])
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"{name}: not ready in {START_S:.0f} s:\n"
                                + logf.read_text()[-4000:])
                time.sleep(1)
        yield urls
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc, _ in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_history_served_from_host_memory_equals_recompute(servers: dict[str, str],
                                                          config: str) -> None:
    url = servers[config]
    rnd = random.Random(7)
    p1 = [rnd.randrange(10, 30000) for _ in range(3000)]
    out1, _ = _complete(url, p1, 16)
    p2 = p1 + out1 + [rnd.randrange(10, 30000) for _ in range(500)]
    ref, cached_ref = _complete(url, p2, 16, cache_salt=uuid.uuid4().hex)
    assert cached_ref == 0, "a salted request reused KV: the reference is not a recompute"
    time.sleep(1.0)  # turn 1's store to host memory is asynchronous
    _post(f"{url}/reset_prefix_cache")
    hits0 = _external_hits(url)
    got, cached = _complete(url, p2, 16)
    assert cached >= len(p1) // BLOCK * BLOCK, \
        f"{config}: turn 2 reused {cached} tokens, turn 1's prompt has {len(p1)}"
    assert _external_hits(url) - hits0 >= len(p1) // BLOCK * BLOCK
    assert got == ref, f"{config}: output from host memory differs from the recomputed one"
