"""Optional compiled helpers of the indexer (C, built from source by ``build``).

``_kvtier_indexer_native`` (installed into the running interpreter's
site-packages by ``python -m kvtier.indexer.native.build``; C sources here:
``kvtier_native.c`` keys and the module, ``index_ops.c`` the index's loops,
``decode.c`` the event decoder) has the indexer's hot loops: ``decode_batch``
(a vLLM event batch of the usual shape straight into ``kv_events`` objects,
None for any other shape), ``request_keys`` (request keys exactly as
``kvtier.hashing.RequestKeyHasher.keys``), ``request_keys_msgpack`` (the same
from an event's msgpack-encoded token array), ``walk`` / ``lookup`` (the
bitmask prefix walk of ``MemoryIndex.lookup``; ``lookup`` only on CPython
3.11, it reads int digits), ``store`` (``MemoryIndex.store``'s loop),
``store_tokens`` (hashing and ``store`` in one call) and ``route_rows`` (the
per-holder loops of a ``/v1/route`` answer, ``kvtier.indexer.select``).
``NATIVE`` is the module, or None when it was not built; every caller keeps a
pure-Python path that gives identical answers (tests compare both).
Set ``KVTIER_INDEXER_NATIVE=0`` to use the pure-Python path anyway.
``HOT_PATH`` says which path this process uses (``kvtier indexer`` logs it at start).

Threading model: the C functions hold the GIL and keep no state.
"""

from __future__ import annotations

import os
from types import ModuleType

NATIVE: ModuleType | None = None
HOT_PATH: str
if os.environ.get("KVTIER_INDEXER_NATIVE", "1") == "0":
    HOT_PATH = "pure Python (KVTIER_INDEXER_NATIVE=0)"
else:
    try:
        import _kvtier_indexer_native as NATIVE  # type: ignore[import-not-found, no-redef]
    except ImportError as e:
        NATIVE = None
        HOT_PATH = (f"pure Python (C helper not built: {e}; "
                f"python -m kvtier.indexer.native.build builds it)")
    else:
        HOT_PATH = f"C helper {getattr(NATIVE, '__file__', '(built in)')}"
