"""Decode-side lease control: the messages between a router and a decode node's lease server.

In bidirectional P/D a decode node keeps a finished turn's blocks so the next turn's prefill
can read them (vLLM: for ``decoder_kv_blocks_ttl``, 480 s, fixed). kvtier's decode connector
(``KVTierNixlConnector`` with ``decode_lease_s``) holds them under a lease instead: granted when
the turn finishes, renewed by the router while the conversation is worth holding, released
early when it is not; vLLM's TTL stays the upper bound. Requests name the decode node's engine
request id (``remote_request_id`` in the params it returned).

Transport: ZMQ. The decode node binds a ROUTER socket; a client sends one frame (a DEALER, or
a REQ, whose empty delimiter the server keeps) and gets one frame back. Body: JSON
``{"v": 1, "op": "renew"|"release"|"stats", "request_ids": [str, ...], "lease_s": float?,
"reason": str?}``; reply ``{"v": 1, "ok": bool, "leases": {id: {"held": bool,
"expires_in_s": float, "deadline": float}}, "stats": {...}, "error": str?}``. ``deadline`` is
on the decode node's scheduler clock (``time.perf_counter`` there), the clock of
``remote_blocks_expiry_time``: a router patches it into the params it hands a prefill so the
prefill declines a read that would land after the lease (vLLM keeps a 5 s safety margin).

Threading model: pure data plus ``call``, a blocking one-shot client for tools and tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

VERSION = 1
# Where the decode node binds its lease server when the config names no endpoint:
ENDPOINT_KEY = "lease_endpoint"
PORT_ENV = "KVTIER_LEASE_PORT"
# else NIXL's side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT) plus this offset
OFFSET_KEY = "lease_port_offset"
# The lease a finished turn gets (seconds); 0 or absent: no leases, vLLM's TTL as before.
LEASE_KEY = "decode_lease_s"
# A per-request lease in the decode leg's kv_transfer_params (the router's choice).
PARAM_KEY = "kvtier_decode_lease_s"
# ``false`` in the decode leg's kv_transfer_params: keep nothing of this turn (its blocks are
# freed when it finishes, as on a unidirectional decode node, and the params it returns name
# no blocks). The router sends it for a turn its hold policy would release at once anyway.
RETAIN_KEY = "kvtier_decode_retain"


class Op(StrEnum):
    RENEW = "renew"
    RELEASE = "release"
    STATS = "stats"


class ReleaseReason(StrEnum):
    """Why a lease was given up early (the ``reason`` label of the release counter)."""

    CLOSED = "closed"        # the client closed the conversation
    DROPPED = "dropped"      # the router dropped the params (stale, evicted, store full)
    TRIMMED = "trimmed"      # the next prompt diverged inside the retained tokens
    MOVED = "moved"          # the next turn is served from the host copy or recomputed
    OTHER = "other"


class ProtocolError(ValueError):
    """A malformed lease message."""


@dataclass(frozen=True)
class LeaseRequest:
    op: Op
    request_ids: tuple[str, ...] = ()
    lease_s: float | None = None
    reason: ReleaseReason = ReleaseReason.OTHER

    def encode(self) -> bytes:
        body: dict[str, Any] = {"v": VERSION, "op": self.op.value,
                                "request_ids": list(self.request_ids)}
        if self.lease_s is not None:
            body["lease_s"] = self.lease_s
        if self.op is Op.RELEASE:
            body["reason"] = self.reason.value
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LeaseRequest:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ProtocolError(f"not JSON: {e}") from None
        if not isinstance(body, dict) or body.get("v") != VERSION:
            raise ProtocolError(f"expected an object with v={VERSION}")
        try:
            op = Op(str(body.get("op")))
        except ValueError:
            raise ProtocolError(f"unknown op {body.get('op')!r}; one of "
                                f"{[o.value for o in Op]}") from None
        ids = body.get("request_ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
            raise ProtocolError("request_ids must be a list of non-empty strings")
        lease = body.get("lease_s")
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int | float)
                                  or not lease > 0):
            raise ProtocolError(f"lease_s must be a positive number, not {lease!r}")
        try:
            reason = ReleaseReason(body.get("reason", ReleaseReason.OTHER.value))
        except ValueError:
            raise ProtocolError(f"unknown reason {body.get('reason')!r}; one of "
                                f"{[r.value for r in ReleaseReason]}") from None
        return cls(op, tuple(ids), float(lease) if lease is not None else None, reason)


@dataclass(frozen=True)
class LeaseState:
    held: bool
    expires_in_s: float = 0.0
    deadline: float = 0.0  # the decode node's scheduler clock


@dataclass(frozen=True)
class LeaseReply:
    ok: bool
    leases: dict[str, LeaseState] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "v": VERSION, "ok": self.ok,
            "leases": {k: {"held": s.held, "expires_in_s": round(s.expires_in_s, 3),
                           "deadline": s.deadline} for k, s in self.leases.items()},
            "stats": self.stats}
        if self.error is not None:
            body["error"] = self.error
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LeaseReply:
        try:
            body = json.loads(raw)
            leases = {str(k): LeaseState(bool(v["held"]), float(v["expires_in_s"]),
                                         float(v["deadline"]))
                      for k, v in (body.get("leases") or {}).items()}
            return cls(bool(body["ok"]), leases, dict(body.get("stats") or {}),
                       body.get("error"))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ProtocolError(f"malformed lease reply: {e!r}") from None


def call(endpoint: str, req: LeaseRequest, timeout_s: float = 2.0) -> LeaseReply:
    """One request to a lease server (blocking). Raises ``TimeoutError`` when it does not
    answer within ``timeout_s``."""
    import zmq

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(req.encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"lease server {endpoint} did not answer in {timeout_s} s")
        return LeaseReply.decode(sock.recv())
    finally:
        sock.close(0)
