"""Helpers every test tier shares: polling a condition, and a real ``redis-server``.

``wait_until`` polls a predicate (the tests' one way to wait for a daemon, a socket, a
counter). ``RedisServer`` runs a real ``redis-server`` on a free port of 127.0.0.1, without
persistence unless it is stopped with ``save=True``; it can be stopped, killed and started
again on the same port and directory (the outage tests). The session-wide instance most tests
use is the ``redis_url`` fixture of ``tests/conftest.py``.

Threading model: none; a ``RedisServer`` belongs to the test (or fixture) that made it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.runtime import free_ports


def wait_until(pred: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` seconds have passed; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def redis_exe() -> str:
    """The ``redis-server`` binary; a failed test (never a skip) where it is missing."""
    exe = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").is_file() else None)
    if exe is None:
        pytest.fail("redis-server is not installed (./run test installs it)")
    return exe


class RedisServer:
    """A ``redis-server`` on a fixed port and directory, stoppable and restartable."""

    def __init__(self, d: Path, port: int | None = None, start: bool = True) -> None:
        self.exe, self.dir = redis_exe(), d
        self.port = port if port is not None else free_ports(1)[0]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def start(self, timeout: float = 15) -> None:
        """Start it and wait for its PING; a failed test if it dies or does not answer."""
        import redis

        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self.proc.returncode}")
            try:
                return bool(self.client().ping())
            except redis.RedisError:
                return False
        if not wait_until(up, timeout=timeout, interval=0.05):
            self.kill()
            pytest.fail("redis-server did not start")

    def stop(self, save: bool) -> None:
        """SHUTDOWN SAVE keeps the data for the next start; NOSAVE (and no dump) loses it."""
        import redis

        try:
            self.client().shutdown(save=save, nosave=not save)
        except redis.ConnectionError:
            pass
        assert self.proc is not None
        self.proc.wait(timeout=15)
        if not save:
            (self.dir / "dump.rdb").unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL, as a crash: what it held is gone (it never saves)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
