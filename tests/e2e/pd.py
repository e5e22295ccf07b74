"""A hand-rolled P/D exchange for foundation tests (the router does this for real), and the
e2e helpers its neighbours share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import httpx

from kvtier.ab.live import scrape
from kvtier.transfer_params import KVTransferParams, NixlParams


def complete(client: httpx.Client, url: str, model: str, prompt: str | list[int],
             max_tokens: int, params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def pd_complete(client: httpx.Client, p_url: str, d_url: str, model: str,
                prompt: str | list[int], max_tokens: int, reuse: NixlParams | None = None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Prefill on P (optionally reading `reuse` from a decode node), decode on D."""
    pre = complete(client, p_url, model, prompt, 1,
                   KVTransferParams.prefill_request(reuse=reuse).to_wire())
    dec = complete(client, d_url, model, prompt, max_tokens, pre["kv_transfer_params"])
    return pre, dec


def metric(client: httpx.Client, url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample (counter/gauge) whose labels include ``labels``."""
    return scrape.metric(client.get(f"{url}/metrics").text, name, labels)


def reset_prefix_cache(client: httpx.Client, url: str, retry_s: float = 0.0) -> bool:
    """Reset ``url``'s prefix cache; True when vLLM did. vLLM refuses (``success: false``,
    HTTP 200) while blocks are still held (a request finishing, a transfer in flight):
    ``retry_s`` keeps asking that long."""
    deadline = time.monotonic() + retry_s
    while True:
        r = client.post(f"{url}/reset_prefix_cache")
        r.raise_for_status()
        try:
            ok = bool(r.json().get("success", True))
        except ValueError:
            ok = True  # an older vLLM answered without a body
        if ok or time.monotonic() >= deadline:
            return ok
        time.sleep(0.1)


def reaped(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Wait for a killed process. A run here once saw a SIGKILLed router outlive two 10 s
    waits (cause unknown; the machine was short of nothing). A test times its claim from
    the kill, not from here; a process that lingers is a warning naming what its threads
    are doing (state and kernel wait channel), not the test's failure."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        state = []
        for task in sorted(os.listdir(f"/proc/{proc.pid}/task")):
            try:
                with open(f"/proc/{proc.pid}/task/{task}/stat") as f:
                    stat = f.read().split(") ", 1)[1].split()[0]
                with open(f"/proc/{proc.pid}/task/{task}/wchan") as f:
                    state.append(f"{task}:{stat}:{f.read()}")
            except OSError as e:
                state.append(f"{task}:{e}")
        warnings.warn(f"pid {proc.pid} alive {timeout_s:.0f} s after SIGKILL; threads "
                      f"(state:wchan): {state}", stacklevel=2)


def spawn_kvtier(argv: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """``kvtier ARGV...`` as a user runs it, in ``cwd``, in its own process group, output to
    ``log``. The group stays in the caller's session: Linux's autogroup scheduling weighs
    nice levels only within a session, and a stack demotes its engines' idle NIXL threads
    (``kvtier.devstack.placement``) so that they yield to the test and its router."""
    return subprocess.Popen([sys.executable, "-m", "kvtier.cli", *argv], cwd=cwd,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            process_group=0, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM a ``spawn_kvtier`` process group (SIGKILL after 60 s), then reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    reaped(proc)
