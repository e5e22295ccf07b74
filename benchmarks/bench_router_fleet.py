"""The processes of ``benchmarks/bench_router.py`` (not run on its own): fake engines,
proxies, and the lean P->D proxy it compares against.

``Fleet`` starts the fake vLLM P/D engines (``tests/fakes/engine.py``, run as a script: the
benchmark uses the tests' one fake engine) and every proxy target, each in its own session
and log file under the run's directory, pinned with ``taskset`` where asked; ``proxies``
starts every target on one engine pair. ``serve_minimal_proxy`` is the lean proxy
(``bench_router.py --serve-minimal-proxy`` runs it in a process of its own).
``vllm_router_bin`` finds (or installs, into a venv of the benchmark's own under
``.kvtier/``) vLLM's Rust router, ``vllm-router`` from PyPI. Every fake engine writes a
ledger (``--ledger``: one line per leg answered in full); ``Ledger`` counts the lines a
measurement added, so a target that skipped a leg shows it.

Threading model: one caller (the benchmark's main thread) owns a ``Fleet``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvtier.runtime import free_ports

HERE = Path(__file__).resolve().parent
PY = sys.executable
FAKE_ENGINE = HERE.parent / "tests" / "fakes" / "engine.py"
VLLM_ROUTER_VERSION = "0.1.17"
VLLM_ROUTER_VENV = HERE.parent / ".kvtier" / "bench-vllm-router"


def free_port() -> int:
    return free_ports(1)[0]


def spawn(argv: list[str], log: Path, cpus: str | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    if cpus and shutil.which("taskset"):
        argv = ["taskset", "-c", cpus, *argv]
    fh = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


# ---- a lean P->D proxy (the stand-in for vLLM's toy proxy) --------------------------------
def serve_minimal_proxy(port: int, prefill: str, decode: str) -> None:
    """Prefill leg (max_tokens=1, do_remote_decode), then relay decode's stream. No
    validation, metrics, retries or reuse: what the example proxies do."""
    import itertools

    import aiohttp
    from aiohttp import web

    ids = itertools.count()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        s: aiohttp.ClientSession = request.app["s"]
        rid = f"min-{next(ids)}"
        pre = {**body, "max_tokens": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True}}
        pre.pop("stream_options", None)
        async with s.post(prefill + request.path, json=pre,
                          headers={"x-request-id": rid}) as r:
            kvp = (await r.json()).get("kv_transfer_params")
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        async with s.post(decode + request.path, json={**body, "kv_transfer_params": kvp},
                          headers={"x-request-id": rid}) as r:
            async for chunk in r.content.iter_any():
                await out.write(chunk)
        await out.write_eof()
        return out

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(app: web.Application) -> None:
        app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["s"].close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    app.router.add_get("/healthz", health)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---- the fleet --------------------------------------------------------------------------
class Ledger:
    """The legs the fake engines answered, counted per measurement: ``take()`` gives the
    lines added since the last call, by kind (``P`` prefill, ``D`` decode given a prefill's
    params, ``X`` a leg that was neither) and ``mismatch`` (a decode given the params of
    another request's prefill; see ``tests/fakes/engine.py``'s ``read_ledger``)."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}

    def add(self, path: Path) -> None:
        path.write_text("")
        self.offsets[path] = 0

    def take(self) -> dict[str, int]:
        out = {"P": 0, "D": 0, "X": 0, "mismatch": 0}
        for path, off in self.offsets.items():
            with open(path, "rb") as f:
                f.seek(off)
                data = f.read()
            # Only whole lines: one being written now is counted next time.
            end = data.rfind(b"\n") + 1
            self.offsets[path] = off + end
            for line in data[:end].splitlines():
                parts = line.split()
                if len(parts) != 4:
                    continue
                kind = parts[0].decode()
                out[kind] = out.get(kind, 0) + 1
                if parts[3] == b"mismatch":
                    out["mismatch"] += 1
        return out


def legs_ok(legs: dict[str, int], answers: int, errors: int) -> bool:
    """One prefill and one decode leg per answer: every answer had both, no leg of
    another kind, no decode with another request's params; a failed request may or may
    not have left legs behind."""
    return (legs["X"] == 0 and legs["mismatch"] == 0
            and answers <= legs["P"] <= answers + errors
            and answers <= legs["D"] <= answers + errors)


class Fleet:
    def __init__(self, tmp: Path, router_cpus: str | None, engine_cpus: str | None) -> None:
        self.tmp, self.router_cpus, self.engine_cpus = tmp, router_cpus, engine_cpus
        self.procs: list[subprocess.Popen] = []
        self.ledger = Ledger()

    def engine(self, name: str, *extra: str) -> str:
        port = free_port()
        ledger = self.tmp / f"{name}.ledger"
        self.ledger.add(ledger)
        self.procs.append(spawn([PY, str(FAKE_ENGINE), "--tokens", "16",
                                 "--port", str(port), "--name", name,
                                 "--ledger", str(ledger), *extra],
                                self.tmp / f"{name}.log", self.engine_cpus))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url

    def pair(self, tag: str, delay_ms: float = 0.0) -> tuple[str, dict[str, str]]:
        """A prefill fake and a decode fake that publishes kvtier's params feed: (prefill
        URL, the decode instance as a router config entry)."""
        extra = ("--token-delay-ms", str(delay_ms)) if delay_ms else ()
        p = self.engine(f"P{tag}", *extra)
        feed = f"tcp://127.0.0.1:{free_port()}"
        d = self.engine(f"D{tag}", "--params-feed", feed, *extra)
        return p, {"name": "decode-0", "url": d, "params_feed": feed}

    def proxy(self, name: str, argv: list[str], port: int, cpus: str | None = None,
              env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
        p = spawn(argv, self.tmp / f"{name}.log", cpus or self.router_cpus, env)
        self.procs.append(p)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/healthz", timeout=1)
                return p, url
            except httpx.HTTPError:
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start (see {self.tmp}/{name}.log)")
                time.sleep(0.1)

    def kvtier(self, name: str, p: str, d: str | dict[str, str], cpus: str | None = None,
               env: dict[str, str] | None = None, **cfg: Any) -> tuple[subprocess.Popen, str]:
        """``d``: a URL (no params feed) or a decode instance entry (``pair``)."""
        port = free_port()
        f = self.tmp / f"{name}.json"
        f.write_text(json.dumps({"prefill": [p], "decode": [d], "port": port, **cfg}))
        return self.proxy(name, [PY, "-m", "kvtier.cli", "router", "--config", str(f)], port,
                          cpus, env)

    def stop(self, p: subprocess.Popen) -> None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.stop(p)


DEFAULT_ANCHOR = HERE / "anchors" / "toy_proxy_server.py"


def anchor_argv(path: str) -> list[str]:
    """vLLM's toy proxy, pointed at the fakes through its own CLI."""
    return [PY, path, "--host", "127.0.0.1", "--port", "{port}",
            "--prefiller-host", "127.0.0.1", "--prefiller-port", "{prefill_port}",
            "--decoder-host", "127.0.0.1", "--decoder-port", "{decode_port}"]


def vllm_router_bin(spec: str, log: Path) -> tuple[str | None, dict[str, Any]]:
    """vLLM's Rust router, ``vllm-router`` (PyPI): ``spec`` a path to its executable,
    ``none``, or ``auto``: the benchmark's own venv (``VLLM_ROUTER_VENV``), created and
    ``pip install vllm-router==VLLM_ROUTER_VERSION`` into it when missing (never into the
    project's venv). Returns (executable or None, what was found or why not)."""
    if spec == "none":
        return None, {"skipped": "--vllm-router none"}
    if spec != "auto":
        return (spec, {"bin": spec}) if Path(spec).is_file() else (
            None, {"error": f"{spec}: no such file"})
    exe = VLLM_ROUTER_VENV / "bin" / "vllm-router"
    if not exe.is_file():
        with open(log, "ab") as fh:
            steps = [[sys.executable, "-m", "venv", str(VLLM_ROUTER_VENV)],
                     [str(VLLM_ROUTER_VENV / "bin" / "pip"), "install", "-q",
                      f"vllm-router=={VLLM_ROUTER_VERSION}"]]
            for argv in steps:
                if subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT,
                                  check=False).returncode != 0:
                    return None, {"error": f"{shlex.join(argv)} failed (see {log})"}
    ver = subprocess.run([str(VLLM_ROUTER_VENV / "bin" / "pip"), "show", "vllm-router"],
                         capture_output=True, text=True, check=False).stdout
    version = next((line.split(":", 1)[1].strip() for line in ver.splitlines()
                    if line.startswith("Version:")), "?")
    return str(exe), {"bin": str(exe), "version": version}


def vllm_router_argv(exe: str) -> list[str]:
    """``vllm-router`` at its defaults in vLLM's P/D mode, pointed at the fakes."""
    return [exe, "--vllm-pd-disaggregation", "--prefill", "{prefill}", "--decode", "{decode}",
            "--host", "127.0.0.1", "--port", "{port}"]


def proxies(fleet: Fleet, a: argparse.Namespace, p_url: str, d: dict[str, str],
            tag: str, passthrough: bool) -> dict[str, tuple[str, int]]:
    """Every proxy target on one engine pair: name -> (base URL, pid)."""
    d_url = d["url"]
    out: dict[str, tuple[str, int]] = {}
    kp, u = fleet.kvtier(f"kvtier{tag}", p_url, d)
    out["kvtier"] = (u, kp.pid)
    if passthrough:
        kp, u = fleet.kvtier(f"kvtier-pass{tag}", p_url, d_url, stream_capture="passthrough")
        out["kvtier-pass"] = (u, kp.pid)
    specs = list(a.proxy)
    if a.anchor != "none" and Path(a.anchor).is_file():
        specs.insert(0, "vllm-toy=" + shlex.join(anchor_argv(a.anchor)))
    if getattr(a, "vllm_router_exe", None):
        specs.insert(0, "vllm-router=" + shlex.join(vllm_router_argv(a.vllm_router_exe)))
    for spec in specs:
        name, _, cmd = spec.partition("=")
        port = free_port()
        argv = [x.format(port=port, prefill=p_url, decode=d_url,
                         prefill_port=p_url.rsplit(":", 1)[1],
                         decode_port=d_url.rsplit(":", 1)[1]) for x in shlex.split(cmd)]
        pp, u = fleet.proxy(f"{name}{tag}", argv, port)
        out[name] = (u, pp.pid)
    if not a.no_minimal:
        port = free_port()
        mp, u = fleet.proxy(f"minimal{tag}", [PY, str(HERE / "bench_router.py"),
                                              "--serve-minimal-proxy", str(port), p_url,
                                              d_url], port)
        out["minimal"] = (u, mp.pid)
    return out


def hiredis_state(env: dict[str, str] | None) -> bool:
    out = subprocess.run([PY, "-c", "import redis.utils as u; print(u.HIREDIS_AVAILABLE)"],
                         check=False, capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    return out.stdout.strip() == "True"
