"""The worker half's CUDA path: the pinned pool and batched copies on side streams.

When the KV tensors live on a GPU, the pool is pinned once per mapping (``HostPins``:
cudaHostRegister, reference-counted by address, so a second ``pin`` of the same mapping
never registers it twice and never meets cudaErrorHostMemoryAlreadyRegistered; unregistered
by the last ``unpin``). The registry is an object, owned by the spec that makes the workers
(``kvtier.tier.spec.HostTierSpec``), not module state.

A step's stores and loads run on dedicated CUDA streams (``CudaCopier``): per chunk of up to
``stage_bytes / 2``, one strided copy per layer and run of consecutive blocks
(``index_select`` when the blocks are scattered) packs the chunk's blocks slot-major into a
device staging buffer, and one DMA per run of consecutive slots moves it to the pinned pool
(loads the other way round, ``index_copy_`` per layer); two staging buffers let one chunk's
gather overlap the other's DMA. The scattered gather of a store is one CUDA graph per staging
buffer (every layer's ``index_select`` from a device index buffer, captured once): a chunk
costs two launches (its index, the graph) instead of one per layer, because a store of a
few thousand scattered tokens was bound by the CPU launching ~200 kernels, not by the DMA. No pageable staging, no host-side gather. The copy streams
first wait for the forward stream (blocks written by earlier steps are complete); loads end
with an event the forward stream waits on before the step's forward (GPU-side: the CPU does
not block); stores run alongside the step's forward and are reported done only once their
event has completed (``kvtier.tier.worker``).

Threading model: ``CudaCopier`` is used only on the model runner's thread. ``HostPins`` is
thread-safe (one lock).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.tier.ops import runs

log = logging.getLogger(__name__)

CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


@dataclass
class KVLayer:
    """One layer of the engine's KV cache as the worker addresses it."""

    name: str
    view: torch.Tensor  # block dimension first
    offset: int  # of this layer's bytes in a pool slot
    nbytes: int
    rows: np.ndarray | None = None  # [num_blocks, nbytes] bytes, when host-contiguous


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


class HostPins:
    """The host ranges pinned for CUDA (cudaHostRegister), reference-counted by address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pinned: dict[int, list[int]] = {}  # base address -> [nbytes, refcount, owned 0/1]

    def pin(self, addr: int, nbytes: int) -> bool:
        """cudaHostRegister ``[addr, addr+nbytes)`` once; further calls for the same
        address only count references. True if the range is pinned (by this call, an
        earlier one, or someone else before us)."""
        with self._lock:
            entry = self._pinned.get(addr)
            if entry is not None:
                entry[1] += 1
                return True
            rc = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0))
            if rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                _clear_cuda_error()
                self._pinned[addr] = [nbytes, 1, 0]  # pinned by someone else: never unregister
                return True
            if rc != 0:
                _clear_cuda_error()
                return False
            self._pinned[addr] = [nbytes, 1, 1]
            return True

    def unpin(self, addr: int) -> None:
        """Drop one reference taken by ``pin``; the last one unregisters."""
        with self._lock:
            entry = self._pinned.get(addr)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._pinned[addr]
            if entry[2]:
                rc = int(torch.cuda.cudart().cudaHostUnregister(addr))
                if rc != 0:
                    _clear_cuda_error()
                    log.warning("kvtier worker: cudaHostUnregister failed (%s)", rc)

    def ranges(self) -> dict[int, tuple[int, int]]:
        """Address -> (bytes, references) of what is pinned (for tests)."""
        with self._lock:
            return {a: (e[0], e[1]) for a, e in self._pinned.items()}


STAGE_BYTES = 128 << 20  # device staging: two buffers of half this each
MAX_RUN_COPIES = 4  # runs of consecutive blocks per chunk copied as slices; more: index_select


class CudaCopier:
    """Batched gather/scatter between GPU KV layers and the pinned pool (see the
    module docstring). Two streams and two staging buffers form a pipeline: the
    gathers (stores) or scatters (loads) of one chunk run on ``stream`` while the
    DMA of the other chunk runs on ``dma``, so a copy costs about its DMA time plus
    one chunk's gather."""

    def __init__(self, layers: list[KVLayer], pool_t: torch.Tensor, slot_bytes: int,
                 stage_bytes: int = STAGE_BYTES, graph_gather: bool = True) -> None:
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
        # per stage: the device index of a scattered chunk and the graph gathering it
        self._idx = [torch.zeros(self.stage_slots, dtype=torch.long, device=self.device)
                     for _ in range(2)]
        self._graphs = self._capture_gathers() if graph_gather else None

    def _capture_gathers(self) -> list[torch.cuda.CUDAGraph] | None:
        """One graph per stage: ``index_select`` of every layer by ``_idx[i]`` into the
        stage's rows. None (per-layer kernels instead) where capture is not possible."""
        try:
            graphs = []
            for i in range(2):
                with torch.cuda.stream(self.stream):  # warm-up: kernels loaded before capture
                    self._gather_all(i)
                self.stream.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=self.stream, capture_error_mode="thread_local"):
                    self._gather_all(i)
                graphs.append(g)
            return graphs
        except Exception:  # pragma: no cover - the per-layer path still works
            log.warning("kvtier worker: CUDA graph gather not available", exc_info=True)
            return None

    def _gather_all(self, i: int) -> None:
        for layer, dst in zip(self.layers, self._views[i]):
            torch.index_select(layer.view, 0, self._idx[i], out=dst)

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

    def _gather(self, block_ids: Sequence[int], views: list[torch.Tensor], i: int = 0) -> None:
        """Stage ``i``'s rows ``0..len(block_ids)`` <- the blocks: one strided copy per layer
        and run of consecutive blocks (a few runs), else the stage's gather graph (its index
        padded with the last block: rows past the chunk are gathered and never copied out),
        else one index_select per layer."""
        rs = runs(block_ids, range(len(block_ids)))
        if len(rs) <= MAX_RUN_COPIES:
            for layer, dst in zip(self.layers, views):
                for b0, r0, n in rs:
                    dst[r0:r0 + n].copy_(layer.view[b0:b0 + n])
            return
        n = len(block_ids)
        if self._graphs is not None and views is self._views[i]:
            ids = np.full(self.stage_slots, block_ids[-1], dtype=np.int64)
            ids[:n] = block_ids
            # pinned source: the caching host allocator keeps it until this copy has run
            self._idx[i].copy_(torch.from_numpy(ids).pin_memory(), non_blocking=True)
            self._graphs[i].replay()
            return
        idx = self._index(block_ids)
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
                self._gather(b, self._views[i], i)
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
