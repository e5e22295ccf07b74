"""Retention accounting for a tier: what it holds, for how long, and what it moved.

``TierStats`` is a plain counter set owned by one tier manager. It integrates
*block-seconds held* (the retention cost a policy pays) by advancing a clock
whenever the number of held blocks changes, so a snapshot is exact without a
background thread.

Paths for bytes moved:

- ``store``: engine KV -> host slots (offload)
- ``load``: host slots -> engine KV (local hit)
- ``peer_out``: host slots read by a peer over NIXL (this tier is the source)
- ``peer_in``: a peer's slots read into this engine (this tier is the consumer)

Threading model: not thread-safe; the owning tier's caller holds its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

PATHS = ("store", "load", "peer_out", "peer_in")
# A peer fetch's phases in the reader: the first contact's Hello and NIXL wire-up, the Hold's
# round trip (the source pins what it has), the NIXL READ into local slots, the Release.
PEER_PHASES = ("handshake", "hold", "read", "release")


@dataclass
class TierStats:
    slot_bytes: int
    clock: Callable[[], float] = time.monotonic
    blocks_held: int = 0
    block_seconds_held: float = 0.0
    hits: int = 0  # blocks found by prefix lookups
    misses: int = 0  # lookups whose first missing block ended the prefix
    stores_skipped: int = 0  # blocks offered for store that were already present
    stores_refused: int = 0  # blocks not stored because the tier was full
    evictions: int = 0
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    peer_fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count
    peer_fetches: int = 0  # peer fetches that asked a source (fallbacks included)
    # seconds the reader's scheduler spent in them, by phase (PEER_PHASES)
    peer_fetch_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PEER_PHASES, 0.0))
    _last: float | None = None

    def _advance(self) -> None:
        now = self.clock()
        if self._last is not None:
            self.block_seconds_held += self.blocks_held * (now - self._last)
        self._last = now

    def held_changed(self, delta_blocks: int) -> None:
        self._advance()
        self.blocks_held += delta_blocks

    @property
    def bytes_held(self) -> int:
        return self.blocks_held * self.slot_bytes

    def record_move(self, path: str, nbytes: int) -> None:
        if path not in self.bytes_moved:
            raise ValueError(f"unknown path {path!r}; known: {PATHS}")
        self.bytes_moved[path] += nbytes

    def record_fallback(self, reason: str) -> None:
        self.peer_fallbacks[reason] = self.peer_fallbacks.get(reason, 0) + 1

    def record_peer_fetch(self, seconds: dict[str, float]) -> None:
        """One peer fetch: the seconds each phase of it took (``PEER_PHASES``)."""
        unknown = set(seconds) - set(PEER_PHASES)
        if unknown:
            raise ValueError(f"unknown peer fetch phases {sorted(unknown)}; known: {PEER_PHASES}")
        self.peer_fetches += 1
        for phase, s in seconds.items():
            self.peer_fetch_s[phase] += s

    def snapshot(self) -> dict:
        self._advance()
        return {
            "blocks_held": self.blocks_held,
            "bytes_held": self.bytes_held,
            "block_seconds_held": self.block_seconds_held,
            "hits": self.hits,
            "misses": self.misses,
            "stores_skipped": self.stores_skipped,
            "stores_refused": self.stores_refused,
            "evictions": self.evictions,
            "bytes_moved": dict(self.bytes_moved),
            "peer_fallbacks": dict(self.peer_fallbacks),
            "peer_fetches": self.peer_fetches,
            "peer_fetch_s": dict(self.peer_fetch_s),
        }
