"""Many hosts with real engines: prefill and decode vLLM servers in two network namespaces,
the router in the root namespace, the indexer in a third; a conversation's turn 2 reads the
decode node's KV across "hosts".

Hosts (one namespace each, 10.R.S.i/24 on one bridge in a hub namespace; tests/netns.py):

- ``p``: the prefill vLLM (``--host``, NIXL side channel and ``KVTIER_P2P_HOST`` = its own
  address, never loopback); ``d``: the decode vLLM, likewise; ``ix``: ``kvtier indexer``
  subscribed to both engines' KV events at their addresses;
- the root namespace: this test and the router (``RouterServer`` in-process), on a veth onto
  the bridge (``{prefix}.254``).

Each engine is started with the command line and environment ``LocalStack`` gives it
(``InstanceSpec.argv()`` / ``env()``), under ``ip netns exec``, with only the addresses
changed; ``LocalStack`` itself starts, watches and stops them (process groups).

What crosses hosts: router -> P and router -> D (HTTP), the P->D transfer of turn 1 and the
D->P read of turn 2 (NIXL: the ZMQ side channel and the KV bytes), the engines' KV events to
the indexer and the router's ``/v1/route`` calls to it. NIXL's UCX backend is limited to TCP
on the namespace's veth (``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=eth0``): both engines share
one kernel, so UCX's default transports move the bytes through shared memory and never touch
the network (measured here with the defaults: the P->D transfer of 150 tokens, 300 KiB of KV,
worked and gave the right answer, but D's ``eth0`` received 6.5 KB); with this setting the KV
bytes must cross the veth, and the test checks that the receiving namespace's ``eth0``
counted at least that many bytes (turn 1 ~337 KB into D, turn 2 ~471 KB into P).

Skipped only where ``ip netns add`` is refused (not root, no CAP_SYS_ADMIN); the reason is
printed. Holds the machine-wide e2e lock while its engines run (after releasing the shared
stack pool's stack), so no other vLLM stack runs beside it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import Field

from kvtier.ab.live.lock import e2e_lock
from kvtier.configs import load_config_file
from kvtier.devstack.platform import kv_dtype_bytes
from kvtier.devstack.spec import InstanceSpec, StackSpec
from kvtier.devstack.stack import LocalStack
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from tests.e2e.pd import metric, reset_prefix_cache
from tests.helpers import wait_until
from tests.netns import Net, Proc, make_net

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

MODEL = "tiny"
BS = 32
INDEXER_PORT = 8300
# NIXL (UCX) over the veth only: see the module docstring.
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


class NsInstanceSpec(InstanceSpec):
    """An ``InstanceSpec`` run in network namespace ``netns`` at ``address``: the same argv and
    environment, with the listen address, NIXL side channel, peer address and vLLM's own IP
    set to the namespace's address instead of loopback."""

    netns: str
    address: str

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.http_port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{self.address}:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.address}:{self.replay_port}"

    def argv(self) -> list[str]:
        argv = super().argv()
        i = argv.index("--host")
        argv[i + 1] = self.address
        return ["ip", "netns", "exec", self.netns, *argv]

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=self.address, KVTIER_P2P_HOST=self.address,
                   VLLM_HOST_IP=self.address)
        return env


class NsStackSpec(StackSpec):
    """A ``StackSpec`` whose i-th instance (prefill first) runs in ``hosts[i]`` = (netns,
    address)."""

    hosts: tuple[tuple[str, str], ...]
    env: dict[str, str] = Field(default_factory=dict)

    def instances(self) -> list[InstanceSpec]:
        out: list[InstanceSpec] = []
        for spec, (ns, addr) in zip(super().instances(), self.hosts, strict=True):
            out.append(NsInstanceSpec(**{**spec.model_dump(),
                                         "extra_env": {**spec.extra_env, **self.env}},
                                      netns=ns, address=addr))
        return out


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    n = make_net(("p", "d", "ix"))
    try:
        n.attach_root()
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def stack(net, stack_pool, tiny_model, tmp_path_factory) -> Iterator[LocalStack]:
    # One vLLM stack on the machine at a time: give back the pool's (and its hold on the
    # machine-wide lock), then take the lock for these engines.
    stack_pool.release()
    spec = NsStackSpec(model=tiny_model, prefill=1, decode=1, block_size=BS,
                       kv_transfer_config=load_config_file("nixl-bidirectional"),
                       hosts=((net.ns("p"), net.addr["p"]), (net.ns("d"), net.addr["d"])),
                       env=UCX_ENV)
    lock = e2e_lock()
    lock.acquire()
    try:
        # vLLM's start takes 2-3 minutes per engine on this loaded 2-core machine.
        st = LocalStack(spec, tmp_path_factory.mktemp("netns-stack"), startup_timeout_s=900)
        with st:
            yield st
    finally:
        lock.release()


@pytest.fixture(scope="module")
def indexer(net, stack, tmp_path_factory) -> Iterator[str]:
    cmd = [sys.executable, "-m", "kvtier.cli", "indexer", "--host", net.addr["ix"],
           "--port", str(INDEXER_PORT), "--model", MODEL, "--block-size", str(BS)]
    for i in stack.instances:
        s = i.spec
        cmd += ["--pod", (f"{s.name}={s.events_endpoint},replay={s.replay_endpoint},"
                          f"topic={s.topic}")]
    log = tmp_path_factory.mktemp("netns-indexer") / "indexer.log"
    proc = Proc(net, "ix", cmd, log, lines=False)
    url = f"http://{net.addr['ix']}:{INDEXER_PORT}"
    try:
        assert wait_until(lambda: _ok(f"{url}/healthz"), timeout=120), log.read_text()
        yield url
    finally:
        proc.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class Recording(httpx.AsyncBaseTransport):
    """Forwards to the real network and keeps every upstream request body."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[tuple[str, bytes]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append((str(request.url), await request.aread()))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _rx_bytes(net: Net, host: str) -> int:
    """Bytes received so far on ``host``'s veth (its only link to other hosts)."""
    out = subprocess.run(["ip", "-n", net.ns(host), "-j", "-s", "link", "show", "dev", "eth0"],
                         check=True, capture_output=True, text=True).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def _kv_bytes_per_token(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * \
        kv_dtype_bytes()


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def _params_sent(rec: Recording, url: str) -> list[dict]:
    """The kv_transfer_params of every upstream request to ``url`` so far."""
    out = []
    for u, body in rec.bodies:
        if u.startswith(url + "/v1/") and body:
            p = json.loads(body).get("kv_transfer_params")
            if p:
                out.append(p)
    return out


def _clear_prefill_cache(http: httpx.Client, p_url: str, indexer: str,
                         prompt: list[int]) -> None:
    """Reset P's prefix cache and wait until the indexer knows: vLLM publishes the clear on
    its next engine step (one short request, shorter than a block), and until it arrives the
    router would be told P still holds the reference's blocks (a "local" offer)."""
    reset_prefix_cache(http, p_url)
    http.post(p_url + "/v1/completions", json={"model": MODEL, "prompt": [7, 8, 9],
                                               "max_tokens": 1}).raise_for_status()

    def p_holds() -> int:
        r = http.post(indexer + "/v1/lookup", json={"model": MODEL, "token_ids": prompt})
        r.raise_for_status()
        return sum(m["matched_tokens"] for m in r.json()["matches"] if m["pod"] == "prefill-0")

    assert wait_until(lambda: p_holds() == 0, timeout=120), p_holds()


def test_turn2_reads_decode_kv_across_hosts(net, stack, indexer, tiny_model):
    P, D = stack.prefill[0].url, stack.decode[0].url
    a = net.addr
    assert P == f"http://{a['p']}:{stack.prefill[0].spec.http_port}"
    assert D == f"http://{a['d']}:{stack.decode[0].spec.http_port}"
    per_token = _kv_bytes_per_token(tiny_model)
    rec = Recording()
    insts = [{"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
             for i in stack.instances]
    cfg = RouterConfig.model_validate({"instances": insts, "port": 0, "log_json": False,
                                       "indexer": indexer, "block_size": BS})
    with RouterServer(cfg, transport=rec) as router, httpx.Client(timeout=600) as http:
        history: list[int] = []
        conv = "netns-two-turns"
        for turn in range(2):
            prompt = history + _ids(500 + turn, 150 if turn == 0 else 40)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "ignore_eos": True,
                    "return_token_ids": True, "temperature": 0}
            # single-instance recompute on P, its prefix cache reset around it
            _clear_prefill_cache(http, P, indexer, prompt)
            ref = http.post(P + "/v1/completions", json=body)
            ref.raise_for_status()
            _clear_prefill_cache(http, P, indexer, prompt)
            ext_p0 = metric(http, P, BY_SOURCE, source="external_kv_transfer")
            ext_d0 = metric(http, D, BY_SOURCE, source="external_kv_transfer")
            rx_p0, rx_d0 = _rx_bytes(net, "p"), _rx_bytes(net, "d")
            r = http.post(router.url + "/v1/completions",
                          json={**body, "conversation_id": conv})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"], \
                f"turn {turn + 1} differs from the single-instance recompute"
            ext_p = metric(http, P, BY_SOURCE, source="external_kv_transfer") - ext_p0
            ext_d = metric(http, D, BY_SOURCE, source="external_kv_transfer") - ext_d0
            rx_p, rx_d = _rx_bytes(net, "p") - rx_p0, _rx_bytes(net, "d") - rx_d0
            reuse = r.headers["x-kvtier-reuse"]
            print(f"turn {turn + 1}: x-kvtier-reuse={reuse!r} P external={ext_p:.0f} "
                  f"D external={ext_d:.0f} rx P eth0={rx_p} D eth0={rx_d} "
                  f"({per_token} KV bytes/token)", flush=True)
            # P->D crossed hosts: D loaded the prompt's KV from P, at P's address
            assert ext_d > 0, ext_d
            assert rx_d >= ext_d * per_token, (rx_d, ext_d, per_token)
            d_params = _params_sent(rec, D)[-1]
            assert d_params["remote_host"] == a["p"], d_params
            if turn == 0:
                assert reuse == "none; tokens=0", reuse
                assert ext_p == 0
            else:
                # D->P crossed hosts: P read the previous turn (prompt + generated) from D at
                # D's address, and the bytes came in over P's veth.
                assert reuse.startswith("dp_read;"), reuse
                p_params = _params_sent(rec, P)[-1]
                assert p_params["remote_host"] == a["d"], p_params
                assert ext_p >= len(history) - BS, (ext_p, len(history))
                assert rx_p >= ext_p * per_token, (rx_p, ext_p, per_token)
            history = prompt + out["choices"][0]["token_ids"]
        # Events crossed hosts: the indexer (its own namespace) holds both engines' blocks,
        # and the router reached it for every request.
        look = http.post(indexer + "/v1/lookup", json={"model": MODEL, "token_ids": history})
        assert look.status_code == 200, look.text
        pods = {m["pod"] for m in look.json()["matches"] if m["matched_tokens"] > 0}
        assert pods == {"prefill-0", "decode-0"}, look.json()
        assert metric(http, router.url, "kvtier_router_indexer_unavailable_total") == 0
