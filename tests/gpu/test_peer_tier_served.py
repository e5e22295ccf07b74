"""kvtier's peer fetch as a secondary tier of vLLM's CPU offloading, served on CUDA.

Two vLLM servers (CUDA build, the 8B shape of ``benchmarks/gpu/model`` with dummy weights,
eager, a fixed 4 GiB KV cache each so both start at once) with ``configs/vllm-offload-peer.json``
(vLLM's ``OffloadingConnector``, CPU, ``offload_prompt_only: false``, and the ``kvtier-peer``
secondary tier, ``kvtier.connectors.peer_tier``), the same ``PYTHONHASHSEED`` and
``--prefix-caching-hash-algo sha256`` so both hash blocks alike. Turn 1 runs on A (its blocks
reach A's CPU tier and cascade into A's peer pool); turn 2 (turn 1's prompt and answer plus
500 new tokens) runs on B, first with a fresh ``cache_salt`` (the recomputed reference), then
naming A in ``kv_transfer_params.remote_kv_source``: its history must come from A's host memory
(``cached_tokens`` covers turn 1's prompt) and its greedy output must equal the recomputed one.

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
PORTS = {"a": (8331, 8431), "b": (8332, 8432)}  # HTTP, kvtier peer side channel
START_S = 420.0
BLOCK = 16


def _complete(url: str, prompt: list[int], n: int, **extra: object) -> tuple[list[int], int]:
    import httpx

    r = httpx.post(f"{url}/v1/completions", json={
        "model": "m8b", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra}, timeout=120)
    r.raise_for_status()
    doc = r.json()
    usage = doc.get("usage") or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return list(doc["choices"][0]["token_ids"]), cached


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    import httpx

    work = tmp_path_factory.mktemp("peer-tier")
    kv = load_config_file("vllm-offload-peer")
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONHASHSEED": "0"}
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        for name, (port, p2p) in PORTS.items():
            logf = work / f"{name}.log"
            procs[name] = (subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(MODEL), "--served-model-name", "m8b", "--load-format", "dummy",
                 "--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization", "0.3",
                 "--kv-cache-memory-bytes", str(4 << 30), "--block-size", str(BLOCK),
                 "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256",
                 "--enable-prompt-tokens-details",
                 "--host", "127.0.0.1", "--port", str(port),
                 "--kv-transfer-config", json.dumps(kv)],
                cwd=work, env={**env, "KVTIER_P2P_PORT": str(p2p)},
                stdout=logf.open("w"), stderr=subprocess.STDOUT, process_group=0), logf)
        urls = {n: f"http://127.0.0.1:{p}" for n, (p, _) in PORTS.items()}
        deadline = time.monotonic() + START_S
        for name, url in urls.items():
            proc, logf = procs[name]
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"{name}: vLLM exited {proc.returncode}:\n"
                                + logf.read_text()[-6000:])
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"{name}: not ready in {START_S:.0f} s:\n"
                                + logf.read_text()[-6000:])
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
        for name, (_, logf) in procs.items():
            print(f"--- {name} (kvtier lines)")
            for line in logf.read_text(errors="replace").splitlines():
                if "kvtier" in line or "Error" in line or "Traceback" in line:
                    print(line[:300])


def test_turn_two_on_b_pulls_turn_ones_kv_from_as_host_tier(servers: dict[str, str]) -> None:
    rnd = random.Random(11)
    p1 = [rnd.randrange(10, 30000) for _ in range(3000)]
    out1, _ = _complete(servers["a"], p1, 16)
    p2 = p1 + out1 + [rnd.randrange(10, 30000) for _ in range(500)]
    ref, cached_ref = _complete(servers["b"], p2, 16, cache_salt=uuid.uuid4().hex)
    assert cached_ref == 0, "a salted request reused KV: the reference is not a recompute"
    time.sleep(2.0)  # A's store to its CPU tier and the cascade into its peer pool are async
    source = {"pod": "a", "host": "127.0.0.1", "port": PORTS["a"][1],
              "num_tokens": len(p1) + len(out1)}
    got, cached = _complete(servers["b"], p2, 16,
                            kv_transfer_params={"remote_kv_source": source})
    assert cached >= len(p1) // BLOCK * BLOCK, \
        f"turn 2 on B reused {cached} tokens, turn 1's prompt on A has {len(p1)}"
    assert got == ref, "output from A's host memory differs from B's recomputed one"
