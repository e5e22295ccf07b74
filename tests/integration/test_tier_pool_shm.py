"""A host pool's ``/dev/shm`` file does not outlive its owner (kvtier/tier/pool.py).

The owner is a real process doing what an engine's connector does: ``HostPool.shared`` (the
worker half) and a NIXL registration of it (the scheduler half with peer fetch). It is
stopped with SIGTERM, with SIGKILL, and with SIGKILL to its whole process group (how
``LocalStack`` and the GPU bench scripts stop an engine); none of them runs ``close()``, and
the file must be gone within seconds. A process still attached keeps its mapping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.tier import pool as poolmod
from kvtier.tier.pool import HostPool
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

SLOTS, SLOT = 8, 4096

OWNER = f"""
import sys, time
from kvtier.tier.nixl import NixlPool
from kvtier.tier.pool import HostPool

pool = HostPool.shared(sys.argv[1], {SLOTS}, {SLOT})
assert pool.owner
nixl = NixlPool(pool, "agent-" + sys.argv[1])
pool.array[0, :] = 7
print("POOL", pool.path, flush=True)  # NIXL logs on stdout too
time.sleep(600)
"""


@pytest.fixture()
def owner() -> Iterator[tuple[subprocess.Popen[str], Path]]:
    tag = f"shmtest-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", OWNER, tag], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:
            if line.startswith("POOL "):
                break
        path = Path(line.removeprefix("POOL ").strip())
        assert path.parent == poolmod.SHM_DIR and path.exists(), "the owner did not start"
        yield proc, path
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for p in poolmod.SHM_DIR.glob(f"kvtier-pool-*-{tag}"):  # never leave one here
            p.unlink(missing_ok=True)


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "sigkill-group"])
def test_a_stopped_owner_leaves_no_pool_file(owner, how: str) -> None:
    proc, path = owner
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif how == "sigkill":
        proc.send_signal(signal.SIGKILL)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert wait_until(lambda: not path.exists(), 5.0), f"{path} outlived its owner ({how})"


def test_an_attached_process_keeps_its_mapping_after_the_owner_dies(owner) -> None:
    proc, path = owner
    tag = path.name.split("-", 3)[3]
    attached = HostPool.shared(tag, SLOTS, SLOT)
    assert not attached.owner and attached.path == path
    proc.kill()
    proc.wait(10)
    assert wait_until(lambda: not path.exists(), 5.0)
    assert np.all(attached.view(0) == 7)  # the name is gone, the memory is not
    attached.view(1)[:] = 3
    assert np.all(attached.view(1) == 3)
    attached.close()


def test_close_unlinks_and_ends_the_reaper(tmp_path: Path) -> None:
    path = tmp_path / "kvtier-pool-1-close"
    pool = HostPool(SLOTS, SLOT, path, owner=True)
    reaper = pool._reaper
    assert reaper is not None and reaper.poll() is None
    pool.close()
    assert not path.exists() and reaper.returncode == 0


def test_the_reaper_spares_a_new_file_of_the_same_name(tmp_path: Path) -> None:
    """A pool closed and created again under one name: the first reaper must not unlink the
    second pool's file (it checks the inode)."""
    path = tmp_path / "kvtier-pool-1-again"
    first = HostPool(SLOTS, SLOT, path, owner=True)
    first.path = None  # as if its close() never unlinked (a second pool took the name)
    path.unlink()
    second = HostPool(SLOTS, SLOT, path, owner=True)
    first.close()  # its reaper wakes, finds another inode, leaves it
    assert path.exists()
    second.close()
    assert not path.exists()
