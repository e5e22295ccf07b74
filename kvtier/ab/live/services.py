"""The router and the indexer of a live run, each a process of its own, as users deploy them.

A strategy's local stack (`kvtier.ab.live.runner.run_strategy`) is served through
``kvtier router --config FILE`` and, when the strategy uses it, ``kvtier indexer --config
FILE``: not threads of the harness, whose conversation threads and sampler would share the
router's interpreter and its GIL (a fresh-clone demo logged router event-loop stalls of 1-2 s
while the router's thread used no CPU: it waited, and every TTFT it served waited too).

- `router_config` / `indexer_config`: the config a strategy's run gives each (the files are
  written into the run's log directory, next to each process's log);
- `start_service`: start one (``kvtier`` next to this interpreter, in the run's own process
  group, so an interrupt reaches it too), wait until it answers over HTTP, and stop it on
  exit: SIGTERM, then SIGKILL after ``stop_s``;
- `router_stalls`: the router's event-loop stalls over its life (the run), from its
  ``kvtier_router_event_loop_stall_seconds`` histogram and its watchdog's warning lines
  (``kvtier.ab.live.probes.RouterLog``).

Threading model: called from the runner's thread; each service is a child process, and
nothing here starts a thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtier.ab.live.scrape import histogram
from kvtier.devstack.stack import LocalStack

log = logging.getLogger("kvtier.ab")

STALLS = "kvtier_router_event_loop_stall_seconds"


class ServiceError(RuntimeError):
    """A service process exited or did not answer in time (its log's tail is in the text)."""


@dataclass(frozen=True)
class Service:
    """One running service process: where it answers and what it was started with."""

    name: str               # "router" | "indexer"
    url: str
    command: tuple[str, ...]
    config: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def describe(self) -> dict[str, Any]:
        """What the report keeps (``meta["services"][name]``)."""
        return {"pid": self.proc.pid, "command": " ".join(self.command), "url": self.url,
                "config": str(self.config), "log": str(self.log)}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the service binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def kvtier_command() -> list[str]:
    """The ``kvtier`` entry point this interpreter installed (``python -m kvtier.cli`` when
    there is none next to it)."""
    exe = Path(sys.executable).parent / "kvtier"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("kvtier")
    return [found] if found else [sys.executable, "-m", "kvtier.cli"]


def indexer_config(stack: LocalStack, model_name: str, block_size: int,
                   port: int) -> dict[str, Any]:
    """The indexer's config for ``stack``: every instance's host-tier event stream."""
    pods = [{"name": i.spec.name, "events": f"tcp://127.0.0.1:{i.spec.tier_events_port}",
             "replay": f"tcp://127.0.0.1:{i.spec.tier_replay_port}",
             "p2p": f"127.0.0.1:{i.spec.tier_p2p_port}"} for i in stack.instances]
    return {"host": "127.0.0.1", "port": port, "pods": pods, "default_model": model_name,
            "block_size": block_size}


def router_config(instances: list[dict[str, Any]], indexer: str | None, model_name: str,
                  block_size: int, turn_timeout_s: float, port: int,
                  settings: dict[str, Any]) -> dict[str, Any]:
    """The router's config for a run: the stack's ``instances``, the indexer (None: none),
    and the strategy's ``settings`` (``StrategySpec.router_settings``)."""
    return {
        "instances": instances, "indexer": indexer,
        "indexer_model": model_name if indexer else None,
        "host": "127.0.0.1", "port": port, "block_size": block_size,
        # JSON lines: the runner reads each turn's ``served`` line from the log file.
        "log_json": True, "log_requests": True,
        # A slow prefill is the measurement, not a fault: no leg times out before the turn
        # itself would.
        "timeouts": {"prefill_s": turn_timeout_s, "decode_idle_s": turn_timeout_s},
        # Turns are sent whole: decode answers non-streamed, with the kv_transfer_params
        # that say what D retained; no decode node needs a params feed.
        "stream_capture": "buffered",
        **settings}


@contextlib.contextmanager
def start_service(name: str, config: dict[str, Any], log_dir: Path,
                  ready: Callable[[httpx.Client, str], bool], timeout_s: float = 60.0,
                  stop_s: float = 10.0) -> Iterator[Service]:
    """``kvtier NAME --config FILE`` (``config`` written as ``LOG_DIR/NAME.json``, its output
    in ``LOG_DIR/NAME.log``; ``NAME-2.*``, ``NAME-3.*``, ... for a later run in the same
    directory, a repeat), yielded once ``ready(client, url)`` is true; stopped on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stem, n = name, 1
    while (log_dir / f"{stem}.log").exists() or (log_dir / f"{stem}.json").exists():
        n += 1
        stem = f"{name}-{n}"
    cfg_path = log_dir / f"{stem}.json"
    cfg_path.write_text(json.dumps(config, indent=1))
    log_path = log_dir / f"{stem}.log"
    cmd = (*kvtier_command(), name, "--config", str(cfg_path))
    url = f"http://{config.get('host', '127.0.0.1')}:{config['port']}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,  # noqa: S603
                                stdin=subprocess.DEVNULL, env=env)
    svc = Service(name, url, cmd, cfg_path, log_path, proc)
    try:
        _await_ready(svc, ready, timeout_s)
        log.info("%s: pid %d at %s (log %s)", name, proc.pid, url, log_path)
        yield svc
    finally:
        stop(proc, stop_s)


def _await_ready(svc: Service, ready: Callable[[httpx.Client, str], bool],
                 timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as c:
        while True:
            if svc.proc.poll() is not None:
                raise ServiceError(f"{svc.name} exited with {svc.proc.returncode} before it "
                                   f"answered; its log ends:\n{tail(svc.log)}")
            try:
                if ready(c, svc.url):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise ServiceError(f"{svc.name} did not answer at {svc.url} within "
                                   f"{timeout_s:g} s; its log ends:\n{tail(svc.log)}")
            time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], stop_s: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL when it has not exited after ``stop_s``. False (logged, not
    raised) when it has not exited ``stop_s`` after SIGKILL either: a process stuck in the
    kernel (a host-scarce run's router, after its replay had finished, 2026-12-07) dies when
    the kernel lets it, and the run it served is measured; raising here discarded that
    strategy's every repeat."""
    if proc.poll() is not None:
        return True
    proc.terminate()
    try:
        proc.wait(timeout=stop_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
    try:
        proc.wait(timeout=stop_s)
        return True
    except subprocess.TimeoutExpired:
        log.error("pid %d (%s) has not exited %g s after SIGKILL (stuck in the kernel?); "
                  "going on without it", proc.pid, str(proc.args)[:200],
                  stop_s)
        return False


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def answers_healthz(c: httpx.Client, url: str) -> bool:
    """The service answers ``/healthz`` with 200 (a router: its instances are admitted)."""
    return c.get(f"{url}/healthz").status_code == 200


def streams_connected(c: httpx.Client, url: str) -> bool:
    """Every event stream of every pod the indexer follows is connected (``/v1/pods``)."""
    pods = c.get(f"{url}/v1/pods").json().get("pods") or {}
    return all(st.get("connected") for p in pods.values()
               for st in (p.get("streams") or {"": p}).values())


def await_indexer_streams(url: str, timeout_s: float = 15.0, settle_s: float = 0.3) -> bool:
    """Wait until the indexer's every event stream is connected, plus ``settle_s`` for the
    subscription to travel (a PUB drops what it publishes before a SUB joined: a turn
    replayed earlier would go missing from the host bytes); False and a warning on timeout."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as c:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if streams_connected(c, url):
                    time.sleep(settle_s)
                    return True
            time.sleep(0.05)
    log.warning("indexer: event streams not all connected after %.0f s; host bytes held may "
                "be undercounted", timeout_s)
    return False


def router_stalls(metrics_text: str | None, warnings: list[str],
                  longest: float | None) -> dict[str, Any]:
    """``meta["router_stalls"]``: the router's event-loop stalls over its life (this run):
    ``count`` and ``total_s`` from its histogram (None: ``/metrics`` not readable),
    ``longest_s`` from its watchdog's lines, and those ``warnings``."""
    count = total = None
    if metrics_text is not None:
        with contextlib.suppress(ValueError):
            h = histogram(metrics_text, STALLS)
            count, total = int(h["count"]), float(h["sum"])
    return {"count": count, "total_s": total, "longest_s": longest, "warnings": warnings}
