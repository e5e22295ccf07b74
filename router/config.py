"""Router configuration: parsed once, at the boundary, into frozen models.

Sources: a YAML/JSON file (``kvtier router --config FILE``) or CLI flags
(``--prefill URL --decode URL --indexer URL --port N``). Everything downstream
takes a ``RouterConfig``; nothing reads raw dicts or flags again.

Renamed keys are accepted through ``_ALIASES`` (old name -> new name) so a
config written for an older kvtier keeps loading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.cost.config import resolve_config_path
from kvtier.cost.model import CostModel
from kvtier.ids import PodId, Role
from kvtier.reuse_gate import DEFAULT_MIN_CACHED_TOKEN_DELTA

_ALIASES = {
    "prefill_urls": "prefill",
    "decode_urls": "decode",
    "indexer_url": "indexer",
    "decoder_kv_blocks_ttl": "decode_kv_ttl_s",
}


class InstanceConfig(BaseModel):
    """One vLLM server the router can send legs to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: PodId
    url: str
    role: Role
    # A decode node's finished-request params feed (KVTierNixlConnector's ZMQ PUB,
    # tcp://HOST:PORT): lets a streamed decode leg keep its KV for the next turn.
    params_feed: str | None = None
    # A decode node's lease server (KVTierNixlConnector with decode_lease_s, tcp://HOST:PORT):
    # the router renews the turns it retains there and releases those it gives up
    # (router/retention.py). Without one the node keeps them for vLLM's TTL.
    lease: str | None = None

    @field_validator("params_feed", "lease")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith(("tcp://", "ipc://")) and len(v) > 6):
            raise ValueError(f"expected a ZMQ endpoint tcp://HOST:PORT, got {v!r}")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        p = urlparse(v)
        if p.scheme not in ("http", "https") or not p.netloc:
            raise ValueError(f"instance url must be http(s)://host:port, got {v!r}")
        return v.rstrip("/")


class Timeouts(BaseModel):
    """Per-leg limits. A leg that times out counts against its instance: after
    ``eject_after_failures`` in a row the instance is ejected, whatever its ``/health``
    says, and only a successful leg readmits it (see pool.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    connect_s: float = Field(default=2.0, gt=0)
    # Whole prefill leg (one forward pass over the prompt plus an optional D->P read): an
    # agent's long prompt (100k tokens) must fit, so this is generous.
    prefill_s: float = Field(default=60.0, gt=0)
    # Gap between two bytes from a decode leg (and the first byte): not the turn's length,
    # so a long agent turn that keeps streaming never times out.
    decode_idle_s: float = Field(default=120.0, gt=0)
    tokenize_s: float = Field(default=10.0, gt=0)
    indexer_s: float = Field(default=0.25, gt=0)
    health_s: float = Field(default=5.0, gt=0)
    # One conversation-store call (Redis): past it the turn is served without reuse.
    store_s: float = Field(default=0.5, gt=0)


class RouterConfig(BaseModel):
    """Everything the router needs; frozen after parsing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instances: tuple[InstanceConfig, ...]
    indexer: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Bearer tokens accepted from clients; empty = no auth. The token (hashed)
    # is the tenant: a conversation's KV is only reused for the same tenant.
    api_keys: tuple[str, ...] = ()
    # Engine block size (tokens). Trimming reused KV happens on block bounds.
    block_size: int = Field(32, ge=1)
    # The decode node's `decoder_kv_blocks_ttl`; entries expire this margin earlier
    # on the router's own clock (vLLM exports a perf_counter of another process).
    decode_kv_ttl_s: float = Field(480.0, gt=0)
    ttl_margin_s: float = Field(30.0, ge=0)
    store_max_entries: int = Field(100_000, ge=1)
    store_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    # How a streaming client in a conversation is served:
    # "stream": decode streams and is relayed event by event (engine transfer params
    #   stripped); the decode node's params for the next turn come from its params feed
    #   (InstanceConfig.params_feed, KVTierNixlConnector), or from the stream itself when
    #   an engine puts them there. A decode node without a feed is served as "buffered".
    # "buffered": decode runs non-streaming (vLLM returns kv_transfer_params only
    #   there) and the router re-emits SSE; the next turn can READ D's KV.
    # "passthrough": decode's SSE is relayed (transfer params stripped); no D params are
    #   captured, the next turn relies on the prefill's own cache / peers.
    stream_capture: Literal["stream", "buffered", "passthrough"] = "stream"
    # How long after a streamed decode leg ends the router waits for its params (the
    # client's final [DONE] is held that long at most); the turn succeeds without them.
    params_wait_s: float = Field(2.0, ge=0)
    # A request naming no conversation continues the one whose retained tokens its prompt
    # provably starts with (same tenant); every P/D turn is retained for that.
    implicit_sessions: bool = True
    # The one reuse gate (kvtier.reuse_gate.gains_enough, one default): a peer's host copy
    # is pulled only when it holds at least this many tokens more than the chosen prefill
    # already holds, on any tier; 0 means any gain (a pull of nothing never pays: the floor
    # is one token). The router gates here, on the indexer's best candidate for the prefill
    # it chose (indexer_client.Route.source_for); /v1/route returns candidates ungated by
    # this value. The same function runs in the indexer for /v1/source callers that name a
    # target (kvtier.indexer.select) and, defensively, in the engine's host tier before it
    # starts a pull (kvtier.tier.scheduler, HostTierConfig.min_cached_token_delta).
    min_cached_token_delta: int = Field(DEFAULT_MIN_CACHED_TOKEN_DELTA, ge=0)
    # Decode leases (instances with a ``lease`` endpoint): the lease each retained turn gets
    # (renewed every third of it while held; a dead router frees within one), and how long
    # to hold: "renew" while the store keeps the turn, "adaptive" per conversation and turn
    # from the cost model and the waits observed (kvtier.cost.hold; needs cost_model with a
    # dp_read link). ``host_copy``: a host tier keeps a copy of every turn (the adaptive
    # choice prices releasing against reading that copy, not a recompute).
    decode_lease_s: float = Field(30.0, gt=0)
    retention: Literal["renew", "adaptive"] = "renew"
    host_copy: bool = False
    # adaptive: holding a turn this long costs as much as recomputing it (the price of device
    # memory, kvtier.cost.retention); and the hold of a turn before any wait was observed
    # (None: while the store keeps it, as vLLM's TTL would).
    hold_horizon_s: float = Field(60.0, gt=0)
    hold_default_s: float | None = Field(None, ge=0)
    # A cost model (the JSON `kvtier calibrate --out` writes). With one, the router picks the
    # reuse path per turn by expected TTFT (kvtier.cost.decide, the decision the
    # CostAwareConnector and the simulator make) and hands the prefill only that path's
    # params; without one, it hands over every path it has and the engine's connector picks.
    cost_model: CostModel | None = None
    # Refit that cost model online from the prefill legs this router times (their tokens,
    # reuse path and seconds, queueing included; kvtier.cost.online): it starts as the
    # calibration and follows the load. ``cost_refit_window``: the last N legs it fits;
    # the first refit waits for ``cost_refit_min_samples``.
    cost_refit: bool = False
    cost_refit_window: int = Field(256, ge=3)
    cost_refit_min_samples: int = Field(16, ge=3)
    # Learn each reuse path's real cost from the prefill legs this router times
    # (kvtier.cost.estimator: per path and log-spaced context bucket, the median of the last
    # ``cost_learn_ring`` legs, blended with the cost model by sample count) and pick the
    # path per turn by that estimate. ``explore_share``: at most this share of turns takes a
    # path whose estimate is young or stale (never one known to be worse by
    # ``explore_margin``, relative). Needs cost_model.
    cost_learn: bool = False
    cost_learn_ring: int = Field(32, ge=1, le=1024)
    explore_share: float = Field(0.05, ge=0.0, le=1.0)
    explore_margin: float = Field(0.25, ge=0.0)
    # adaptive retention: price device memory by each decode node's pressure, scraped from its
    # /metrics in the health loop (router/pressure.py; kvtier.cost.hold.pressure_factor:
    # horizon × (1 - u) / max(u, 0.01) / (1 + requests_waiting / hold_waiting_ref), clipped to
    # [0.02, 100], u = kv_cache_usage: the configured price at half full, less when emptier).
    hold_pressure: bool = False
    hold_waiting_ref: float = Field(4.0, gt=0)
    # Indexer pod namespace: model name the indexer knows; None = request's model.
    indexer_model: str | None = None
    health_interval_s: float = Field(2.0, gt=0)
    eject_after_failures: int = Field(3, ge=1)
    max_retries: int = Field(2, ge=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    timeouts: Timeouts = Timeouts()
    log_json: bool = True
    # The per-request ``served`` log line (INFO); off, or the logger above INFO, it costs
    # nothing.
    log_requests: bool = True
    # Conversation store: "memory" (this process) or "redis://HOST:PORT/DB" (shared by
    # routers and workers; entries keep their TTL in Redis, a take is atomic).
    store: str = "memory"
    store_namespace: str = Field("kvtier:router", min_length=1, max_length=128)
    # Processes serving the port (`kvtier router --workers N`); N > 1 needs a shared store.
    workers: int = Field(1, ge=1, le=256)
    # Sent to engines as `Authorization: Bearer ...` (vLLM --api-key); clients' tokens
    # never are.
    engine_api_key: str | None = None
    # How long an idle client connection is kept open, seconds. An agent sends its next turn
    # after a tool's wait on the connection it kept; a server that closes first races that
    # send and the client sees "server disconnected" (uvicorn's default of 5 s did, in a
    # live A/B). Longer than clients' own idle expiry (httpx 5 s, aiohttp 15 s), so the
    # client is the one that closes.
    client_keepalive_s: int = Field(75, ge=1)
    # Upstream connections per engine instance (bounded pool, kept alive).
    pool_max_connections: int = Field(256, ge=1)
    # How long an idle upstream connection is reused, seconds. Below the engines' own
    # keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) so the router stops using a
    # connection before the engine closes it: a request written on one the engine has just
    # closed fails (it is then sent again once, upstream.py).
    pool_keepalive_s: float = Field(4.0, gt=0)
    # An event loop that stands still this long, seconds, is logged with the line blocking it
    # and counted (kvtier_router_event_loop_stall_seconds); 0 turns the watchdog off.
    loop_stall_warn_s: float = Field(1.0, ge=0)
    # The HTTP client of the engine legs: "auto" is router/h1.py's where httptools is
    # installed, else aiohttp, else httpx.
    upstream_client: Literal["auto", "aiohttp", "httpx"] = "auto"
    # An instance ejected for failed legs is offered one probe leg this often; the first
    # successful leg readmits it (its /health answering does not).
    readmit_probe_s: float = Field(5.0, gt=0)

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if v == "memory":
            return v
        p = urlparse(v)
        if p.scheme not in ("redis", "rediss", "unix") or not (p.netloc or p.path):
            raise ValueError(f"store must be 'memory' or redis://HOST:PORT/DB, got {v!r}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _aliases_and_shorthand(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {(_ALIASES.get(k, k)): v for k, v in data.items()}
        if isinstance(data.get("cost_model"), (str, Path)):
            f = resolve_config_path(data["cost_model"])
            try:
                data["cost_model"] = json.loads(f.read_text())
            except OSError as e:
                raise ValueError(f"cost_model: cannot read {f}: {e.strerror}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"cost_model: {f} is not JSON ({e})") from None
        insts = list(data.pop("instances", []) or [])
        for role in ("prefill", "decode"):
            for i, item in enumerate(data.pop(role, []) or []):
                if isinstance(item, str):
                    insts.append({"name": f"{role}-{i}", "role": role,
                                  **parse_instance(item)})
                else:
                    insts.append({"role": role, **item})
        data["instances"] = insts
        return data

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        names = [i.name for i in self.instances]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be unique: {names}")
        if not self.decode_instances:
            raise ValueError("at least one decode (or both) instance is required")
        if self.ttl_margin_s >= self.decode_kv_ttl_s:
            raise ValueError("ttl_margin_s must be below decode_kv_ttl_s")
        if self.retention == "adaptive" and (self.cost_model is None
                                             or "dp_read" not in self.cost_model.reads):
            raise ValueError("retention: adaptive needs a cost_model with a dp_read link "
                             "(kvtier calibrate --out FILE)")
        if self.cost_refit and self.cost_model is None:
            raise ValueError("cost_refit needs a cost_model to start from "
                             "(kvtier calibrate --out FILE)")
        if self.cost_learn and self.cost_model is None:
            raise ValueError("cost_learn needs a cost_model as its prior "
                             "(kvtier calibrate --out FILE)")
        if self.cost_refit_min_samples > self.cost_refit_window:
            raise ValueError(f"cost_refit_min_samples ({self.cost_refit_min_samples}) cannot "
                             f"exceed cost_refit_window ({self.cost_refit_window})")
        if self.workers > 1 and self.store == "memory":
            raise ValueError(
                f"workers={self.workers} with the memory store: each worker would keep its own "
                "conversations and a turn landing on another worker would lose its reuse; "
                "use a shared store (store: redis://HOST:PORT/DB) or workers: 1")
        return self

    def capability_warnings(self) -> dict[PodId, list[str]]:
        """Per decode instance, what the config asks of it that it cannot give: a streamed
        capture without a params feed (the turn is served buffered: one chunk at the end),
        leases asked for (``decode_lease_s`` given) without a lease endpoint (vLLM's TTL
        holds the blocks; closing a conversation frees nothing)."""
        out: dict[PodId, list[str]] = {}
        asked_leases = "decode_lease_s" in self.model_fields_set
        for inst in self.decode_instances:
            why: list[str] = []
            if self.stream_capture == "stream" and inst.params_feed is None:
                why.append("no params feed: a streamed turn in a conversation is served "
                           "buffered (one chunk at the end) to keep its KV for the next turn")
            if asked_leases and inst.lease is None:
                why.append("no lease endpoint: decode_lease_s has no effect there and its "
                           "retained blocks stay until vLLM's decoder_kv_blocks_ttl")
            if why:
                out[inst.name] = why
        return out

    @property
    def prefill_instances(self) -> tuple[InstanceConfig, ...]:
        return tuple(i for i in self.instances if i.role in (Role.PREFILL, Role.BOTH))

    @property
    def decode_instances(self) -> tuple[InstanceConfig, ...]:
        return tuple(i for i in self.instances if i.role in (Role.DECODE, Role.BOTH))

    @property
    def entry_ttl_s(self) -> float:
        return self.decode_kv_ttl_s - self.ttl_margin_s


_INSTANCE_KEYS = {"feed": "params_feed", "params_feed": "params_feed", "lease": "lease",
                  "name": "name"}


def parse_instance(spec: str) -> dict[str, str]:
    """``URL[,feed=tcp://HOST:PORT][,lease=tcp://HOST:PORT][,name=NAME]`` (the CLI's
    ``--decode``/``--prefill`` form) -> an instance's fields."""
    url, *opts = (part.strip() for part in spec.split(","))
    out = {"url": url}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in _INSTANCE_KEYS or not value:
            raise ValueError(f"instance {spec!r}: expected URL[,feed=tcp://HOST:PORT]"
                             f"[,lease=tcp://HOST:PORT][,name=NAME], got {opt!r}")
        out[_INSTANCE_KEYS[key]] = value
    return out


def load_config(path: str | Path, **overrides: Any) -> RouterConfig:
    """Parse a YAML or JSON file (overrides win), validated once."""
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        raw = json.loads(text)
    else:
        import yaml

        raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        # ValueError, not TypeError: the CLI reports ValueErrors as a bad configuration.
        raise ValueError(f"{path}: top level must be a mapping")  # noqa: TRY004
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return RouterConfig.model_validate(raw)
