"""Request keys of a prompt, fast: the same keys as ``kvtier.hashing.RequestKeyHasher.keys``.

The indexer hashes every prompt it is asked about and every block it is told
of, so this is its hottest loop. The chain is written once, in
``kvtier.hashing.chain_keys``: key(i) = xxh3_64(key(i-1) as 8 bytes
little-endian + block i's tokens as uint32 little-endian, seed), key(-1) = the
hasher's namespace root or the given parent. With the compiled helper built
(``kvtier.indexer.native``), lists and tuples are hashed in C: the same keys
(tested against ``RequestKeyHasher`` on random input).

Threading model: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from kvtier.hashing import RequestKeyHasher, chain_keys
from kvtier.ids import RequestKey
from kvtier.indexer.fastdecode import RawTokens
from kvtier.indexer.native import NATIVE

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
    """The pure-Python path (``prev``: the parent key or the hasher's root): the chain of
    ``kvtier.hashing.chain_keys``, which ``RequestKeyHasher.keys`` runs too."""
    return chain_keys(tokens, hasher.block_size, hasher.seed, prev)
