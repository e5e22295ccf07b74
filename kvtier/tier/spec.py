"""The host tier's factory: one spec per engine process makes the half that process runs.

Modelled on vLLM's ``OffloadingSpec``: built from the parsed config (``HostTierConfig``,
already ``resolved`` against the instance's environment) and the engine's KV geometry, it
makes

- the scheduler half (``get_scheduler``): the ``HostTier`` manager, its lock, the request-key
  hasher, and, as the config asks, the peer server and client over a NIXL-registered view of
  the shared pool, the KV-event publisher and the Prometheus endpoint, all handed to
  ``TierScheduler`` at construction;
- the worker half (``get_worker``): a ``TierWorker`` over the same shared pool (by
  ``pool_tag``), with the spec's pinned-memory registry.

The vLLM adapter (``kvtier.connectors.kvtier_connector``) builds one spec and dispatches by
role. The worker half imports torch; this module only names it when ``get_worker`` runs.

Threading model: a spec is built and used on one thread (the connector's constructor); what
it makes documents its own.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.hashing import RequestKeyHasher
from kvtier.ids import ModelName
from kvtier.tier.config import HostTierConfig
from kvtier.tier.events import TierEventPublisher
from kvtier.tier.manager import HostTier
from kvtier.tier.pool import pool_tag
from kvtier.tier.scheduler import Closeable, TierScheduler

if TYPE_CHECKING:
    from kvtier.tier.cuda_copy import HostPins
    from kvtier.tier.peer import PeerClient
    from kvtier.tier.worker import TierWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVGeometry:
    """What both halves derive from the engine's KV cache config, and peers must share."""

    block_size: int
    slot_bytes: int  # one block of every layer
    num_blocks: int  # of the engine's KV cache
    layer_names: tuple[str, ...]
    layout: str  # compared in the peer handshake


def check_block_size(cfg: HostTierConfig, engine_block_size: int) -> int:
    """The tier's block size: the config's, which must equal the engine's, else the engine's."""
    block_size = cfg.block_size or engine_block_size
    if block_size != engine_block_size:
        raise ValueError(f"kvtier block_size {block_size} != engine block size "
                         f"{engine_block_size}; they must be equal")
    return block_size


class HostTierSpec:
    def __init__(self, cfg: HostTierConfig, geometry: KVGeometry, *, engine_id: str,
                 engine_model: str, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.cfg = cfg
        self.geometry = geometry
        self.engine_id = engine_id
        self.model = ModelName(cfg.model or Path(engine_model).name)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_slots = cfg.cpu_bytes_to_use // geometry.slot_bytes
        self.pool_tag = pool_tag(engine_id, tp_rank, tp_size)
        self._pins: HostPins | None = None

    # -- scheduler half ----------------------------------------------------------------------
    def get_scheduler(self) -> TierScheduler:
        cfg, g = self.cfg, self.geometry
        tier = HostTier(self.num_slots, g.slot_bytes, lease_s=cfg.lease_s)
        lock = threading.RLock()
        services: list[Closeable] = []
        peer = self._peer(tier, lock, services) if cfg.p2p_port is not None else None
        events = None
        if cfg.events_endpoint:
            events = TierEventPublisher(cfg.events_endpoint, cfg.replay_endpoint,
                                        cfg.events_topic, cfg.events_buffer_steps)
        if cfg.metrics and cfg.metrics_port is not None:
            services.append(self._metrics(tier, lock))
        return TierScheduler(
            tier, RequestKeyHasher(self.model, g.block_size, seed=cfg.hash_seed), g.block_size,
            cfg.offload_prompt_only, lock=lock, peer=peer,
            min_cached_token_delta=cfg.min_cached_token_delta, events=events,
            services=tuple(services))

    def _peer(self, tier: HostTier, lock: threading.RLock,
              services: list[Closeable]) -> PeerClient:
        """Serve the tier to peers and fetch from them (NIXL over the shared pool)."""
        from kvtier.tier.nixl import NixlPool
        from kvtier.tier.peer import PeerClient, PeerServer
        from kvtier.tier.pool import HostPool
        from kvtier.wire.peer import Identity

        cfg, g = self.cfg, self.geometry
        assert cfg.p2p_port is not None
        assert cfg.p2p_host is not None  # HostTierConfig.resolved: this host's address
        if self.tp_size != 1:
            # The peer protocol moves one pool per engine; with TP every rank has its
            # own (pool_tag), and a handshake that carries the TP layout is not built yet.
            raise ValueError(f"kvtier peer fetch (p2p_port) needs tensor_parallel_size 1, "
                             f"got {self.tp_size}")
        ident = Identity(self.model, g.block_size, cfg.hash_seed, g.layout, g.slot_bytes)
        pool = HostPool.shared(self.pool_tag, self.num_slots, g.slot_bytes)
        nixl = NixlPool(pool, f"kvtier-{self.pool_tag}")
        services.append(PeerServer(tier, lock, nixl, ident, cfg.p2p_host, cfg.p2p_port))
        return PeerClient(tier, lock, nixl, ident, cfg.peer_timeout_s)

    def _metrics(self, tier: HostTier, lock: threading.RLock) -> Closeable:
        from kvtier.tier.metrics import TierCollector, TierMetricsServer

        assert self.cfg.metrics_port is not None

        def snapshot() -> dict[str, Any]:
            with lock:
                return tier.stats.snapshot()

        collector = TierCollector(snapshot, tier.slot_bytes, tier.capacity_bytes,
                                  self.cfg.pod or self.engine_id, self.model)
        server = TierMetricsServer(collector, self.cfg.metrics_port, self.cfg.metrics_host)
        log.info("kvtier host tier metrics on %s", server.url)
        return server

    # -- worker half -------------------------------------------------------------------------
    def get_worker(self) -> TierWorker:
        from kvtier.tier.cuda_copy import HostPins
        from kvtier.tier.worker import TierWorker

        if self._pins is None:
            self._pins = HostPins()
        g = self.geometry
        return TierWorker(self.pool_tag, self.num_slots, g.slot_bytes, g.num_blocks,
                          g.layer_names, pins=self._pins)
