"""Stacks that are already running: ``kvtier ab --stack STRATEGY=ROUTER_URL``.

A running stack is reached through its router only. What the live runner measures on it
(`kvtier.ab.live.runner.run_on_stack`) is found from the router (`discover`):

- the router's ``GET /healthz``: every instance's name, role and URL (each engine's vLLM
  ``/metrics`` is at that URL), each decode node's ``decode_capabilities`` (params feed; lease
  state and, where the router names it, ``lease_endpoint``: the node's own retention metrics
  are on the lease port + 1) and the indexer the router asks, if any;
- ``GET /v1/models``: the served model name and its ``max_model_len``;
- each engine's ``vllm:cache_config_info``: block size, KV blocks, prefix caching.

Or given (``--engine-metrics STRATEGY=[ROLE=]URL,...``, `parse_engine_metrics`): the stack's
metrics pages exactly, nothing discovered; each page is read for what it exports (vLLM's
``vllm:``, the decode nodes' ``kvtier_decode_``, the host tiers' ``kvtier_tier_``).

What the runner does to a local stack that a running one may refuse degrades to a note in
the report (`stacks_markdown`), never a crash: the engines' prefix caches are reset before
every run only where vLLM serves ``/reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``), and a
running stack is never restarted between repeats. The strategy name labels the stack; what
``/healthz`` and the engines' pages can show is checked against the strategy (`verify`),
the rest is not verified and the report says so.

Each turn is a streamed completion through the router (`stream_turn`): the router's legs are
not visible from outside, so TTFT is the first streamed token at the client.

Threading model: plain functions on the caller's thread; `RunningStack` is immutable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtier.ab.live.probes import BLOCK_SECONDS, RETAINED, Endpoint
from kvtier.ab.live.scrape import metric, page
from kvtier.ab.strategies import GPU_STRATEGY_NAMES, STRATEGY_NAMES, StrategySpec
from kvtier.ids import ReusePath
from kvtier.wire.reuse_headers import ReuseReport, parse_reuse_headers

HOST_BYTES = "kvtier_tier_bytes_held"
ROLES = ("prefill", "decode", "both")

# What a run on a running stack measures differently from a local one (the rest of
# kvtier.ab.live.runner.MEASUREMENT holds as written there).
MEASUREMENT = {
    "ttft_s": "running stacks: client send -> first streamed token from the router (the "
              "router's legs are not visible from outside; a decode node without a params "
              "feed is served buffered, so its TTFT is the whole answer's latency)",
    "reused_tokens": "running stacks: the router's x-kvtier-reuse header (what it planned; "
                     "the prefill's own count is not visible from outside)",
    "device_blocks_retained": "running stacks: the decode nodes' kvtier_decode_blocks_retained "
                              "where their lease metrics are readable, else their KV blocks in "
                              "use (vllm:kv_cache_usage_perc x num_gpu_blocks: an upper bound, "
                              "running requests included)",
    "host_bytes_held": "running stacks: the host tiers' kvtier_tier_bytes_held (pages given "
                       "with --engine-metrics), else the stack's indexer (GET /v1/pods: "
                       "stored - removed blocks x block bytes, every stream it follows)",
    "refusal / hold_s": "running stacks: not recorded (the router's log is its own)",
}


class StackError(ValueError):
    """A ``--stack`` or ``--engine-metrics`` value that does not parse, or a router that
    cannot be used."""


@dataclass(frozen=True)
class MetricsPage:
    """One ``--engine-metrics`` URL, with the role given for it (None: found from the page
    or the router)."""

    url: str
    role: str | None = None


def parse_stacks(values: Sequence[str]) -> dict[str, str]:
    """``STRATEGY=ROUTER_URL`` values as {strategy: URL}, in the order given."""
    out: dict[str, str] = {}
    for v in values:
        name, eq, url = v.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not eq or not name or not url:
            raise StackError(f"--stack {v!r}: expected STRATEGY=ROUTER_URL")
        if name not in STRATEGY_NAMES + GPU_STRATEGY_NAMES:
            raise StackError(f"--stack {v!r}: {name!r} is not a strategy "
                             f"({', '.join(STRATEGY_NAMES + GPU_STRATEGY_NAMES)})")
        if name in out:
            raise StackError(f"--stack {v!r}: {name} is given twice")
        out[name] = _http_url(url, f"--stack {v!r}")
    return out


def parse_engine_metrics(values: Sequence[str], stacks: Sequence[str]
                         ) -> dict[str, list[MetricsPage]]:
    """``STRATEGY=[ROLE=]URL,...`` values as {strategy: pages}; ROLE is prefill, decode or
    both (vLLM's pages only; the router's roles are used where the URL is an instance's)."""
    out: dict[str, list[MetricsPage]] = {}
    for v in values:
        name, eq, rest = v.partition("=")
        name = name.strip()
        if not eq or not rest.strip():
            raise StackError(f"--engine-metrics {v!r}: expected STRATEGY=[ROLE=]URL,...")
        if name not in stacks:
            raise StackError(f"--engine-metrics {v!r}: no --stack {name}=...")
        for item in rest.split(","):
            role, eq, url = item.strip().partition("=")
            if not eq:
                role, url = "", role
            if role and role not in ROLES:
                raise StackError(f"--engine-metrics {v!r}: role {role!r} is not one of "
                                 f"{', '.join(ROLES)}")
            url = url.strip().removesuffix("/metrics").rstrip("/")
            page_ = MetricsPage(_http_url(url, f"--engine-metrics {v!r}"), role or None)
            out.setdefault(name, []).append(page_)
    return out


def _http_url(url: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StackError(f"{what}: {url!r} is not an http(s) URL")
    return url


@dataclass(frozen=True)
class RunningStack:
    """A running stack as its router shows it, and where its numbers are read."""

    strategy: str
    url: str                                 # the router
    model_name: str                          # what its engines serve (/v1/models)
    max_model_len: int | None
    instances: tuple[Endpoint, ...]          # the router's instances (name, role, URL)
    engines: tuple[Endpoint, ...]            # readable vLLM /metrics pages
    decode_metrics: tuple[str, ...]          # decode nodes' own retention metrics
    host_metrics: tuple[str, ...]            # host tiers' metrics pages
    indexer: str | None                      # the indexer the router asks
    source: str                              # where the metrics pages came from
    block_size: int | None = None            # the engines' (None: unknown or not one size)
    prefix_caching: dict[str, bool] = field(default_factory=dict)  # engine -> on
    capabilities: dict[str, Any] = field(default_factory=dict)     # /healthz, per decode
    notes: tuple[str, ...] = ()

    def count(self, role: str) -> int:
        return sum(1 for i in self.instances if i.role in (role, "both"))

    @property
    def topology(self) -> str:
        return f"{self.count('prefill')}P{self.count('decode')}D"

    def describe(self) -> dict[str, Any]:
        """What the report keeps of the stack (``meta["stacks"][strategy]``)."""
        return {"router": self.url, "model": self.model_name, "topology": self.topology,
                "instances": [{"name": i.name, "role": i.role, "url": i.url}
                              for i in self.instances],
                "metrics_source": self.source,
                "engine_metrics": [e.url for e in self.engines],
                "decode_metrics": list(self.decode_metrics),
                "host_metrics": list(self.host_metrics), "indexer": self.indexer,
                "block_size": self.block_size, "decode_capabilities": self.capabilities,
                "notes": list(self.notes)}


def discover(http: httpx.Client, strategy: str, url: str,
             given: Sequence[MetricsPage] = (), model_name: str = "") -> RunningStack:
    """The stack behind the router at ``url`` (see the module docstring); ``given``: its
    metrics pages (nothing else is discovered then); ``model_name``: used when the router
    does not list one. Raises `StackError` when the router cannot be used."""
    try:
        r = http.get(f"{url}/healthz", timeout=10)
        doc = r.json()
    except (httpx.HTTPError, ValueError) as e:
        raise StackError(f"--stack {strategy}={url}: no kvtier router answers /healthz "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("instances"), dict):
        raise StackError(f"--stack {strategy}={url}: /healthz does not list instances "
                         f"(not a kvtier router?)")
    if r.status_code != 200:
        raise StackError(f"--stack {strategy}={url}: the router cannot serve "
                         f"(/healthz {r.status_code}, down: {doc.get('down')})")
    instances = tuple(Endpoint(str(n), str(i.get("role")), str(i.get("url")).rstrip("/"))
                      for n, i in doc["instances"].items())
    caps = doc.get("decode_capabilities") or {}
    idx = (doc.get("dependencies") or {}).get("indexer")
    indexer = str(idx["url"]).rstrip("/") if isinstance(idx, dict) and idx.get("url") else None
    notes: list[str] = []
    unhealthy = [n for n, i in doc["instances"].items() if not i.get("healthy", True)]
    if unhealthy:
        notes.append(f"instances not admitted by the router at discovery: {unhealthy}")
    served, max_len = _served_model(http, url)
    engines: list[Endpoint] = []
    decode: list[str] = []
    host: list[str] = []
    texts: dict[str, str] = {}
    if given:
        source = "given (--engine-metrics)"
        by_base = {_base(i.url): i for i in instances}
        for g in given:
            text = page(http, g.url)
            if text is None:
                notes.append(f"metrics page {g.url} not readable: left out")
                continue
            known = False
            if "vllm:" in text:
                inst = by_base.get(_base(g.url))
                engines.append(Endpoint(inst.name if inst else _base(g.url),
                                        g.role or (inst.role if inst else "both"), g.url))
                texts[engines[-1].name] = text
                known = True
            if RETAINED in text or BLOCK_SECONDS in text:
                decode.append(g.url)
                known = True
            if HOST_BYTES in text:
                host.append(g.url)
                known = True
            if not known:
                notes.append(f"metrics page {g.url}: no vllm:, kvtier_decode_ or kvtier_tier_ "
                             f"metrics: left out")
    else:
        source = "discovered from the router's /healthz"
        for i in instances:
            text = page(http, i.url)
            if text is None or "vllm:" not in text:
                notes.append(f"{i.name}: vLLM metrics at {i.url}/metrics not readable from "
                             f"here (its queue, ITL and KV use are not measured; give its page "
                             f"with --engine-metrics)")
                continue
            engines.append(i)
            texts[i.name] = text
        for name, cap in caps.items():
            lease = cap.get("lease_endpoint") if isinstance(cap, dict) else None
            murl = lease_metrics_url(lease) if isinstance(lease, str) else None
            if murl is None:
                continue
            if page(http, murl) is None:
                notes.append(f"{name}: lease metrics at {murl}/metrics not readable from here")
            else:
                decode.append(murl)
    info = {n: _cache_info(t) for n, t in texts.items()}
    sizes = {int(i["block_size"]) for i in info.values() if i.get("block_size", "").isdigit()}
    return RunningStack(
        strategy=strategy, url=url, model_name=served or model_name, max_model_len=max_len,
        instances=instances, engines=tuple(engines), decode_metrics=tuple(decode),
        host_metrics=tuple(host), indexer=indexer, source=source,
        block_size=sizes.pop() if len(sizes) == 1 else None,
        prefix_caching={n: i["enable_prefix_caching"] == "True" for n, i in info.items()
                        if "enable_prefix_caching" in i},
        capabilities=caps if isinstance(caps, dict) else {}, notes=tuple(notes))


def lease_metrics_url(lease_endpoint: str) -> str | None:
    """A decode node's retention metrics (``http://HOST:PORT+1``) from its lease endpoint
    (``tcp://HOST:PORT``), or None when that is not a TCP endpoint."""
    parts = urlsplit(lease_endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        return None
    host = "127.0.0.1" if parts.hostname in ("*", "0.0.0.0") else parts.hostname  # noqa: S104
    return f"http://{host}:{parts.port + 1}"


def _base(url: str) -> str:
    p = urlsplit(url)
    return f"{p.hostname}:{p.port or (443 if p.scheme == 'https' else 80)}"


def _served_model(http: httpx.Client, url: str) -> tuple[str, int | None]:
    """(the first model the router lists, its max_model_len), or ("", None)."""
    try:
        data = http.get(f"{url}/v1/models", timeout=10).json().get("data") or []
        first = data[0]
        n = first.get("max_model_len")
        return str(first["id"]), int(n) if isinstance(n, int) and n > 0 else None
    except (httpx.HTTPError, ValueError, AttributeError, IndexError, KeyError, TypeError):
        return "", None


def _cache_info(text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` on an engine's page ({} when absent)."""
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "vllm:cache_config_info":
                    return dict(s.labels)
    except ValueError:
        pass
    return {}


def verify(spec: StrategySpec, stack: RunningStack) -> dict[str, list[str]]:
    """What the router and the engines show, checked against ``spec``: ``{"matches": [...],
    "differs": [...], "not_verified": [...]}``."""
    out: dict[str, list[str]] = {"matches": [], "differs": [], "not_verified": []}

    def check(what: str, want: bool, have: bool | None) -> None:
        if have is None:
            out["not_verified"].append(what)
        else:
            out["matches" if want == have else "differs"].append(
                f"{what}: stack {'yes' if have else 'no'}, {spec.name} {'yes' if want else 'no'}")

    leases = [c.get("lease", "none") for c in stack.capabilities.values() if isinstance(c, dict)]
    check("decode leases", spec.leases, any(s != "none" for s in leases) if leases else None)
    check("indexer", spec.use_indexer, stack.indexer is not None)
    prefill = [e.name for e in stack.instances if e.role in ("prefill", "both")]
    seen = [stack.prefix_caching[n] for n in prefill if n in stack.prefix_caching]
    check("prefill prefix caching", spec.prefix_caching,
          all(seen) if seen and len(set(seen)) == 1 else None)
    out["not_verified"] += ["device retention and its TTL", "host tier", "peer fetch",
                            "kv_recompute_threshold / min_cached_token_delta"]
    return out


def reset_prefix_caches(http: httpx.Client, stack: RunningStack, wait_s: float = 10.0
                        ) -> list[str]:
    """Reset every engine's prefix cache (and its connector's, ``reset_external``) before a
    run; what could not be reset, one note per engine ([] when all were)."""
    notes = []
    for e in stack.instances:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                r = http.post(f"{e.url}/reset_prefix_cache", params={"reset_external": "true"},
                              timeout=10)
            except httpx.HTTPError as ex:
                notes.append(f"{e.name}: prefix cache not reset ({type(ex).__name__})")
                break
            if r.status_code == 404:
                notes.append(f"{e.name}: prefix cache not reset (/reset_prefix_cache answered "
                             f"404: vLLM serves it only with VLLM_SERVER_DEV_MODE=1)")
                break
            if r.status_code != 200:
                notes.append(f"{e.name}: prefix cache not reset (HTTP {r.status_code})")
                break
            try:
                ok = bool(r.json().get("success", True))
            except (ValueError, AttributeError):
                ok = True
            if ok:
                break
            if time.monotonic() >= deadline:
                notes.append(f"{e.name}: prefix cache not reset (vLLM refused for {wait_s:g} s: "
                             f"blocks still held)")
                break
            time.sleep(0.5)
    return notes


def host_bytes(http: httpx.Client, stack: RunningStack, block_bytes: int) -> int:
    """Host-tier bytes held now: the tiers' own gauges, else the indexer's block counts."""
    if stack.host_metrics:
        return tier_bytes(http, stack.host_metrics)
    if stack.indexer is None:
        return 0
    try:
        pods = http.get(f"{stack.indexer}/v1/pods", timeout=5).json().get("pods") or {}
        return sum(max(0, int(p.get("blocks_stored", 0)) - int(p.get("blocks_removed", 0)))
                   for p in pods.values()) * block_bytes
    except (httpx.HTTPError, ValueError, AttributeError, TypeError):
        return 0


def tier_bytes(http: httpx.Client, pages: Sequence[str]) -> int:
    """Bytes the host tiers whose metrics ``pages`` are hold now (``kvtier_tier_bytes_held``);
    a page that does not answer or parse counts 0."""
    total = 0.0
    for u in pages:
        text = page(http, u)
        if text is not None:
            try:
                total += metric(text, HOST_BYTES)
            except ValueError:
                continue
    return int(total)


class StreamError(RuntimeError):
    """The router's stream carried an error event or ended early."""


def stream_turn(c: httpx.Client, model: str, cid: str, rid: str, prompt: list[int],
                max_tokens: int, *, direct: bool = False,
                ) -> tuple[list[int], ReuseReport, float | None]:
    """One turn through a running router, streamed: (generated ids, the router's reuse
    decision, ``perf_counter`` at the first token or None). ``ignore_eos`` makes the turn
    generate exactly ``max_tokens``. ``direct``: ``c`` talks to one engine, not a router (one
    engine per strategy): no conversation id is sent, and the reuse is the engine's own count
    of prompt tokens it did not compute (the stream's usage, ``prompt_tokens_details.
    cached_tokens``; vLLM's ``--enable-prompt-tokens-details``), as a ``local`` read."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "temperature": 0,
                            "max_tokens": max_tokens, "ignore_eos": True,
                            "return_token_ids": True, "stream": True}
    if direct:
        body["stream_options"] = {"include_usage": True}
    else:
        body["conversation_id"] = cid
    ids: list[int] = []
    first: float | None = None
    cached: int | None = None
    done = False
    with c.stream("POST", "/v1/completions", json=body, headers={"x-request-id": rid}) as r:
        if r.status_code != 200:
            r.read()
            r.raise_for_status()
        reuse = ReuseReport() if direct else parse_reuse_headers(r.headers)
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if isinstance(ev, dict) and "error" in ev:
                raise StreamError(f"error event: {str(ev['error'])[:200]}")
            for ch in (ev.get("choices") or []) if isinstance(ev, dict) else []:
                got = ch.get("token_ids") if isinstance(ch, dict) else None
                if isinstance(got, list) and got:
                    first = time.perf_counter() if first is None else first
                    ids += got
            if direct and isinstance(ev, dict) and isinstance(ev.get("usage"), dict):
                cached = _cached_tokens(ev["usage"])
    if not done:
        raise StreamError("the stream ended without [DONE]")
    if not ids:
        # the router's answer is malformed: a bad value, not a caller passing a wrong type
        raise ValueError("router stream has no token_ids")  # noqa: TRY004
    if direct:
        n = cached or 0
        reuse = ReuseReport(ReusePath.LOCAL if n > 0 else ReusePath.NONE, n)
    return ids, reuse, first


def _cached_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens an engine did not compute, from an OpenAI ``usage`` object (0: it does not
    say, e.g. without ``--enable-prompt-tokens-details``)."""
    details = usage.get("prompt_tokens_details")
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and n > 0 else 0


def stacks_markdown(meta: dict[str, Any]) -> list[str]:
    """The report's section on running stacks (``meta["stacks"]``), [] for a local run."""
    stacks = meta.get("stacks")
    if not stacks:
        return []
    lines = ["## Running stacks", "",
             "Each strategy below is a stack that was already running, reached through its "
             "router (`kvtier ab --stack`); the strategy name labels it. Its configuration was "
             "not set by this run: what the router's `/healthz` and the engines' metrics show "
             "is checked against the strategy, the rest is not verified. The stacks were not "
             "restarted between repeats; TTLs are as deployed (the time scale applies to the "
             "trace's waits only).", ""]
    for name, s in stacks.items():
        lines.append(f"### `{name}`: router {s.get('router')}, {s.get('topology')}, "
                     f"model {s.get('model')}")
        lines.append("")
        lines.append(f"- Metrics pages ({s.get('metrics_source')}): engines "
                     f"{_list(s.get('engine_metrics'))}; decode retention "
                     f"{_list(s.get('decode_metrics'))}; host tiers "
                     f"{_list(s.get('host_metrics'))}; indexer {s.get('indexer') or 'none'}")
        v = s.get("verified") or {}
        if v.get("matches"):
            lines.append(f"- Matches {name}: " + "; ".join(v["matches"]))
        if v.get("differs"):
            lines.append(f"- **Differs from {name}**: " + "; ".join(v["differs"]))
        if v.get("not_verified"):
            lines.append("- Not verified: " + ", ".join(v["not_verified"]))
        feedless = [n for n, c in (s.get("decode_capabilities") or {}).items()
                    if isinstance(c, dict) and not c.get("params_feed")]
        if feedless:
            lines.append(f"- Decode nodes without a params feed (streamed answers buffered: "
                         f"TTFT = the whole answer): {', '.join(feedless)}")
        lines += [f"- {n}" for n in [*s.get("notes", []), *s.get("run_notes", [])]]
        lines.append("")
    return lines


def _list(xs: Any) -> str:
    return ", ".join(xs) if xs else "none"
