"""A local prefill/decode fleet of real vLLM servers: start, watch, stop.

``LocalStack`` starts N prefill and M decode vLLM-CPU (or CUDA) servers, each
with its own HTTP port, NIXL side channel, ZMQ KV-event PUB and replay ports,
waits until every one answers ``/health``, keeps one log file per process,
and tears the whole process group of each server down on ``stop()``, on
Ctrl-C, on SIGTERM (``kvtier.runtime.unwind_on_sigterm``) and at interpreter exit. It only
spawns processes: it never imports vllm (vLLM runs in the child interpreter).

Threading model: a stack is driven by one thread. ``stop()`` is idempotent
and safe to call from a signal handler or ``atexit``.
"""
from __future__ import annotations

import atexit
import logging
import os
import shlex
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.devstack.placement import no_transparent_hugepages
from kvtier.devstack.platform import is_cpu_platform
from kvtier.devstack.spec import InstanceSpec, StackSpec
from kvtier.ids import Role
from kvtier.runtime import unwind_on_sigterm

log = logging.getLogger(__name__)
@dataclass
class RunningInstance:
    spec: InstanceSpec
    proc: subprocess.Popen
    log_path: Path
    log_offset: int = 0  # where this process's output starts (logs append across restarts)
    placed: bool = False  # its thread placement was fixed (LocalStack._place)

    @property
    def url(self) -> str:
        return self.spec.url

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self.log_offset)
                lines = fh.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class StackStartError(RuntimeError):
    def __init__(self, message: str, hung: bool = False) -> None:
        super().__init__(message)
        self.hung = hung  # alive but never ready (not a crash, not a fatal log line)


PORT_TAKEN = "Address already in use"
# Log lines that mean a starting server will never become ready, though its
# process may live on (vLLM's API server outlives a dead engine core).
START_FATAL = ("EngineCore failed to start", "Engine core initialization failed", PORT_TAKEN)


@dataclass
class LocalStack:
    """Context manager: ``with LocalStack(spec, log_dir) as stack: ...``."""

    spec: StackSpec
    log_dir: Path
    startup_timeout_s: float = 300.0
    instances: list[RunningInstance] = field(default_factory=list)
    _stopped: bool = False

    @property
    def prefill(self) -> list[RunningInstance]:
        return [i for i in self.instances if i.spec.role == Role.PREFILL]

    @property
    def decode(self) -> list[RunningInstance]:
        return [i for i in self.instances if i.spec.role == Role.DECODE]

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        no_transparent_hugepages()  # kvtier.devstack.placement, point 3: no frozen processes
        unwind_on_sigterm()
        atexit.register(self.stop)
        for attempt in range(1, attempts + 1):
            try:
                one_by_one = self.spec.starts_one_at_a_time()
                for ispec in self.spec.instances():
                    self.instances.append(self._spawn(ispec))
                    if one_by_one:
                        self._wait_ready()
                if not one_by_one:
                    self._wait_ready()
                return
            except StackStartError as e:
                # OS-assigned ports are only reserved until we close the probe
                # socket; another process can take one before vLLM binds it.
                # Then pick fresh ports and start again.
                # The engine core may die of it while the API server lives on.
                lost_race = self.spec.base_port is None and any(
                    PORT_TAKEN in i.log_tail(400) for i in self.instances)
                # An engine alive but never ready (once: a worker stuck for minutes in
                # connector setup on loaded CI cores) gets one more start, not more.
                hung_once = e.hung and attempt == 1
                self.stop()
                if not (lost_race or hung_once) or attempt == attempts:
                    raise
                log.warning("%s; restarting the stack with fresh ports (attempt %d/%d)",
                            "a port was taken before vLLM bound it" if lost_race
                            else "an instance never became ready", attempt + 1, attempts)
                self.instances.clear()
                self._stopped = False
                atexit.register(self.stop)
            except BaseException:
                self.stop()
                raise

    def _spawn(self, ispec: InstanceSpec) -> RunningInstance:
        log_path = self.log_dir / f"{ispec.name}.log"
        argv = ispec.argv()
        fh = open(log_path, "ab", buffering=0)
        fh.write(f"$ {shlex.join(argv)}\n".encode())
        offset = fh.tell()
        # A process group of its own, so stop() also reaches vLLM's engine-core child
        # processes. Not a session of its own: Linux schedules each session as one group
        # (autogroup), whatever its threads' nice levels, so a ready instance's NIXL spinners
        # demoted to nice 10 (kvtier.devstack.placement) would still take a full share of
        # their core from every other session's work: measured on 2 cores, an idle 1P1D's two
        # spinners held ~95% of the machine while a second stack's instance starved for 5 min.
        proc = subprocess.Popen(
            argv, env=ispec.env(), stdout=fh, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, process_group=0,
        )
        fh.close()
        log.info("started %s (pid %d) on %s, log %s", ispec.name, proc.pid, ispec.url, log_path)
        return RunningInstance(ispec, proc, log_path, offset)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(self.instances)
        while pending:
            for inst in list(pending):
                if not inst.alive():
                    raise StackStartError(
                        f"{inst.spec.name} exited with code {inst.proc.returncode} during "
                        f"startup; last log lines from {inst.log_path}:\n{inst.log_tail()}"
                    )
                tail = inst.log_tail(400)
                fatal = next((m for m in START_FATAL if m in tail), None)
                if fatal is not None:
                    # vLLM's API server can outlive a dead engine core, never ready.
                    raise StackStartError(
                        f"{inst.spec.name}: {fatal!r} in its log during startup; last log "
                        f"lines from {inst.log_path}:\n{inst.log_tail()}"
                    )
                if _healthy(inst.url):
                    log.info("%s ready", inst.spec.name)
                    pending.remove(inst)
                    # At once, not when all are: a ready instance's spinning NIXL threads
                    # would slow the others' start.
                    self._place(inst)
            if time.monotonic() > deadline:
                names = [i.spec.name for i in pending]
                raise StackStartError(
                    f"{names} not ready after {self.startup_timeout_s:.0f}s; "
                    f"last log lines of {names[0]}:\n{pending[0].log_tail()}", hung=True)
            if pending:
                time.sleep(1.0)

    def _place(self, inst: RunningInstance) -> None:
        """CPU platform: undo vLLM's and NIXL's thread placement of a ready, idle instance
        (kvtier.devstack.placement); once per process."""
        if not is_cpu_platform() or self.spec.cpu_placement == "off" or inst.placed:
            return
        from kvtier.devstack.placement import place, priority_name

        inst.placed = True
        bind = inst.spec.cpu_bind or ""
        core = int(bind) if bind.isdigit() else None
        nice = self.spec.spinner_nice
        for p in place(inst.proc.pid, core, demote=self.spec.cpu_placement == "full",
                       nice=nice):
            if p.rebound or p.demoted:
                log.info("%s: worker %d %s%s", inst.spec.name, p.pid,
                         f"model thread back on core {core}; " if p.rebound else "",
                         f"{len(p.demoted)} spinning thread(s) moved to "
                         f"{priority_name(nice)}" if p.demoted else "")

    def stop(self, grace_s: float = 15.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        for inst in self.instances:
            _signal_group(inst.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for inst in self.instances:
            try:
                inst.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Kill whatever is left of the group (engine cores, NIXL helpers).
            _signal_group(inst.proc, signal.SIGKILL)
            try:
                inst.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) did not exit", inst.spec.name, inst.proc.pid)
        try:
            atexit.unregister(self.stop)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass

    def kill(self, name: str) -> None:
        """Hard-kill one instance (fault tests)."""
        for inst in self.instances:
            if inst.spec.name == name:
                _signal_group(inst.proc, signal.SIGKILL)
                # A killed engine can take a while to be reaped on a loaded machine (its NIXL
                # memory is unregistered on the way out): seen > 10 s on 2 busy cores.
                inst.proc.wait(timeout=60)
                return
        raise KeyError(name)

    def router_instances(self) -> list[dict]:
        """The router's ``instances`` for this stack: name, URL, role, and each decode node's
        params feed and lease server when its connector has them (``kvtier router
        --stack-state`` reads these from the state file)."""
        out = []
        for i in self.instances:
            inst = {"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
            if i.spec.role.value in ("decode", "both"):
                inst.update(i.spec.router_endpoints())
            out.append(inst)
        return out

    def state(self) -> dict:
        """What ``kvtier stack up`` writes to its state file: the instances and the router's
        instance config."""
        return {"instances": self.describe(), "router": {"instances": self.router_instances()}}

    def describe(self) -> list[dict]:
        return [
            {
                "name": i.spec.name,
                "role": i.spec.role.value,
                "url": i.url,
                "events": i.spec.events_endpoint,
                "replay": i.spec.replay_endpoint,
                "topic": i.spec.topic,
                "nixl_side_channel": f"127.0.0.1:{i.spec.side_channel_port}",
                "tier_events": f"tcp://127.0.0.1:{i.spec.tier_events_port}",
                "tier_replay": f"tcp://127.0.0.1:{i.spec.tier_replay_port}",
                "p2p": f"127.0.0.1:{i.spec.tier_p2p_port}",
                "tier_metrics": f"http://127.0.0.1:{i.spec.tier_metrics_port}/metrics",
                "pid": i.proc.pid,
                "log": str(i.log_path),
            }
            for i in self.instances
        ]

def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _healthy(url: str) -> bool:
    # A stdlib probe keeps kvtier's core free of an HTTP client dependency.
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
