"""Decode nodes' finished-request ``kv_transfer_params``, published off the response path.

vLLM 0.32 returns ``kv_transfer_params`` only in non-streaming responses, so a router that
streams the decode leg never sees what the decode node retained. kvtier's thin NixlConnector
subclass (``kvtier.connectors.params_feed``) publishes, for every finished request, the params
NixlConnector returned plus the request's token ids (prompt + generated) on a ZMQ PUB socket;
the router subscribes to each decode node and matches a message to its leg by a tag it put
in the leg's ``X-Request-Id`` (vLLM's engine request id is ``chatcmpl-<X-Request-Id>-<8
random>`` or ``cmpl-<X-Request-Id>-0-<8 random>``; the tag survives any prefix or suffix).

Frames: ``[TOPIC, json]`` with json ``{"v": 1, "request_id": str, "kv_transfer_params":
{...}, "token_ids": [int, ...]}``. Delivery is best effort (PUB drops when no one listens
or the high-water mark is reached): a turn whose params never arrive just is not retained.

Threading model: pure functions.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOPIC = b"kvtier.params"
VERSION = 1
# The decode node's PUB port when the connector config names no endpoint.
PORT_ENV = "KVTIER_PARAMS_FEED_PORT"
# What the connector binds when the config has no ``params_feed_endpoint``.
ENDPOINT_KEY = "params_feed_endpoint"
# Else: bind NIXL's side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT) plus this offset.
OFFSET_KEY = "params_feed_port_offset"

_TAG = re.compile(r"kvt([0-9a-f]{20})")


def new_tag() -> str:
    """A fresh leg tag to embed in ``X-Request-Id``."""
    return "kvt" + uuid.uuid4().hex[:20]


def tag_of(engine_request_id: str) -> str | None:
    """The leg tag inside an engine request id, if any (the last one wins)."""
    found = _TAG.findall(engine_request_id)
    return "kvt" + found[-1] if found else None


@dataclass(frozen=True)
class FinishedParams:
    request_id: str
    kv_transfer_params: dict[str, Any]
    token_ids: tuple[int, ...]

    @property
    def tag(self) -> str | None:
        return tag_of(self.request_id)

    def frames(self) -> list[bytes]:
        body = {"v": VERSION, "request_id": self.request_id,
                "kv_transfer_params": self.kv_transfer_params,
                "token_ids": list(self.token_ids)}
        return [TOPIC, json.dumps(body, separators=(",", ":")).encode()]

    @classmethod
    def parse(cls, frames: list[bytes]) -> FinishedParams | None:
        """None for anything that is not a well-formed message of this version."""
        if len(frames) != 2 or frames[0] != TOPIC:
            return None
        try:
            body = json.loads(frames[1])
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(body, dict) or body.get("v") != VERSION:
            return None
        rid, kvp, ids = body.get("request_id"), body.get("kv_transfer_params"), \
            body.get("token_ids")
        if not isinstance(rid, str) or not isinstance(kvp, dict) or not isinstance(ids, list) \
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                           for t in ids):
            return None
        return cls(rid, kvp, tuple(ids))
