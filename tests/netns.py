"""Network namespaces for the many-hosts tests (``ip netns`` + veth + a bridge).

``Net`` makes one namespace per "host", each with its own address on one bridge (the bridge
lives in a hub namespace of its own), and optionally a veth from the root namespace onto that
bridge so processes in the root namespace (the test itself, an in-process router) reach every
host. ``Proc`` runs a process in one of them. Used by tests/integration/test_indexer_netns.py
and tests/e2e/test_netns_pd.py. ``make_net`` skips the test, saying why, only where
``ip netns add`` is refused (not root, no CAP_SYS_ADMIN).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Net:
    """Namespaces ``{tag}-{host}`` on one bridge (in ``{tag}-hub``), 10.R.S.i/24 each."""

    def __init__(self, hosts: tuple[str, ...]) -> None:
        self.tag = f"kvt{secrets.token_hex(3)}"
        r = secrets.randbelow(50)
        self.prefix = f"10.{200 + r}.{secrets.randbelow(250) + 1}"
        self.made: list[str] = []
        self.addr: dict[str, str] = {}
        self.root_link: str | None = None
        hub = self._ns("hub")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, h in enumerate(hosts, 1):
            ns = self._ns(h)
            port = f"p{i}{self.tag}"[:15]
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                "netns", hub)
            self.addr[h] = f"{self.prefix}.{i}"
            _ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", hub, "link", "set", port, "master", "br0")
            _ip("-n", hub, "link", "set", port, "up")

    def _ns(self, h: str) -> str:
        ns = f"{self.tag}-{h}"
        _ip("netns", "add", ns)
        self.made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def ns(self, h: str) -> str:
        return f"{self.tag}-{h}"

    def attach_root(self) -> str:
        """A veth from the root namespace onto the bridge, ``{prefix}.254/24`` on the root
        end (removed with the hub namespace); returns that address."""
        self.root_link = f"r{self.tag}"[:15]
        peer = f"h{self.tag}"[:15]
        hub = self.ns("hub")
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", peer, "netns", hub)
        self.addr["root"] = f"{self.prefix}.254"
        _ip("addr", "add", f"{self.addr['root']}/24", "dev", self.root_link)
        _ip("link", "set", self.root_link, "up")
        _ip("-n", hub, "link", "set", peer, "master", "br0")
        _ip("-n", hub, "link", "set", peer, "up")
        return self.addr["root"]

    def default_route(self, h: str) -> None:
        _ip("-n", self.ns(h), "route", "add", "default", "dev", "eth0")

    def link(self, h: str, up: bool) -> None:
        _ip("-n", self.ns(h), "link", "set", "eth0", "up" if up else "down")

    def close(self) -> None:
        if self.root_link is not None:
            subprocess.run(["ip", "link", "del", self.root_link], check=False,
                           capture_output=True)
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def make_net(hosts: tuple[str, ...]) -> Net:
    """``Net(hosts)``, or skip the test (printing why) where ``ip netns add`` is refused."""
    try:
        return Net(hosts)
    except RuntimeError as e:
        if "netns add" in str(e):
            print(f"SKIPPED: network namespaces refused here: {e}", flush=True)
            pytest.skip(f"ip netns refused on this machine: {e}")
        raise


class Proc:
    """A process in a namespace speaking JSON lines (a line "ready" first) or just running (a
    daemon)."""

    def __init__(self, net: Net, host: str, argv: list[str], log: Path, lines: bool = True,
                 env: dict[str, str] | None = None) -> None:
        self.log = log
        self._err = log.open("wb")
        self.p = subprocess.Popen(["ip", "netns", "exec", net.ns(host), *argv], cwd=REPO,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE if lines
                                  else self._err, stderr=self._err, text=True,
                                  env={**os.environ, **(env or {})})
        if lines:
            assert self._read() == "ready", f"{argv[3:5]}: {log.read_text()}"

    def _read(self) -> Any:
        """The next JSON line (libraries such as NIXL also log to stdout: skipped)."""
        assert self.p.stdout is not None
        while True:
            line = self.p.stdout.readline()
            assert line, f"process ended: {self.log.read_text()}"
            if line.startswith(('"', "{")):
                return json.loads(line)

    def ask(self, cmd: dict[str, Any]) -> Any:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.poll() is None:
            if self.p.stdin:
                self.p.stdin.close()
            self.p.terminate()
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=5)
        self._err.close()
