"""A stand-in for ``kvtier.tier.peer.PeerClient`` at the one seam a scheduler test does not
cross (the transfer): it records how many blocks the scheduler asked it to fetch and fetches
none. Used where a test is about whether a pull starts (the reuse gate), not about the bytes;
the real transfer is tested in tests/integration/test_tier_peer.py."""

from __future__ import annotations

from kvtier.tier.peer import FetchResult
from kvtier.wire.peer import Identity


class RecordingPeer:
    identity = Identity("tiny-llama", 1, 0, "x", 1024)

    def __init__(self) -> None:
        self.fetched: list[int] = []

    def fetch(self, host: str, port: int, keys: list, metas: list) -> FetchResult:
        self.fetched.append(len(keys))
        return FetchResult(0, 0, "test")

    def close(self) -> None:
        pass
