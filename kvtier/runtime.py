"""Process-level helpers every kvtier program shares: free ports, the SIGTERM policy, and
an ASGI app served from a background thread.

One of each, so the router, the indexer, the local stack and the A/B harness behave alike:

- ``cpu_info()``: the CPU's model name and ISA flags (the local stack's dtype, reports).
- ``free_ports(n)``: listener ports below the kernel's ephemeral range (see below).
- ``unwind_on_sigterm()``: SIGTERM raises ``Terminated``, which is both a ``SystemExit``
  (exit status 128 + 15 when nothing catches it, so ``finally`` blocks, context managers and
  ``atexit`` run and every server a program started is stopped) and a ``KeyboardInterrupt``
  (a command that stops in order on Ctrl-C, say an A/B sweep that reports the strategies it
  finished, does the same on ``kill``). Installed from the main thread over the default
  action only: a program that handles SIGTERM itself (uvicorn in the main thread) keeps it.
- ``listen`` / ``listen_on_free_port``: a bound socket, so a picked port stays ours.
- ``ServerThread``: uvicorn running one ASGI app on its own event loop in a daemon thread,
  for tests, the demo and the A/B harness. This module runs an app; it knows nothing of
  what the app serves.

Threading model: ``free_ports`` and ``unwind_on_sigterm`` are called from the main thread;
a ``ServerThread`` is started and stopped by one thread, its server runs in its own.
"""

from __future__ import annotations

import functools
import logging
import random
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

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


class Terminated(SystemExit, KeyboardInterrupt):
    """SIGTERM arrived: unwinds like Ctrl-C; exits with ``128 + signum`` if nobody catches it."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def unwind_on_sigterm() -> None:
    """Make SIGTERM raise ``Terminated`` in the main thread (idempotent; see the module doc).

    By default SIGTERM ends Python without running ``finally`` blocks or ``atexit``, so a
    ``kill``, a ``timeout`` wrapper or a cancelled CI job would leave every vLLM server
    running. Only over the default action: a handler someone else installed stays.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is signal.SIG_DFL or current is _terminate:
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; ``port=0`` lets the OS pick.

    Raises ``OSError`` when the port is taken. Binding up front is what makes a picked port
    ours: uvicorn binds only after the app's startup, and a port chosen earlier can be taken
    by then (one was, in a CI run, by a vLLM engine starting beside the router).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listen_on_free_port(host: str = "127.0.0.1", attempts: int = 8) -> socket.socket:
    """``listen`` on a port from ``free_ports``, trying another if one is taken meanwhile."""
    for _ in range(attempts - 1):
        try:
            return listen(host, free_ports(1)[0])
        except OSError:
            continue
    return listen(host, free_ports(1)[0])


class _ErrorLog(logging.Handler):
    """Collects the ERROR records uvicorn logs from one thread (why it did not start)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.thread_id: int | None = None
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread_id:
            # A traceback's last line names the error; the start of one is noise here.
            text = self.format(record).strip()
            self.lines.append(text.splitlines()[-1] if text else record.levelname)


class ServerThread:
    """``with ServerThread(app, host) as srv: srv.url``: uvicorn in a daemon thread.

    ``port=0`` picks a free port; ``sock`` serves on a socket already bound (``listen``).
    The port is bound when the object is made, so it cannot be taken before ``start``.
    ``start`` returns once uvicorn accepts connections and raises, with the cause, if it
    died first or did not come up in time; ``stop`` is idempotent.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 name: str = "kvtier-server", sock: socket.socket | None = None,
                 keepalive_s: int = 5) -> None:
        import uvicorn  # only programs that serve pay for the import

        self._sock = sock if sock is not None else listen(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.app = app
        # keepalive_s: how long an idle client connection stays open (uvicorn's default, 5 s)
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=self.port, log_level="warning", access_log=False,
            lifespan="on", timeout_keep_alive=keepalive_s))
        self._errors = _ErrorLog()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        self._errors.thread_id = threading.get_ident()
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as e:  # noqa: BLE001 - reported by start(); the thread ends
            self._failure = e
        finally:
            self._sock.close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        uv_log = logging.getLogger("uvicorn.error")
        uv_log.addHandler(self._errors)
        try:
            self._thread.start()
            deadline = time.monotonic() + timeout_s
            while not self._server.started:
                if not self._thread.is_alive():
                    raise RuntimeError(f"server {self._thread.name} did not start on "
                                       f"{self.url}: {self._why()}")
                if time.monotonic() > deadline:
                    where = self._where()  # before stop(): the line its startup waits on
                    self.stop()
                    raise RuntimeError(f"server {self._thread.name} did not start on "
                                       f"{self.url} within {timeout_s:g} s: {self._why()}; "
                                       f"its thread was at (innermost last):\n{where}")
                time.sleep(0.02)
        finally:
            uv_log.removeHandler(self._errors)
        return self

    def _where(self) -> str:
        """The server thread's current stack, innermost frame last."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            return "(its thread is gone)"
        return "".join(traceback.format_stack(frame, limit=16)).rstrip()

    def _why(self) -> str:
        said = "; ".join(self._errors.lines[-3:])
        if self._failure is not None and not isinstance(self._failure, SystemExit):
            said = f"{said}; {self._failure!r}" if said else repr(self._failure)
        return said or "startup still running (nothing logged)"

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        elif self._thread.ident is None:  # never started: the bound socket is ours to close
            self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
