"""Many hosts: publishers, the indexer, a querying "router" and a peer fetch, each in its own
network namespace with its own address (``ip netns`` + veth + a bridge, made here, torn down
after).

Hosts (one namespace each, 10.R.S.0/24 on one bridge in a hub namespace):

- ``pf`` (prefill host): pod ``pf``'s engine stream and host-tier stream (one pod, two
  streams); later the peer-fetch consumer; no default route;
- ``dc`` (decode host, with a default route): pod ``dc``'s host-tier stream and its host
  tier's peer server (NIXL), listening on the address its ``HostTierConfig`` resolved with no
  ``p2p_host`` and no ``KVTIER_P2P_HOST`` (detected: the namespace's own, never loopback);
  that advertised address is what the indexer's ``p2p=`` names and the fetch reaches;
- ``ix``: ``kvtier indexer`` (listening on its own address, peers from ``--pod`` specs);
- ``rt``: the client that asks ``/v1/route`` as the router does.

Shows events, lookups and a peer fetch crossing hosts, and a host that drops off the
network (link down: no FIN, only ZMTP heartbeats notice) being taken out of the sources and
coming back. The peer-address resolution of kvtier.tier.config per host: the default
route's source address (dc), an interface's address without a default route (pf), and a
KVTIER_P2P_HOST naming another host's address refused. D->P reads need vLLM engines: not
covered here (tests/e2e; engines in namespaces cost minutes of start-up per engine on CPU).

Skipped only where ``ip netns add`` is refused (not root, no CAP_SYS_ADMIN); the reason is
printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_until
from tests.netns import REPO, Net, Proc, make_net

pytestmark = pytest.mark.integration
BS = 4
HOSTS = ("pf", "dc", "ix", "rt")

# One helper program, several roles; each reads commands as JSON lines on stdin and answers
# on stdout (a line "ready" first).
HELPER = r'''
import json, sys, threading
sys.path.insert(0, ".")
role, host = sys.argv[1], sys.argv[2]


def out(obj):
    print(json.dumps(obj), flush=True)


if role == "pubs":                      # argv[3:]: NAME:PORT:REPLAYPORT:TOPIC ...
    from tests.integration.test_indexer_subscriber import Prompt, Publisher
    pubs = {}
    for spec in sys.argv[3:]:
        name, port, rport, topic = spec.split(":")
        pubs[name] = Publisher(topic=topic, host=host, port=int(port), replay_port=int(rport))
    out("ready")
    for line in sys.stdin:
        cmd = json.loads(line)         # {"pub": NAME, "prompt": [start, nblocks], "lo", "hi", "medium"}
        pr = Prompt(*cmd["prompt"])
        pubs[cmd["pub"]].publish([pr.stored(cmd["lo"], cmd["hi"], cmd["medium"])])
        out("ok")
elif role in ("peer-source", "peer-fetch"):
    import numpy as np
    from kvtier.hashing import RequestKeyHasher
    from kvtier.ids import ModelName
    from kvtier.tier.manager import HostTier
    from kvtier.tier.nixl import NixlPool
    from kvtier.tier.pool import HostPool
    from kvtier.wire.peer import Identity
    SLOT = 4096
    nblocks, bs = int(sys.argv[3]), int(sys.argv[4])
    keys = RequestKeyHasher(ModelName("m"), bs).keys(list(range(nblocks * bs)))
    ident = Identity("m", bs, 0, "netns-test", SLOT)
    pattern = lambda i: np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)
    pool, tier, lock = HostPool(16, SLOT), HostTier(16, SLOT), threading.RLock()
    if role == "peer-source":                # argv[5]: KVTIER_P2P_PORT
        import os
        from kvtier.tier.config import HostTierConfig, resolve_p2p_host
        from kvtier.tier.peer import PeerServer
        job = tier.prepare_store(keys)
        for i, slot in enumerate(job.slots):
            pool.array[slot] = pattern(i)
        tier.complete_store(job.job_id, True)
        # as the connector does: the file names no host, the environment no KVTIER_P2P_HOST
        env = {**os.environ, "KVTIER_P2P_PORT": sys.argv[5]}
        cfg = HostTierConfig.from_extra_config({"peer_fetch": True}).resolved(env)
        server = PeerServer(tier, lock, NixlPool(pool, "source"), ident, cfg.p2p_host,
                            cfg.p2p_port)
        out("ready")
        for line in sys.stdin:                 # {} -> the advertised address
            out({"p2p_host": cfg.p2p_host, "p2p_port": cfg.p2p_port,
                 "how": resolve_p2p_host(None, env)[1]})
        server.close()
    else:
        from kvtier.tier.peer import PeerClient
        client = PeerClient(tier, lock, NixlPool(pool, "consumer"), ident, timeout_s=20.0)
        out("ready")
        for line in sys.stdin:
            cmd = json.loads(line)     # {"host", "port"}
            res = client.fetch(cmd["host"], cmd["port"], keys)
            same = all(np.array_equal(pool.array[tier.slot_of(k)], pattern(i))
                       for i, k in enumerate(keys[:res.blocks]))
            out({"blocks": res.blocks, "fetched": res.fetched, "reason": res.reason,
                 "identical": same})
elif role == "resolve":                # kvtier.tier.config's peer address here, then exit
    from kvtier.tier.config import resolve_p2p_host
    try:
        addr, how = resolve_p2p_host(None, json.loads(sys.argv[3]))
        out({"p2p_host": addr, "how": how})
    except ValueError as e:
        out({"error": str(e)})
elif role == "query":                  # argv[3]: base URL
    import httpx
    out("ready")
    with httpx.Client(timeout=10) as c:
        for line in sys.stdin:
            cmd = json.loads(line)     # {"method", "path", "body"}
            try:
                r = c.request(cmd["method"], sys.argv[3] + cmd["path"], json=cmd.get("body"))
                out({"status": r.status_code, "json": r.json()})
            except httpx.HTTPError as e:
                out({"status": 0, "json": {"error": repr(e)}})
'''


@pytest.fixture()
def net():
    n = make_net(HOSTS)
    try:
        yield n
    finally:
        n.close()


def helper(net: Net, host: str, role: str, *args: str, log: Path, **kw: Any) -> Proc:
    return Proc(net, host, [sys.executable, "-c", HELPER, role, net.addr[host], *args],
                log, **kw)


def resolve_in(net: Net, host: str, env: dict[str, str]) -> dict[str, Any]:
    """kvtier.tier.config's peer address as a process in ``host`` resolves it from ``env``."""
    r = subprocess.run(["ip", "netns", "exec", net.ns(host), sys.executable, "-c", HELPER,
                        "resolve", net.addr[host], json.dumps(env)],
                       cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0 and lines, r.stderr
    return json.loads(lines[-1])


def test_events_lookups_and_peer_fetch_cross_hosts(net, tmp_path, monkeypatch):
    a = net.addr
    procs: list[Proc] = []
    monkeypatch.delenv("KVTIER_P2P_HOST", raising=False)   # the tiers detect their address
    net.default_route("dc")
    try:
        pf = helper(net, "pf", "pubs", "eng:5557:5558:kv@pf", "host:5600:5601:kv@pf-host",
                    log=tmp_path / "pf.log")
        procs.append(pf)
        dc = helper(net, "dc", "pubs", "host:5600:5601:kv@dc-host", log=tmp_path / "dc.log")
        procs.append(dc)
        # published before the indexer exists: it gets them by replay over the network
        assert pf.ask({"pub": "eng", "prompt": [0, 8], "lo": 0, "hi": 3, "medium": "GPU"}) == "ok"
        assert pf.ask({"pub": "host", "prompt": [0, 8], "lo": 0, "hi": 5, "medium": "CPU"}) == "ok"
        assert dc.ask({"pub": "host", "prompt": [0, 8], "lo": 0, "hi": 8, "medium": "CPU"}) == "ok"
        src = helper(net, "dc", "peer-source", "8", str(BS), "7100", log=tmp_path / "src.log",
                     env={"UCX_TLS": "tcp,self"})
        procs.append(src)
        # 0. each host's tier advertises the host's own address, detected, never loopback
        adv = src.ask({})
        assert (adv["p2p_host"], adv["p2p_port"]) == (a["dc"], 7100), adv
        assert adv["how"].startswith("detected: the default route"), adv
        pf_addr = resolve_in(net, "pf", {})
        assert pf_addr["p2p_host"] == a["pf"], pf_addr
        assert pf_addr["how"].startswith("detected: a network interface"), pf_addr
        assert resolve_in(net, "pf", {"KVTIER_P2P_HOST": a["pf"]}) == \
            {"p2p_host": a["pf"], "how": "KVTIER_P2P_HOST"}
        err = resolve_in(net, "pf", {"KVTIER_P2P_HOST": a["dc"]})["error"]
        assert f"KVTIER_P2P_HOST='{a['dc']}'" in err and "not an address of this host" in err
        dc_p2p = f"{adv['p2p_host']}:{adv['p2p_port']}"      # what dc's deployment registers
        pods = [f"pf=tcp://{a['pf']}:5557,replay=tcp://{a['pf']}:5558,topic=kv@pf",
                (f"pf=tcp://{a['pf']}:5600,replay=tcp://{a['pf']}:5601,"
                 f"p2p={pf_addr['p2p_host']}:7100,topic=kv@pf-host,stream=host"),
                (f"dc=tcp://{a['dc']}:5600,replay=tcp://{a['dc']}:5601,p2p={dc_p2p},"
                 "topic=kv@dc-host")]
        cmd = [sys.executable, "-m", "kvtier.cli", "indexer", "--host", a["ix"], "--port", "8300",
               "--model", "m", "--block-size", str(BS), "--stale-after", "1"]
        for p in pods:
            cmd += ["--pod", p]
        procs.append(Proc(net, "ix", cmd, tmp_path / "indexer.log", lines=False))
        rt = helper(net, "rt", "query", f"http://{a['ix']}:8300", log=tmp_path / "rt.log")
        procs.append(rt)

        def get(path: str) -> dict[str, Any]:
            return rt.ask({"method": "GET", "path": path})

        def route(target: str) -> dict[str, Any]:
            toks = list(range(8 * BS))
            r = rt.ask({"method": "POST", "path": "/v1/route",
                        "body": {"model": "m", "token_ids": toks, "target_pod": target}})
            assert r["status"] == 200, r
            return r["json"]

        assert wait_until(lambda: get("/healthz")["status"] == 200, timeout=60), \
            (tmp_path / "indexer.log").read_text()
        # 1. events crossed: both hosts' blocks, pf's two streams merged into one pod
        assert wait_until(lambda: len(route("pf")["matches"]) == 3, timeout=30)
        r = route("pf")
        assert r["matches"] == [{"pod": "dc", "tier": "CPU", "matched_tokens": 32},
                                {"pod": "pf", "tier": "CPU", "matched_tokens": 20},
                                {"pod": "pf", "tier": "GPU", "matched_tokens": 12}]
        # 2. the source is the other host, at the address from its spec
        assert r["source"] == {"pod": "dc", "tier": "CPU", "matched_tokens": 32,
                               "p2p_host": a["dc"], "p2p_port": 7100}
        assert r["target_matched_tokens"] == 20 and r["delta"] == 12
        assert route("dc")["source"] is None          # never itself; pf holds less
        # 3. a live event crosses too
        assert pf.ask({"pub": "host", "prompt": [0, 8], "lo": 5, "hi": 8, "medium": "CPU"}) == "ok"
        assert wait_until(lambda: route("pf")["target_matched_tokens"] == 32, timeout=30)
        assert route("pf")["source"] is None          # delta 0 now
        # 4. peer fetch from pf's host, at the address the indexer gave: dc's advertised one
        fetch = helper(net, "pf", "peer-fetch", "8", str(BS), log=tmp_path / "fetch.log",
                       env={"UCX_TLS": "tcp,self"})
        procs.append(fetch)
        got = fetch.ask({"host": r["source"]["p2p_host"], "port": r["source"]["p2p_port"]})
        assert got == {"blocks": 8, "fetched": 8, "reason": None, "identical": True}, got
        # 5. dc's host drops off the network (no FIN): heartbeats notice, it stops being a
        #    source once stale; back on the network it reconnects, replays, is offered again
        assert route("nobody")["source"]["pod"] == "dc"         # equal length: by name
        net.link("dc", up=False)
        assert wait_until(lambda: get("/healthz")["json"]["pods"]["dc"]["stale"], timeout=30)
        assert route("pf")["matches"][0]["pod"] in ("dc", "pf")  # still indexed
        assert route("nobody")["source"]["pod"] == "pf"         # but not offered
        net.link("dc", up=True)
        assert wait_until(lambda: not get("/healthz")["json"]["pods"]["dc"]["stale"],
                          timeout=60), (tmp_path / "indexer.log").read_text()
        assert get("/healthz")["json"]["pods"]["dc"]["connected"]
        assert route("nobody")["source"]["pod"] == "dc"         # longest again (by name)
        log = (tmp_path / "indexer.log").read_text()
        assert "127.0.0.1" not in log
    finally:
        for p in reversed(procs):
            p.close()
