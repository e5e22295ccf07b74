"""The worker half's CUDA path: the pinned pool and batched copies on side streams.

When the KV tensors live on a GPU, the pool is pinned once per mapping (``HostPins``:
cudaHostRegister, reference-counted by address, so a second ``pin`` of the same mapping
never registers it twice and never meets cudaErrorHostMemoryAlreadyRegistered; unregistered
by the last ``unpin``). The registry is an object, owned by the spec that makes the workers
(``kvtier.tier.spec.HostTierSpec``), not module state.

Stores can be DMA only (``dma_stores``, opt-in, pinned pool only): one
``cuMemcpyBatchAsync`` per store on the ``dma`` stream, one descriptor per block, layer and
contiguous piece of the block (K and V in vLLM's FlashAttention layout), straight from the
KV cache into the pool slots, no kernel. It is not the default: the driver spends time of
the calling thread (the model runner's) on every descriptor, and a store of thousands of
32 KiB pieces is slower than the gather below and holds up the next step (docs/gpu.md).

Loads and stores (without ``dma_stores``) run on two streams: per chunk of up to
``stage_bytes / 2``, one strided copy per layer and run of consecutive blocks
(``index_select`` when the blocks are scattered) packs the chunk's blocks slot-major into a
device staging buffer, and one DMA per run of consecutive slots moves it to the pinned pool
(loads the other way round, ``index_copy_`` per layer); two staging buffers let one chunk's
gather overlap the other's DMA. The scattered gather of a store is one CUDA graph per staging
buffer (every layer's ``index_select`` from a device index buffer, captured once): a chunk
costs two launches (its index, the graph) instead of one per layer. No pageable staging, no
host-side gather. The copy streams first wait for the forward stream (blocks written by
earlier steps are complete); loads end with an event the forward stream waits on before the
step's forward (GPU-side: the CPU does not block); stores run alongside the next forwards and
are reported done only once their event has completed (``kvtier.tier.worker`` polls it).

Threading model: ``CudaCopier`` is used only on the model runner's thread. ``HostPins`` is
thread-safe (one lock).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
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


class _MemLocation(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


# The source is the live KV cache: read it in stream order (after the forward it waits for).
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
# cuMemcpyBatchAsync as introduced in CUDA 12.8 (with failIdx). Asked for by that version
# through cuGetProcAddress, so a CUDA 13 driver (whose default symbol dropped failIdx) hands
# out the same ABI.
_BATCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
MAX_PIECES_PER_BLOCK = 64  # contiguous pieces of one layer's block; more: gather instead


def batch_memcpy() -> Callable[..., int] | None:
    """The driver's ``cuMemcpyBatchAsync`` (12.8 form), or None where the driver lacks it."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        pfn = ctypes.c_void_p()
        status = ctypes.c_int()
        get = lib.cuGetProcAddress_v2
        get.restype = ctypes.c_int
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        rc = get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), 12080, 0, ctypes.byref(status))
        if rc != 0 or status.value != 0 or not pfn.value:
            return None
        return _BATCH_FN(pfn.value)
    except (OSError, AttributeError):
        return None


def block_pieces(view: torch.Tensor) -> list[tuple[int, int, int]]:
    """(byte offset from the block's start in the KV tensor, byte offset in the slot's page
    of this layer, bytes) of every contiguous piece of one block of a block-first layer
    view, in the page's (C) order. vLLM's FlashAttention layout ``[2, num_blocks, ...]``
    moved block-first gives two pieces (K, V); a block-first contiguous layout gives one."""
    shape, strides = list(view.shape[1:]), list(view.stride()[1:])
    elt = view.element_size()
    inner, k = 1, len(shape)
    while k > 0 and (strides[k - 1] == inner or shape[k - 1] == 1):
        inner *= shape[k - 1]
        k -= 1
    out = []
    for i, idx in enumerate(itertools.product(*(range(n) for n in shape[:k]))):
        src = sum(a * b for a, b in zip(idx, strides[:k])) * elt
        out.append((src, i * inner * elt, inner * elt))
    return out


STAGE_BYTES = 128 << 20  # device staging: two buffers of half this each
MAX_RUN_COPIES = 4  # runs of consecutive blocks per chunk copied as slices; more: index_select


class CudaCopier:
    """Copies between GPU KV layers and the pinned pool (see the module docstring).
    Stores: one batch copy on ``dma`` when ``dma_stores`` (no kernel, opt-in). Loads
    and other stores: two streams and two staging buffers form a pipeline, the
    gathers or scatters of one chunk run on ``stream`` while the DMA of the other
    chunk runs on ``dma``, so a copy costs about its DMA time plus one chunk's gather."""

    def __init__(self, layers: list[KVLayer], pool_t: torch.Tensor, slot_bytes: int,
                 stage_bytes: int = STAGE_BYTES, graph_gather: bool = True,
                 dma_stores: bool = False) -> None:
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
        self._batch = self._batch_stores() if dma_stores else None

    def _batch_stores(self) -> Callable[..., int] | None:
        """The batch copy and its per-piece descriptors (source base address, block stride,
        destination offset in a slot, bytes) when every layer splits into few pieces and a
        test store through it lands exactly; None (gather stores) otherwise."""
        fn = batch_memcpy()
        if fn is None:
            log.info("kvtier worker: no cuMemcpyBatchAsync; stores gather on SMs")
            return None
        src, stride, dst, size = [], [], [], []
        for layer in self.layers:
            pieces = block_pieces(layer.view)
            if len(pieces) > MAX_PIECES_PER_BLOCK:
                return None
            for s_off, d_off, n in pieces:
                src.append(layer.view.data_ptr() + s_off)
                stride.append(layer.view.stride(0) * layer.view.element_size())
                dst.append(self.pool_t.data_ptr() + layer.offset + d_off)
                size.append(n)
        self._p_src = np.array(src, dtype=np.uint64)
        self._p_stride = np.array(stride, dtype=np.uint64)
        self._p_dst = np.array(dst, dtype=np.uint64)
        self._p_size = np.array(size, dtype=np.uint64)
        self._attrs = _MemcpyAttributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        self._attrs_idx = ctypes.c_size_t(0)
        self._fail_idx = ctypes.c_size_t(0)
        try:  # one block into the last slot, compared with the gather path's bytes
            b, s = self.layers[0].view.shape[0] - 1, self.pool_t.shape[0] - 1
            keep = self.pool_t[s].clone()
            self.begin()
            self._store_batch(fn, [b], [s])
            self.dma.synchronize()
            got = self.pool_t[s].clone()
            self._gather([b], self._views[0])  # on the current stream
            torch.cuda.synchronize(self.device)
            ok = torch.equal(got, self.stages[0][0].cpu())
            self.pool_t[s].copy_(keep)
        except Exception:  # pragma: no cover - gather stores still work
            log.warning("kvtier worker: batch copy store failed its check", exc_info=True)
            return None
        if not ok:
            log.warning("kvtier worker: batch copy store moved wrong bytes; stores gather")
            return None
        return fn

    def _store_batch(self, fn: Callable[..., int], block_ids: Sequence[int],
                     slots: Sequence[int]) -> None:
        """Queue one ``cuMemcpyBatchAsync`` on ``dma``: every piece of every block, from the
        KV cache straight into its slot (no staging, no kernel)."""
        b = np.asarray(block_ids, dtype=np.uint64)
        s = np.asarray(slots, dtype=np.uint64)
        src = (self._p_src[:, None] + self._p_stride[:, None] * b[None, :]).ravel()
        dst = (self._p_dst[:, None] + np.uint64(self.slot_bytes) * s[None, :]).ravel()
        size = np.repeat(self._p_size, len(b))
        rc = fn(dst.ctypes.data, src.ctypes.data, size.ctypes.data, src.size,
                ctypes.addressof(self._attrs), ctypes.byref(self._attrs_idx), 1,
                ctypes.byref(self._fail_idx), self.dma.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc}, "
                               f"copy {self._fail_idx.value}")

    @property
    def dma_stores(self) -> bool:
        """True when stores are one batch copy each (no SM kernel)."""
        return self._batch is not None

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
        if self._batch is not None:
            try:
                self._store_batch(self._batch, block_ids, slots)
                ev.record(self.dma)
                return ev
            except RuntimeError:  # the driver refused it: gather from now on
                log.warning("kvtier worker: batch copy store failed; stores gather from now on",
                            exc_info=True)
                self._batch = None
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
