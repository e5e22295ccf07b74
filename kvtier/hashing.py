"""Block hashing: vLLM's engine hashes, recomputed, and kvtier's request keys.

Two key spaces (see kvtier.ids):

- ``EngineBlockHash``: what vLLM (>= 0.10, default ``sha256``) puts in its KV
  events. Per full block: ``h = sha256(pickle((parent, tuple(tokens), extra)))``
  with ``parent`` the previous block's 32-byte digest, or for the first block
  ``NONE_HASH = sha256(pickle(seed))`` where ``seed`` is ``$PYTHONHASHSEED`` if
  the engine has it set, else ``"vllm-none-hash"``. Events carry the low 64
  bits of the digest, big-endian. ``EngineHasher`` recomputes them exactly so
  tests and adapters can tie events back to tokens.
- ``RequestKey``: kvtier's own key, used by the index, host tier and peer
  fetch. xxh3-64 chained over the prefix: ``k_i = xxh3_64(k_{i-1} as u64 LE ||
  tokens as u32 LE, seed)``, with ``k_{-1} = xxh3_64(namespace, seed)`` and the
  namespace naming the model, LoRA and any extra keys. Fast (numpy packing),
  deterministic across processes, and independent of engine hash settings.

Only full blocks are keyed: a partial trailing block is never cached by vLLM.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import xxhash

from kvtier.ids import EngineBlockHash, ModelName, RequestKey

DEFAULT_VLLM_NONE_HASH_SEED = "vllm-none-hash"
_U64 = (1 << 64) - 1


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def to_external(digest: bytes) -> EngineBlockHash:
    """The 64-bit form vLLM publishes in KV events."""
    return EngineBlockHash(int.from_bytes(digest, "big") & _U64)


@dataclass(frozen=True)
class EngineHasher:
    """Recomputes vLLM's default (sha256) prefix-cache block hashes."""

    block_size: int
    seed: str = DEFAULT_VLLM_NONE_HASH_SEED

    def none_hash(self) -> bytes:
        return _sha256_pickle(self.seed)

    def digests(
        self, tokens: Sequence[int], extra_keys: Sequence[tuple | None] | None = None
    ) -> list[bytes]:
        parent = self.none_hash()
        out = []
        for i in range(len(tokens) // self.block_size):
            block = tuple(tokens[i * self.block_size: (i + 1) * self.block_size])
            extra = extra_keys[i] if extra_keys else None
            parent = _sha256_pickle((parent, block, extra))
            out.append(parent)
        return out

    def hashes(self, tokens: Sequence[int]) -> list[EngineBlockHash]:
        return [to_external(d) for d in self.digests(tokens)]


@dataclass(frozen=True)
class RequestKeyHasher:
    """kvtier's token-chained, seeded, namespaced block keys."""

    model: ModelName
    block_size: int
    seed: int = 0
    lora: str | None = None
    extra: str | None = None
    _root: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        ns = f"kvtier/v1|model={self.model}|lora={self.lora or ''}|extra={self.extra or ''}"
        object.__setattr__(self, "_root", xxhash.xxh3_64_intdigest(ns.encode(), self.seed))

    @property
    def root(self) -> RequestKey:
        return RequestKey(self._root)

    def keys(
        self, tokens: Sequence[int] | np.ndarray, parent: RequestKey | None = None
    ) -> list[RequestKey]:
        """Keys of every full block of ``tokens``, in order, chained after
        ``parent`` (None: from the namespace root)."""
        prev = self._root if parent is None else int(parent)
        return chain_keys(tokens, self.block_size, self.seed, prev)

    def extend(self, parent: RequestKey | None, tokens: Sequence[int]) -> list[RequestKey]:
        """Keys for full blocks of ``tokens`` continuing after ``parent``."""
        return self.keys(tokens, parent)


_NATIVE_U32 = array("I").itemsize == 4 and sys.byteorder == "little"


def pack_u32le(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as little-endian uint32 bytes; OverflowError/TypeError on bad ids.

    ``array('I')`` packs a list of Python ints ~15x faster than ``np.asarray``
    (which converts element by element with overflow checks): 0.8 vs 14 ms
    for 128k tokens, which is most of a long prompt's lookup time.
    """
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    if _NATIVE_U32:
        return array("I", tokens).tobytes()
    return np.asarray(tokens, dtype="<u4").tobytes()  # pragma: no cover - big-endian hosts


def chain_keys(tokens: Sequence[int] | np.ndarray, block_size: int, seed: int,
               prev: int) -> list[RequestKey]:
    """The key chain itself: keys of every full block of ``tokens`` after the key ``prev`` (the
    parent's, or a hasher's namespace root). ``RequestKeyHasher.keys`` and the indexer's
    pure-Python path (``kvtier.indexer.keys``) both call this; the indexer's C helper
    computes the same chain and is tested against it.

    The hottest loop of the indexer: per block only one ``bytes`` concatenation and one xxh3
    call (``int.to_bytes`` bound once, no ``RequestKey`` call: it is an int ``NewType``)."""
    n = len(tokens) // block_size
    if n == 0:
        return []
    raw = pack_u32le(tokens[: n * block_size])
    step = block_size * 4
    h = xxhash.xxh3_64_intdigest
    to_bytes = int.to_bytes
    out: list[int] = []
    append = out.append
    for off in range(0, n * step, step):
        prev = h(to_bytes(prev, 8, "little") + raw[off: off + step], seed)
        append(prev)
    return cast(list[RequestKey], out)


def token_digest(tokens: Sequence[int]) -> str:
    """A short, stable digest of an exact token sequence (prefix proofs)."""
    return xxhash.xxh3_128_hexdigest(pack_u32le(tokens))
