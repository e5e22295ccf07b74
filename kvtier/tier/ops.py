"""The host tier's copy jobs: what the scheduler half hands the worker half each step.

A ``LoadOp`` copies pool slots into engine blocks, a ``StoreOp`` engine blocks into pool
slots; both carry the tier's job id, which the worker reports back when the copy is done
(``HostTier.complete_load`` / ``complete_store``). They are the opaque handles of the two
halves (vLLM's ``LoadStoreSpec``): plain values, no torch, so the scheduler half never
imports the worker's libraries.

Threading model: immutable values and a pure function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadOp:
    job_id: int
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class StoreOp:
    job_id: int
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]


def runs(block_ids: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split paired block ids and slots into ``(block0, slot0, length)`` runs in
    which both advance by one, so each run is a single slice copy."""
    out: list[tuple[int, int, int]] = []
    for b, s in zip(block_ids, slots):
        if out:
            b0, s0, n = out[-1]
            if b == b0 + n and s == s0 + n:
                out[-1] = (b0, s0, n + 1)
                continue
        out.append((b, s, 1))
    return out
