"""The machine-wide e2e lock (kvtier.ab.live.lock): one stack at a time, also against older
checkouts that flock the file themselves."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

import pytest
from filelock import Timeout

from kvtier.ab.live import lock


@pytest.fixture
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    p = tmp_path / "e2e.lock"
    monkeypatch.setenv("KVTIER_E2E_LOCK", str(p))
    return p


def test_the_path_comes_from_the_environment(path: Path) -> None:
    assert lock.lock_path() == str(path)
    assert lock.e2e_lock().lock_file == str(path)


def test_a_second_holder_waits(path: Path) -> None:
    got: list[str] = []

    def other() -> None:
        try:
            lock.e2e_lock().acquire(timeout=0.2)
            got.append("acquired")
        except Timeout:
            got.append("timeout")

    with lock.e2e_lock():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert got == ["timeout"]
    with lock.e2e_lock():  # free again once released
        assert path.exists()


def test_a_second_stack_in_the_same_thread_fails_instead_of_hanging(path: Path) -> None:
    with lock.e2e_lock(), pytest.raises(RuntimeError, match="Deadlock"):
        lock.e2e_lock().acquire()


def test_released_from_another_thread(path: Path) -> None:
    held = lock.e2e_lock()
    held.acquire()
    t = threading.Thread(target=held.release)  # the test pool releases where pytest tears down
    t.start()
    t.join()
    assert not held.is_locked
    with lock.e2e_lock():
        pass


def test_excludes_a_plain_flock_holder(path: Path) -> None:
    """An older checkout (or another tool) that calls fcntl.flock on the same file."""
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        with pytest.raises(Timeout):
            lock.e2e_lock().acquire(timeout=0.2)
        fcntl.flock(fh, fcntl.LOCK_UN)
    with lock.e2e_lock(), open(path, "w") as fh, pytest.raises(BlockingIOError):
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
