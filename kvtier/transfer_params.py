"""Typed, versioned ``kv_transfer_params``: what flows between router and engines.

vLLM passes ``kv_transfer_params`` through requests and responses as a plain
dict and MultiConnector merges children's dicts with ``dict.update``. kvtier
parses that dict once, at the edge, into these models and writes it back with
``to_wire()``. Unknown keys are kept (``extra="allow"``) so a newer vLLM that
adds fields degrades instead of breaking the router.

Shapes:

- ``NixlParams``: NixlConnector's fields (pull mode, bidirectional). From a
  prefill response they tell the decode node where to read the prompt's KV;
  from a decode response (bidirectional mode) they tell the *next* prefill
  where to read the previous turn's KV (prompt + generated tokens).
- ``RemoteKVSource``: a peer host tier to pull a prefix from (kvtier's host
  tier, see issue "tiered store"); field names follow llm-d's
  ``remote_kv_source`` (host, port, pod, num_tokens) plus the handshake facts
  the consumer checks (model, block size, hash seed).
- ``KVTransferParams``: the envelope: NIXL fields at top level (where vLLM
  expects them), ``remote_kv_source`` nested, and ``kvtier_version``.

Note ``remote_blocks_expiry_time`` is ``time.perf_counter()`` of the decode
process in vLLM 0.32: a monotonic clock of another process, meaningless to the
router. The router computes its own expiry from the configured TTL.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PARAMS_VERSION = 1

# Every key a client could use to smuggle transfer instructions to an engine.
INBOUND_STRIP_KEYS = ("kv_transfer_params",)
INBOUND_STRIP_HEADERS = (
    "x-kv-source",
    "x-kvtier-source",
    "x-prefiller-host-port",
    "x-remote-kv-source",
)


class RemoteKVSource(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    pod: str
    host: str
    port: int = Field(ge=1, le=65535)
    num_tokens: int = Field(ge=0)
    model: str | None = None
    block_size: int | None = Field(default=None, ge=1)
    hash_seed: int | None = None


class NixlParams(BaseModel):
    """NixlConnector's kv_transfer_params (vLLM 0.32, pull mode)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_block_ids: list[list[int]] | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    tp_size: int | None = None
    transfer_mode: Literal["pull", "push"] | None = None

    @property
    def has_remote_blocks(self) -> bool:
        return bool(self.remote_block_ids and any(self.remote_block_ids)) and all(
            v is not None
            for v in (self.remote_engine_id, self.remote_request_id, self.remote_host,
                      self.remote_port)
        )

    def trimmed(self, num_tokens: int, block_size: int) -> NixlParams | None:
        """Restrict to the first ``num_tokens`` (aligned down to blocks).

        Used when only a prefix of the retained KV is proven to match the new
        prompt. Returns None when nothing is left to reuse.
        """
        keep_blocks = num_tokens // block_size
        if keep_blocks <= 0 or not self.has_remote_blocks:
            return None
        blocks = [g[:keep_blocks] for g in (self.remote_block_ids or [])]
        held = self.remote_num_tokens or 0
        return self.model_copy(
            update={"remote_block_ids": blocks,
                    "remote_num_tokens": min(held, keep_blocks * block_size)}
        )


class KVTransferParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    kvtier_version: int = PARAMS_VERSION
    nixl: NixlParams | None = None
    remote_kv_source: RemoteKVSource | None = None

    @classmethod
    def prefill_request(
        cls, reuse: NixlParams | None = None, source: RemoteKVSource | None = None
    ) -> KVTransferParams:
        """Params for a prefill leg: produce KV for a remote decode, optionally
        reading a previous turn from a decode node and/or a peer host tier."""
        if reuse is not None:
            nixl = reuse.model_copy(update={"do_remote_decode": True, "do_remote_prefill": False})
        else:
            nixl = NixlParams(do_remote_decode=True, do_remote_prefill=False)
        return cls(nixl=nixl, remote_kv_source=source)

    @classmethod
    def from_wire(cls, raw: Any) -> KVTransferParams | None:
        """Parse an engine's dict; None (not an exception) when absent or malformed."""
        if not isinstance(raw, dict):
            return None
        raw = dict(raw)
        source = raw.pop("remote_kv_source", None)
        version = raw.pop("kvtier_version", PARAMS_VERSION)
        try:
            return cls(
                kvtier_version=version,
                nixl=NixlParams.model_validate(raw) if raw else None,
                remote_kv_source=RemoteKVSource.model_validate(source) if source else None,
            )
        except ValidationError:
            return None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.nixl is not None:
            out.update(self.nixl.model_dump(exclude_none=True))
        if self.remote_kv_source is not None:
            out["remote_kv_source"] = self.remote_kv_source.model_dump(exclude_none=True)
        out["kvtier_version"] = self.kvtier_version
        return out
