"""The host tier's memory: a preallocated array of fixed-size block slots.

One slot holds the KV of one block for every layer of the model, laid out as
the worker half decides (kvtier.tier.worker packs layer after layer). The
pool knows nothing about keys; ``HostTier`` (the manager) hands out slot
numbers and the worker half or NIXL moves bytes in and out of them.

The pool is a ``numpy.memmap`` over a file in ``/dev/shm`` so the two halves
of a vLLM connector (scheduler process and worker process, which may or may
not be the same process) and NIXL all see the same bytes. Opening the same
name twice maps the same memory (the halves attach by name, each when vLLM gets
to it, in an order and number of processes this module cannot know).

Nothing outlives its owner. The creator unlinks the file on ``close()``; a creator
that never gets there (SIGTERM, SIGKILL, a crash) leaves it to its reaper: a tiny
process started with the pool, in a session of its own (a signal to the engine's
process group does not reach it), that blocks on a pipe whose only writer is the
creator (and any child forked from it meanwhile). When the last of them is gone the
kernel closes the pipe and the reaper unlinks the file, if it is still the same file
(inode), then exits. The mapping of a process still attached stays valid after the
unlink; only its name goes, and with the last mapping the memory. ``sweep_stale()``
(every ``shared()``) still removes a dead owner's file (the owner pid is part of
the name) should its reaper have been killed too.

Pinning for CUDA (cudaHostRegister) is done by the worker half, which is
where torch lives (``kvtier.tier.cuda_copy.HostPins``: once per mapping, undone
by the worker's close); this module stays numpy-only.
Pools are named per engine and tensor-parallel rank (``pool_tag``).

Threading model: the pool has no state besides the mapping (and its reaper);
concurrent readers/writers of *different* slots are safe, the manager guarantees a slot
has one writer at a time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHM_DIR = Path(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"))
_NAME_RE = re.compile(r"^kvtier-pool-(\d+)-")
# The reaper: wait for EOF on stdin (every writer gone), then unlink argv[1] if it is
# still inode argv[2]. Isolated (-I), without site (-S): starts in ~10 ms, ~8 MB resident.
_REAPER = """
import os, sys
while os.read(0, 4096):
    pass
try:
    if os.stat(sys.argv[1]).st_ino == int(sys.argv[2]):
        os.unlink(sys.argv[1])
except OSError:
    pass
"""


def pool_path(tag: str, owner_pid: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)
    return SHM_DIR / f"kvtier-pool-{owner_pid}-{safe}"


def pool_tag(engine_id: str, tp_rank: int = 0, tp_size: int = 1) -> str:
    """The shared-pool name of one tensor-parallel rank of one engine. Each TP
    rank holds its own shard of every block, so each has its own pool; slot
    numbers (handed out once, by the scheduler) mean the same block in all of
    them, and no two ranks ever write the same bytes."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} outside size {tp_size}")
    return f"{engine_id}-tp{tp_rank}of{tp_size}"


def sweep_stale() -> int:
    """Remove pool files whose owner process is gone. Returns how many."""
    n = 0
    for p in SHM_DIR.glob("kvtier-pool-*"):
        m = _NAME_RE.match(p.name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                p.unlink()
                n += 1
            except OSError:
                pass
        except PermissionError:
            pass
    return n


@dataclass
class HostPool:
    """``num_slots`` x ``slot_bytes`` bytes of shared host memory."""

    num_slots: int
    slot_bytes: int
    path: Path | None = None  # None: anonymous (process-private) memory
    owner: bool = True
    array: np.ndarray = field(init=False, repr=False)
    _reaper: subprocess.Popen[bytes] | None = field(init=False, default=None, repr=False)
    _reaper_fd: int | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_slots <= 0 or self.slot_bytes <= 0:
            raise ValueError(f"pool needs slots and bytes, got {self.num_slots}x{self.slot_bytes}")
        size = self.num_slots * self.slot_bytes
        if self.path is None:
            self.array = np.zeros((self.num_slots, self.slot_bytes), dtype=np.uint8)
            return
        mode = "r+" if self.path.exists() and self.path.stat().st_size == size else "w+"
        if mode == "w+":
            with open(self.path, "wb") as fh:
                fh.truncate(size)
        self.array = np.memmap(self.path, dtype=np.uint8, mode="r+",
                               shape=(self.num_slots, self.slot_bytes))
        if self.owner:
            self._start_reaper(self.path)

    def _start_reaper(self, path: Path) -> None:
        """Unlink ``path`` once this process (and whatever it forks) is gone, however it
        ends (module docstring)."""
        r, w = os.pipe()  # both ends non-inheritable: an exec'd child never holds ``w``
        try:
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _REAPER, str(path),
                 str(path.stat().st_ino)],
                stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._reaper_fd = w

    @classmethod
    def shared(cls, tag: str, num_slots: int, slot_bytes: int) -> HostPool:
        """Attach to the live shared pool named ``tag``, or create it (and own it).

        The two halves of one engine's connector call this with the same tag
        (the engine id); whichever comes first owns the file.
        """
        sweep_stale()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)
        size = num_slots * slot_bytes
        for p in SHM_DIR.glob(f"kvtier-pool-*-{safe}"):
            if p.stat().st_size == size:
                return cls(num_slots, slot_bytes, p, owner=False)
        return cls(num_slots, slot_bytes, pool_path(tag, os.getpid()), owner=True)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def base_address(self) -> int:
        return int(self.array.ctypes.data)

    def slot_address(self, slot: int) -> int:
        return self.base_address + slot * self.slot_bytes

    def view(self, slot: int) -> np.ndarray:
        return self.array[slot]

    def close(self) -> None:
        if self.path is not None and self.owner:
            try:
                self.path.unlink()
            except OSError:
                pass
        if self._reaper_fd is not None:
            os.close(self._reaper_fd)  # the reaper finds the file gone and exits
            self._reaper_fd = None
        if self._reaper is not None:
            try:
                self._reaper.wait(5.0)
            except subprocess.TimeoutExpired:
                pass  # it exits on its own; only its exit status is left unread
            self._reaper = None
