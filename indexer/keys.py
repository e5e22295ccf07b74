"""Request keys of a prompt, fast: the same keys as ``kvtier.hashing.RequestKeyHasher.keys``.

The indexer hashes every prompt it is asked about and every block it is told
of, so this is its hottest loop. Same definition, bit for bit (tested against
``RequestKeyHasher`` on random input): key(i) = xxh3_64(key(i-1) as 8 bytes
little-endian + block i's tokens as uint32 little-endian, seed), key(-1) = the
hasher's namespace root or the given parent. Faster by doing less per block:
no NewType call, no per-call attribute lookups, ``int.to_bytes`` bound once
(128k tokens: 1.7 ms instead of 2.0-3.0 ms on the benchmark machine; see
benchmarks/README.md). With the compiled helper built
(``kvtier.indexer.native``), lists and tuples are hashed in C: same keys.

Threading model: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import xxhash

from kvtier.indexer.fastdecode import RawTokens
from kvtier.indexer.native import NATIVE

from kvtier.hashing import RequestKeyHasher, pack_u32le
from kvtier.ids import RequestKey

_native_keys = getattr(NATIVE, "request_keys", None)
_native_msgpack_keys = getattr(NATIVE, "request_keys_msgpack", None)


def request_keys(hasher: RequestKeyHasher, tokens: Sequence[int] | np.ndarray,
                 parent: RequestKey | None = None) -> list[RequestKey]:
    """``hasher.keys(tokens, parent)``, faster."""
    prev = int(hasher.root) if parent is None else int(parent)
    if _native_keys is not None and type(tokens) in (list, tuple):
        return cast(list[RequestKey], _native_keys(tokens, hasher.block_size, hasher.seed, prev))
    return python_request_keys(hasher, tokens, prev)


def block_keys(hasher: RequestKeyHasher, tokens: Sequence[int] | np.ndarray,
               parent: RequestKey | None, max_blocks: int) -> list[RequestKey]:
    """Keys of the first ``max_blocks`` full blocks of ``tokens`` (a list, or the event
    decoder's ``RawTokens``, hashed from its msgpack bytes without making Python ints)."""
    if isinstance(tokens, RawTokens):
        if _native_msgpack_keys is not None:
            prev = int(hasher.root) if parent is None else int(parent)
            keys, _ = _native_msgpack_keys(tokens.raw, hasher.block_size, hasher.seed, prev,
                                           max_blocks)
            return cast(list[RequestKey], keys)
        tokens = tokens.tolist()
    bs = hasher.block_size
    if len(tokens) >= (max_blocks + 1) * bs:   # blocks beyond max_blocks: not hashed
        tokens = tokens[: max_blocks * bs]
    return request_keys(hasher, tokens, parent)


def python_request_keys(hasher: RequestKeyHasher, tokens: Sequence[int] | np.ndarray,
                        prev: int) -> list[RequestKey]:
    """The pure-Python path (``prev``: the parent key or the hasher's root)."""
    bs = hasher.block_size
    n = len(tokens) // bs
    if n == 0:
        return []
    raw = pack_u32le(tokens[: n * bs])
    step = bs * 4
    h = xxhash.xxh3_64_intdigest
    seed = hasher.seed
    to_bytes = int.to_bytes
    out: list[int] = []
    append = out.append
    for off in range(0, n * step, step):
        prev = h(to_bytes(prev, 8, "little") + raw[off: off + step], seed)
        append(prev)
    return cast(list[RequestKey], out)   # RequestKey is an int NewType: no copy needed
