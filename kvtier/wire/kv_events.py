"""vLLM KV-event wire decoding: ZMQ frames -> typed, version-tolerant events.

The wire (vLLM 0.32, ``vllm/distributed/kv_events.py``):

- ZMQ PUB multipart ``(topic, seq, payload)``; ``seq`` is an 8-byte
  big-endian counter per publisher, starting at 0 when the engine starts.
- ``payload`` is msgpack of ``EventBatch``, an *array-like* struct
  ``[ts, events, data_parallel_rank]`` (trailing defaults may be omitted).
- Each event is a msgspec tagged struct. In 0.32 they are encoded as maps
  with ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`` and
  fields at their default omitted. Older vLLM releases encoded them as
  arrays with the tag first (``["BlockStored", hashes, parent, tokens,
  block_size, lora_id, medium, ...]``); both forms are accepted here.
- Block hashes are ``int`` (uint64) or ``bytes`` (the full sha256 digest)
  depending on ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``; bytes are folded to
  the low 64 bits big-endian, the same value the int form carries.

Decoding is untyped (``msgspec.msgpack.decode``) and then read by key or
position with length and type guards, so a newer vLLM that adds fields, or
an older one that lacks some, degrades (unknown event kinds are counted and
skipped) instead of crashing the daemon. Anything that cannot be read raises
``MalformedFrame``; the subscriber counts it and moves on.

Encoding (``StoredOut``, ``RemovedOut``, ``ClearedOut`` in a ``BatchOut``) mirrors vLLM's own
structs, so the host tier's events read exactly like an engine's.

Threading model: pure functions and immutable structs, no shared state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.ids import EngineBlockHash

_U64 = (1 << 64) - 1
END_SEQ = _U64  # vLLM's replay end marker: (-1).to_bytes(8, "big", signed=True)

_decode = msgspec.msgpack.Decoder().decode


class MalformedFrame(ValueError):
    """A multipart message or payload that cannot be read as a KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None
    token_ids: tuple[int, ...] | list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    # True when any block carries extra hash keys (multimodal ids, cache salt,
    # prompt embeddings): such blocks cannot be found from token ids alone.
    has_extra_keys: bool = False
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineBlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event kind this kvtier does not know (newer vLLM); counted, skipped."""

    kind: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None


def to_hash(v: Any) -> EngineBlockHash:
    if isinstance(v, int) and not isinstance(v, bool):
        return EngineBlockHash(v & _U64)
    if isinstance(v, (bytes, bytearray)) and v:
        return EngineBlockHash(int.from_bytes(v, "big") & _U64)
    raise MalformedFrame(f"block hash must be int or bytes, got {type(v).__name__}")


def _hashes(v: Any) -> tuple[EngineBlockHash, ...]:
    if not isinstance(v, list):
        raise MalformedFrame("block_hashes must be a list")
    return tuple(to_hash(h) for h in v)


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _has_extra(v: Any) -> bool:
    return isinstance(v, list) and any(e for e in v)


# Field order of the array (tagged, array_like) encoding, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _as_map(raw: Any) -> tuple[str, dict]:
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise MalformedFrame("event map without a string 'type' tag")
        return kind, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        return kind, dict(zip(names, raw[1:]))
    raise MalformedFrame(f"event must be a tagged map or array, got {type(raw).__name__}")


def decode_event(raw: Any) -> KVEvent:
    kind, m = _as_map(raw)
    if kind == "BlockStored":
        tokens = m.get("token_ids")
        bs = m.get("block_size")
        # block_size 0 with no tokens: vLLM's CPU offloading naming blocks by hash alone
        if not isinstance(tokens, list) or not isinstance(bs, int) or bs < 0 or (
                bs == 0 and tokens):
            raise MalformedFrame("BlockStored needs token_ids (list) and block_size (int > 0, "
                                 "or 0 with no tokens)")
        parent = m.get("parent_block_hash")
        return BlockStored(
            block_hashes=_hashes(m.get("block_hashes")),
            parent_block_hash=None if parent is None else to_hash(parent),
            token_ids=tokens,
            block_size=bs,
            medium=_opt_str(m.get("medium")),
            lora_name=_opt_str(m.get("lora_name")),
            has_extra_keys=_has_extra(m.get("extra_keys")),
            group_idx=_opt_int(m.get("group_idx")),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(m.get("block_hashes")),
            medium=_opt_str(m.get("medium")),
            group_idx=_opt_int(m.get("group_idx")),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(kind)


def decode_payload(seq: int, payload: bytes) -> EventBatch:
    """Decode one msgpack EventBatch. Raises MalformedFrame."""
    try:
        obj = _decode(payload)
    except (msgspec.DecodeError, ValueError) as e:
        raise MalformedFrame(f"payload is not msgpack: {e}") from None
    if isinstance(obj, dict):  # a map-encoded batch (not what vLLM sends, but harmless)
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, list) or len(obj) < 2:
        raise MalformedFrame("payload must be an array [ts, events, dp_rank?]")
    ts, events = obj[0], obj[1]
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise MalformedFrame("payload must start with ts (number) and events (list)")
    dp = _opt_int(obj[2]) if len(obj) > 2 else None
    return EventBatch(seq=seq, ts=float(ts), events=[decode_event(e) for e in events], dp_rank=dp)


def decode_seq(b: bytes) -> int:
    if not isinstance(b, (bytes, bytearray, memoryview)) or len(b) != 8:
        raise MalformedFrame("sequence frame must be 8 bytes")
    return int.from_bytes(b, "big")


def decode_frames(frames: list[bytes]) -> EventBatch:
    """Decode a PUB multipart message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise MalformedFrame(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    return decode_payload(decode_seq(frames[1]), frames[2])


# --- encoding: the inverse, used by tests, benchmarks and snapshot tooling ---------

_encode = msgspec.msgpack.Encoder().encode


def encode_stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int,
                  medium: str | None = "GPU", **extra: Any) -> dict:
    ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
          "token_ids": list(tokens), "block_size": block_size, "lora_id": None,
          "medium": medium, "lora_name": None}
    ev.update(extra)
    return ev


def encode_removed(hashes: list[int], medium: str | None = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def encode_cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[dict], ts: float = 0.0, dp_rank: int | None = 0) -> bytes:
    return _encode([ts, events, dp_rank])


def encode_frames(topic: str, seq: int, events: list[dict]) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), encode_batch(events)]


# ---- encoding: what kvtier's host tier publishes ----------------------------------------



class EventOut(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Encoder side: the structs kvtier's host tier publishes (vLLM's own field order)."""


class StoredOut(EventOut, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    # Required (no default) as in vLLM, so they are always on the wire.
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class RemovedOut(EventOut, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ClearedOut(EventOut, tag="AllBlocksCleared"):
    pass


class BatchOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[EventOut]
    data_parallel_rank: int | None = None
