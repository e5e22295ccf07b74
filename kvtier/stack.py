"""A local prefill/decode fleet of real vLLM servers: start, watch, stop.

``LocalStack`` starts N prefill and M decode vLLM-CPU (or CUDA) servers, each
with its own HTTP port, NIXL side channel, ZMQ KV-event PUB and replay ports,
waits until every one answers ``/health``, keeps one log file per process,
and tears the whole process group of each server down on ``stop()``, on
Ctrl-C, on SIGTERM (turned into ``SystemExit``) and at interpreter exit. It only spawns processes: it never imports
vllm (vLLM runs in the child interpreter).

Threading model: a stack is driven by one thread. ``stop()`` is idempotent
and safe to call from a signal handler or ``atexit``.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.cpu_placement import SPINNER_NICE
from kvtier.ids import PodId, Role

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"

# Workaround (vllm-cpu 0.32): the `vllm` console command reads its own version
# with importlib.metadata.version("vllm") and dies with PackageNotFoundError,
# because the distribution is named "vllm-cpu". The OpenAI server module does
# not do that lookup, and vLLM's platform detection already falls back to
# version("vllm-cpu") + "+cpu". So the stack launches the module directly.
VLLM_SERVER_ARGV = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

# Serving dtype on the CPU platform, by what the CPU can do (vllm-cpu 0.32, measured with
# benchmarks/bench_prefill_dtype.py, bench model, prefill tokens/s at 512 / 2,048 tokens):
# - AMX (Sapphire Rapids): bfloat16 dies with SIGILL (an AMX tile instruction in the CPU
#   attention kernel, on the first 1-token step of a fresh engine: every decode instance's
#   first remotely prefilled request). float16 816 / 689, float32 760 / 637: float16.
# - AVX-512 BF16 without AMX (EPYC Zen 4): float16 121 / 109 (no fp16 arithmetic: emulated),
#   float32 575 / 453, bfloat16 1,041 / 735: bfloat16.
# - neither: float32 (both 16-bit types would be emulated; not measured here).
# KVTIER_CPU_DTYPE=float16|bfloat16|float32 overrides the choice.
CPU_DTYPES = ("float16", "bfloat16", "float32")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def dtype_for_flags(flags: set[str]) -> str:
    """The CPU serving dtype for a CPU with these /proc/cpuinfo flags (see above)."""
    if "amx_tile" in flags:
        return "float16"
    if "avx512_bf16" in flags:
        return "bfloat16"
    return "float32"


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(CPU model name, ISA flags) from /proc/cpuinfo; ("", empty) where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", frozenset()
    model, flags = "", None
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = val.strip()
        elif key == "flags" and flags is None:
            flags = frozenset(val.split())
        if model and flags is not None:
            break
    return model, flags or frozenset()


@functools.cache
def cpu_dtype() -> str:
    """The dtype the stack serves with on the CPU platform: KVTIER_CPU_DTYPE, else by CPU."""
    forced = os.environ.get("KVTIER_CPU_DTYPE")
    if forced:
        if forced not in CPU_DTYPES:
            raise ValueError(f"KVTIER_CPU_DTYPE={forced!r}: use one of {', '.join(CPU_DTYPES)}")
        return forced
    return dtype_for_flags(set(cpu_info()[1]))


def kv_dtype_bytes() -> int:
    """Bytes per KV element the stack's engines will use (2 on CUDA: the model's fp16/bf16)."""
    return DTYPE_BYTES[cpu_dtype()] if _is_cpu_platform() else 2


def load_config_file(name: str) -> dict:
    """Read a JSON file from ``configs/`` (name with or without .json)."""
    path = CONFIG_DIR / (name if name.endswith(".json") else f"{name}.json")
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise FileNotFoundError(f"no config {path.name} in {CONFIG_DIR}; known: {known}")
    return json.loads(path.read_text())


class InstanceSpec(BaseModel):
    """Everything needed to start one vLLM server."""

    model_config = ConfigDict(frozen=True)

    name: PodId
    role: Role
    model: str
    http_port: int
    side_channel_port: int
    events_port: int
    replay_port: int
    # kvtier's host tier (KVTierConnector): its own KV-event PUB + replay and
    # the peer-fetch side channel. Exported as KVTIER_* env vars; unused when
    # the instance runs without the connector.
    tier_events_port: int
    tier_replay_port: int
    tier_p2p_port: int
    tier_metrics_port: int  # the tier's Prometheus /metrics (kvtier_tier_*)
    cpu_bind: str | None = None  # e.g. "0"; None lets vLLM decide
    kv_cache_gib: int = 1
    block_size: int = 32
    max_model_len: int = 4096
    kv_transfer_config: dict | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = Field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.name}"

    def argv(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": self.topic,
        }
        argv = [
            *VLLM_SERVER_ARGV,
            "--model", self.model,
            "--served-model-name", Path(self.model).name, self.model,
            "--host", "127.0.0.1",
            "--port", str(self.http_port),
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--kv-events-config", json.dumps(events),
        ]
        if _is_cpu_platform():
            # torch.compile warm-up costs ~45 s per start on 2 cores and buys
            # nothing for these tiny models.
            argv += ["--dtype", cpu_dtype(), "--enforce-eager"]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return argv + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_NO_USAGE_STATS="1",
            # Enables /reset_prefix_cache, which tests and `kvtier ab` use to
            # force a cold device cache between runs. A local dev stack only.
            VLLM_SERVER_DEV_MODE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        env.update(
            KVTIER_TIER_EVENTS_PORT=str(self.tier_events_port),
            KVTIER_TIER_REPLAY_PORT=str(self.tier_replay_port),
            KVTIER_P2P_PORT=str(self.tier_p2p_port),
            KVTIER_METRICS_PORT=str(self.tier_metrics_port),
            KVTIER_POD_NAME=self.name,
        )
        if self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        env.update(self.extra_env)
        return env


@functools.cache
def _is_cpu_platform() -> bool:
    forced = os.environ.get("KVTIER_DEVICE")
    if forced:
        return forced == "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10)
        return out.returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return True


# Listening ports are picked below the kernel's ephemeral range. A port the OS hands out for
# bind(0) lies inside that range, and so does the source port of every outgoing connection
# (health polls, vLLM's own ZMQ/Gloo sockets): between our probe and vLLM's bind one of those
# could take it, and did (several "Address already in use" restarts per stack start were
# seen). Below the range only another listener can.
_LOW_PORT_FLOOR = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    # vLLM binds its ZMQ endpoints on every interface ("tcp://*:PORT"): check that, not
    # only the loopback address.
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports for listeners, below the ephemeral range when it leaves
    room (see above), else from the OS."""
    low = _ephemeral_low()
    if low - _LOW_PORT_FLOOR >= 4 * n:
        rng = random.SystemRandom()
        out: list[int] = []
        for _ in range(50 * n):
            p = rng.randrange(_LOW_PORT_FLOOR, low)
            if p not in out and _bindable(p):
                out.append(p)
                if len(out) == n:
                    return out
    return _os_ports(n)


def _os_ports(n: int) -> list[int]:
    """Ask the OS for n distinct free TCP ports on 127.0.0.1."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


PORTS_PER_INSTANCE = 8


class StackSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str
    prefill: int = 1
    decode: int = 1
    kv_transfer_config: dict | None = None
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    base_port: int | None = None  # None: ports picked by the OS
    extra_args: tuple[str, ...] = ()
    # CPU platform, after start (kvtier.cpu_placement): "full" moves each model thread back to
    # its core and gives NIXL's busy-polling threads a low priority; "rebind" only the former;
    # "off" neither.
    cpu_placement: Literal["full", "rebind", "off"] = "full"
    # "full": the spinners' nice level; None puts them at SCHED_IDLE (starves the READs a
    # busy instance is the target of: kvtier.cpu_placement's docstring has the numbers).
    spinner_nice: int | None = Field(SPINNER_NICE, ge=0, le=19)

    def instances(self) -> list[InstanceSpec]:
        total = self.prefill + self.decode
        if total < 1:
            raise ValueError("a stack needs at least one instance")
        if self.base_port is None:
            ports = free_ports(PORTS_PER_INSTANCE * total)
        else:
            ports = list(range(self.base_port, self.base_port + PORTS_PER_INSTANCE * total))
        cpus = sorted(os.sched_getaffinity(0))
        out = []
        roles = [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode
        counters = {Role.PREFILL: 0, Role.DECODE: 0}
        for i, role in enumerate(roles):
            idx = counters[role]
            counters[role] += 1
            p = ports[PORTS_PER_INSTANCE * i: PORTS_PER_INSTANCE * (i + 1)]
            out.append(
                InstanceSpec(
                    name=PodId(f"{role.value}-{idx}"),
                    role=role,
                    model=self.model,
                    http_port=p[0],
                    side_channel_port=p[1],
                    events_port=p[2],
                    replay_port=p[3],
                    tier_events_port=p[4],
                    tier_replay_port=p[5],
                    tier_p2p_port=p[6],
                    tier_metrics_port=p[7],
                    # Spread instances over cores so P and D do not fight for one.
                    cpu_bind=str(cpus[i % len(cpus)]),
                    kv_cache_gib=self.kv_cache_gib,
                    block_size=self.block_size,
                    max_model_len=self.max_model_len,
                    kv_transfer_config=self.kv_transfer_config,
                    extra_args=self.extra_args,
                )
            )
        return out


@dataclass
class RunningInstance:
    spec: InstanceSpec
    proc: subprocess.Popen
    log_path: Path
    log_offset: int = 0  # where this process's output starts (logs append across restarts)

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
    pass


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

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        _exit_on_sigterm()
        atexit.register(self.stop)
        for attempt in range(1, attempts + 1):
            try:
                for ispec in self.spec.instances():
                    self.instances.append(self._spawn(ispec))
                self._wait_ready()
                self._place()
                return
            except StackStartError:
                # OS-assigned ports are only reserved until we close the probe
                # socket; another process can take one before vLLM binds it.
                # Then pick fresh ports and start again.
                # The engine core may die of it while the API server lives on.
                lost_race = self.spec.base_port is None and any(
                    PORT_TAKEN in i.log_tail(400) for i in self.instances)
                self.stop()
                if not lost_race or attempt == attempts:
                    raise
                log.warning("a port was taken before vLLM bound it; restarting the stack "
                            "with fresh ports (attempt %d/%d)", attempt + 1, attempts)
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
        # A new session makes the server the leader of its own process group,
        # so stop() also reaches vLLM's engine-core child processes.
        proc = subprocess.Popen(
            argv, env=ispec.env(), stdout=fh, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
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
            if time.monotonic() > deadline:
                names = [i.spec.name for i in pending]
                raise StackStartError(
                    f"{names} not ready after {self.startup_timeout_s:.0f}s; "
                    f"last log lines of {names[0]}:\n{pending[0].log_tail()}"
                )
            if pending:
                time.sleep(1.0)

    def _place(self) -> None:
        """CPU platform: undo vLLM's and NIXL's thread placement (kvtier.cpu_placement)."""
        if not _is_cpu_platform() or self.spec.cpu_placement == "off":
            return
        from kvtier.cpu_placement import place, priority_name

        for inst in self.instances:
            core = int(inst.spec.cpu_bind) if (inst.spec.cpu_bind or "").isdigit() else None
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
                inst.proc.wait(timeout=10)
                return
        raise KeyError(name)

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


def _exit_on_sigterm() -> None:
    """Make SIGTERM unwind the program (``SystemExit(143)``) instead of killing it.

    By default SIGTERM ends Python without running ``finally`` blocks or ``atexit``,
    so a ``kill``, a ``timeout`` wrapper or a cancelled CI job would leave every vLLM
    server running. Only installed from the main thread, and only over the default
    action: a program that handles SIGTERM itself keeps its handler.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def sigterm_as_interrupt() -> None:
    """For a command's main thread: SIGTERM acts like Ctrl-C (``KeyboardInterrupt``), so
    ``kill`` gets the same orderly stop (and partial results) as an interactive interrupt."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


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
