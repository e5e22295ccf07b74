"""Fast request-key computation for the indexer's hot paths (ingest and lookup).

Same values as ``kvtier.hashing.RequestKeyHasher.keys`` / ``.extend`` (the
unit tests check it), computed faster: the token list is packed with
``array.array('I')`` (~0.8 ms for 128k tokens) instead of ``np.asarray``
(~14 ms: numpy converts a list of Python ints element by element with
overflow checks), and one packing serves a chain that continues from a
parent key. Proposed upstream into kvtier/hashing.py; until then this is
the indexer's copy.

Threading model: pure functions.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

from kvtier.hashing import RequestKeyHasher
from kvtier.ids import RequestKey

_NATIVE_U32 = array("I").itemsize == 4 and sys.byteorder == "little"


def pack_u32le(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as little-endian uint32 bytes. Raises OverflowError/TypeError on bad ids."""
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    if _NATIVE_U32:
        return array("I", tokens).tobytes()
    return np.asarray(tokens, dtype="<u4").tobytes()  # pragma: no cover - big-endian hosts


def request_keys(hasher: RequestKeyHasher, tokens: Sequence[int] | np.ndarray,
                 parent: RequestKey | None = None) -> list[RequestKey]:
    """Keys of the full blocks of ``tokens``, chained after ``parent`` (None: from the root)."""
    bs = hasher.block_size
    n = len(tokens) // bs
    if n == 0:
        return []
    raw = pack_u32le(tokens[: n * bs])
    step = bs * 4
    h = xxhash.xxh3_64_intdigest
    seed = hasher.seed
    prev = int(hasher.root if parent is None else parent)
    out: list[RequestKey] = []
    append = out.append
    off = 0
    for _ in range(n):
        prev = h(prev.to_bytes(8, "little") + raw[off: off + step], seed)
        append(prev)  # type: ignore[arg-type]
        off += step
    return out
