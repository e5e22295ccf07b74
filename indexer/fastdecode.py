"""Typed fast path for decoding KV-event batches; same results as ``kvtier.wire.kv_events``.

``kvtier.wire.kv_events.decode_payload`` decodes untyped and then reads every
field (and every block hash) with Python type guards: version tolerant, and
half of the indexer's ingest time. Here msgspec decodes vLLM 0.32's usual
shape (an array-like batch of "type"-tagged maps, uint64 int hashes) straight
into typed structs in C; anything else (array-encoded events, bytes hashes,
unknown event kinds, odd types) fails that typed decode and goes to
``kv_events.decode_payload``, so the answer (or the ``MalformedFrame``) is
always exactly what ``kv_events`` gives (tested on both shapes).

With the compiled helper (``kvtier.indexer.native``), a ``BlockStored``'s token
ids stay msgpack bytes (``RawTokens``, a lazy ``Sequence[int]`` equal to the
list) and are hashed straight from them: a 16-block event carries 512 tokens,
and making a Python int of each was most of the decoding time. The helper's
``decode_batch`` goes further: it reads the usual shape (a narrower one than
the typed structs accept: see its source) straight into ``kv_events``'
objects, and leaves anything else to the typed path here (None), so the answer
is still the typed path's (tested on both).

Threading model: pure functions; the decoder is stateless.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, cast, overload

import msgspec

from kvtier.ids import EngineBlockHash
from kvtier.indexer.native import NATIVE
from kvtier.wire import kv_events as kv

_U64 = int   # msgpack ints are in [-2**63, 2**64); negatives are folded as kv_events does
_MASK = (1 << 64) - 1


def _hashes(v: list[int]) -> tuple[EngineBlockHash, ...]:
    if v and min(v) < 0:
        return tuple(EngineBlockHash(h & _MASK) for h in v)
    return tuple(v)  # type: ignore[arg-type]


class RawTokens(Sequence[int]):
    """A msgpack-encoded array of token ids, decoded only if someone reads the items."""

    __slots__ = ("raw", "_n", "_list")

    def __init__(self, raw: bytes, n: int) -> None:
        self.raw, self._n = raw, n
        self._list: list[Any] | None = None

    @staticmethod
    def array_len(raw: bytes) -> int | None:
        """Length of a msgpack array from its header; None if ``raw`` is no array."""
        if not raw:
            return None
        b = raw[0]
        if 0x90 <= b <= 0x9F:
            return b & 0x0F
        if b == 0xDC and len(raw) >= 3:
            return int.from_bytes(raw[1:3], "big")
        if b == 0xDD and len(raw) >= 5:
            return int.from_bytes(raw[1:5], "big")
        return None

    def tolist(self) -> list[Any]:
        if self._list is None:
            self._list = msgspec.msgpack.decode(self.raw)
        return self._list

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        return self.tolist()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawTokens):
            return self.raw == other.raw or self.tolist() == other.tolist()
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RawTokens({self._n} tokens)"


_RAW_TOKENS = NATIVE is not None and hasattr(NATIVE, "request_keys_msgpack")


class _NotUsual(Exception):
    """A shape the typed path leaves to kv_events."""


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[_U64]
    token_ids: msgspec.Raw if _RAW_TOKENS else list[Any]  # type: ignore[valid-type]
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    parent_block_hash: _U64 | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[_U64]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_typed = msgspec.msgpack.Decoder(_Batch).decode


def _tokens(v: Any) -> Any:
    if not _RAW_TOKENS:
        return v
    raw = bytes(v)
    n = RawTokens.array_len(raw)
    if n is None:   # not a list: kv_events says what is wrong
        raise _NotUsual
    return RawTokens(raw, n)


def _event(e: _Stored | _Removed | _Cleared) -> kv.KVEvent:
    if type(e) is _Stored:
        return kv.BlockStored(
            block_hashes=_hashes(e.block_hashes),
            parent_block_hash=None if e.parent_block_hash is None
            else EngineBlockHash(e.parent_block_hash & _MASK),
            token_ids=cast(list[int], _tokens(e.token_ids)), block_size=e.block_size,
            medium=e.medium,
            lora_name=e.lora_name,
            has_extra_keys=bool(e.extra_keys) and any(x for x in e.extra_keys or ()),
            group_idx=e.group_idx)
    if type(e) is _Removed:
        return kv.BlockRemoved(block_hashes=_hashes(e.block_hashes), medium=e.medium,
                               group_idx=e.group_idx)
    return kv.AllBlocksCleared()


def _slots(cls: type, *names: str) -> tuple[Any, ...] | None:
    """``cls``'s slot descriptors in this order, or None if ``names`` are not its fields
    (``kv_events`` changed: the compiled decoder, which fills exactly these, is not used)."""
    have = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) \
        else tuple(getattr(cls, "__slots__", ()))
    if have != names:
        return None
    return tuple(cls.__dict__[n] for n in names)


def _native_classes() -> tuple[Any, ...] | None:
    parts = (kv.EventBatch, _slots(kv.EventBatch, "seq", "ts", "events", "dp_rank"),
             kv.BlockStored, _slots(kv.BlockStored, "block_hashes", "parent_block_hash",
                                    "token_ids", "block_size", "medium", "lora_name",
                                    "has_extra_keys", "group_idx"),
             kv.BlockRemoved, _slots(kv.BlockRemoved, "block_hashes", "medium", "group_idx"),
             kv.AllBlocksCleared, RawTokens, _slots(RawTokens, "raw", "_n", "_list"))
    if any(p is None for p in parts) or dataclasses.fields(kv.AllBlocksCleared):
        return None
    return parts


_CLASSES = _native_classes() if _RAW_TOKENS else None
_native_decode = getattr(NATIVE, "decode_batch", None) if _CLASSES is not None else None


def decode_payload(seq: int, payload: bytes) -> kv.EventBatch:
    """``kv_events.decode_payload``, faster on the usual shape."""
    if _native_decode is not None:
        got: kv.EventBatch | None = _native_decode(payload, seq, _CLASSES)
        if got is not None:
            return got
    return typed_decode_payload(seq, payload)


def typed_decode_payload(seq: int, payload: bytes) -> kv.EventBatch:
    """``decode_payload`` without the compiled decoder: msgspec's typed structs."""
    try:
        b = _typed(payload)
        events = [_event(e) for e in b.events]
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, _NotUsual):
        return kv.decode_payload(seq, payload)
    return kv.EventBatch(seq=seq, ts=float(b.ts), events=events, dp_rank=b.data_parallel_rank)


def decode_frames(frames: list[bytes]) -> kv.EventBatch:
    """``kv_events.decode_frames``, faster on the usual shape."""
    if len(frames) != 3:
        raise kv.MalformedFrame(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    return decode_payload(kv.decode_seq(frames[1]), frames[2])
