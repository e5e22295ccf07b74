"""Peer-fetch side-channel messages (``kvtier.tier.peer``): what two host tiers say over ZMQ.

    Hello(identity) -> Welcome(agent metadata, pool base) | Refused(reason)
    Hold(keys)      -> Held(lease, slots)
    Release(lease)  -> Ack

msgspec tagged structs, msgpack on the wire; a decoder validates types as it reads.

Threading model: immutable values and stateless codecs.
"""

from __future__ import annotations

import msgspec


class Identity(msgspec.Struct, frozen=True):
    """What must match for two tiers to exchange blocks."""

    model: str
    block_size: int
    hash_seed: int
    layout: str
    slot_bytes: int

    def mismatch(self, other: Identity) -> str | None:
        for f in ("model", "block_size", "hash_seed", "layout", "slot_bytes"):
            if getattr(self, f) != getattr(other, f):
                return f"{f} differs: {getattr(self, f)!r} != {getattr(other, f)!r}"
        return None


class Hello(msgspec.Struct, tag=True):
    identity: Identity


class Welcome(msgspec.Struct, tag=True):
    agent_metadata: bytes
    pool_base: int


class Refused(msgspec.Struct, tag=True):
    reason: str


class Hold(msgspec.Struct, tag="Lookup"):  # the wire tag predates the name
    """Pin the longest READY prefix of ``keys`` under a lease; answered by ``Held``."""

    keys: list[int]


class Held(msgspec.Struct, tag=True):
    lease: int  # 0: nothing pinned
    slots: list[int]


class Release(msgspec.Struct, tag=True):
    lease: int
    success: bool


class Ack(msgspec.Struct, tag=True):
    pass


Request = Hello | Hold | Release
Reply = Welcome | Refused | Held | Ack

_enc = msgspec.msgpack.Encoder()
_dec_req = msgspec.msgpack.Decoder(Request)
_dec_rep = msgspec.msgpack.Decoder(Reply)


def encode(msg: Request | Reply) -> bytes:
    return _enc.encode(msg)


def decode_request(data: bytes) -> Request:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` on anything else."""
    return _dec_req.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _dec_rep.decode(data)
