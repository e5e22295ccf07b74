"""NIXL transport for host-pool slots (UCX backend, DRAM).

``NixlPool`` registers one ``HostPool`` with a NIXL agent and READs slots of
a peer's pool into slots of its own. One descriptor per slot; a READ of many
slots is one NIXL transfer.

Facts this relies on (see docs/FACTS.md): UCX READ DRAM->DRAM between two
processes works on 127.0.0.1; if a remote registers new memory after its
metadata was loaded, transfers fail until the remote agent is re-added, so a
peer is (re)added whenever its metadata bytes change.

Threading model: one NixlPool per process, used by one thread at a time (the
caller holds the tier lock).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.tier.pool import HostPool


class TransferError(RuntimeError):
    pass


@dataclass
class NixlPool:
    pool: HostPool
    name: str
    # NIXL's Python API is untyped; these are its agent and registration handles.
    _agent: Any = field(init=False, repr=False)
    _reg: Any = field(init=False, repr=False)
    _peers: dict[str, bytes] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        # No NIXL progress thread: with NIXL 1.5.1's UCX backend it busy-polls a whole core
        # forever, idle or not (measured: 100% of a core from an agent that does nothing),
        # which on a CPU-served engine is a core taken from the model. `read` drives
        # progress itself by polling the transfer state; the source side calls `progress`
        # while a peer may be reading (kvtier.tier.peer.PeerServer), since UCX's TCP and
        # shared-memory transports need the target to make progress too.
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False,
                                                              backends=["UCX"]))
        self._reg = self._agent.get_reg_descs(
            [(self.pool.base_address, self.pool.nbytes, 0, "")], "DRAM")
        self._agent.register_memory(self._reg)

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (idempotent); returns its agent name."""
        name = None
        for n, meta in self._peers.items():
            if meta == metadata:
                return n
        name = self._agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        old = self._peers.get(name)
        if old is not None and old != metadata:
            self._agent.remove_remote_agent(name)
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
        self._peers[name] = metadata
        return name

    def read(self, peer: str, remote_base: int, remote_slots: Sequence[int],
             local_slots: Sequence[int], timeout_s: float = 10.0) -> int:
        """READ ``remote_slots`` of the peer's pool into ``local_slots``; bytes moved."""
        if len(remote_slots) != len(local_slots):
            raise ValueError("slot lists differ in length")
        if not remote_slots:
            return 0
        sb = self.pool.slot_bytes
        local = self._agent.get_xfer_descs(
            [(self.pool.slot_address(s), sb, 0) for s in local_slots], "DRAM")
        remote = self._agent.get_xfer_descs(
            [(remote_base + s * sb, sb, 0) for s in remote_slots], "DRAM")
        handle = self._agent.initialize_xfer("READ", local, remote, peer, b"")
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL READ from {peer} timed out after {timeout_s}s")
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"NIXL READ from {peer} failed")
        finally:
            self._agent.release_xfer_handle(handle)
        return sb * len(remote_slots)

    def progress(self) -> None:
        """Drive this agent's UCX worker once (the source side of a peer's READ calls this
        while a transfer may be in flight; there is no progress thread, see __post_init__)."""
        self._agent.get_new_notifs()

    def close(self) -> None:
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:  # pragma: no cover - best effort at shutdown
            pass
