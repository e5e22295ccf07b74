"""The host tier's memory: a preallocated array of fixed-size block slots.

One slot holds the KV of one block for every layer of the model, laid out as
the worker half decides (kvtier.tier.worker packs layer after layer). The
pool knows nothing about keys; ``HostTier`` (the manager) hands out slot
numbers and the worker half or NIXL moves bytes in and out of them.

The pool is a ``numpy.memmap`` over a file in ``/dev/shm`` so the two halves
of a vLLM connector (scheduler process and worker process, which may or may
not be the same process) and NIXL all see the same bytes. Opening the same
name twice maps the same memory. The creator unlinks the file on ``close()``;
files left by killed processes are removed by ``sweep_stale()`` (the owner
pid is part of the name).

Pinning for CUDA (cudaHostRegister) is done by the worker half, which is
where torch lives (``kvtier.tier.cuda_copy.HostPins``: once per mapping, undone
by the worker's close); this module stays numpy-only.
Pools are named per engine and tensor-parallel rank (``pool_tag``).

Threading model: the pool has no state besides the mapping; concurrent
readers/writers of *different* slots are safe, the manager guarantees a slot
has one writer at a time.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHM_DIR = Path(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"))
_NAME_RE = re.compile(r"^kvtier-pool-(\d+)-")


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
