"""Request keys for the indexer's hot paths (ingest and lookup).

The fast packing that used to live here moved into
``kvtier.hashing.RequestKeyHasher.keys`` (which now also continues a chain
from a parent key); this name stays for the indexer's call sites.

Threading model: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.hashing import RequestKeyHasher, pack_u32le  # noqa: F401  (re-exported)
from kvtier.ids import RequestKey


def request_keys(hasher: RequestKeyHasher, tokens: Sequence[int] | np.ndarray,
                 parent: RequestKey | None = None) -> list[RequestKey]:
    """Keys of the full blocks of ``tokens``, chained after ``parent`` (None: from the root)."""
    return hasher.keys(tokens, parent)
