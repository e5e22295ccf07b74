"""``kvtier router``: run the KV-aware P/D router.

    kvtier router --config FILE
    kvtier router [--stack-state FILE]       # the instances of `kvtier stack up`
    kvtier router --prefill URL [--prefill URL ...] --decode URL[,feed=..,lease=..] [...] \\
                  [--indexer URL] [--host 127.0.0.1] [--port 8000] [--api-key KEY ...] \\
                  [--store memory|redis://HOST:PORT/DB] [--workers N]

Flags are turned into a ``RouterConfig`` once; flags given next to ``--config``
override the file's values.

``--workers N`` (N > 1) serves the port from N processes (uvicorn's supervisor binds it once
and each worker accepts on it); each worker builds its app from the validated config
(``worker_app``), and the conversation store is their shared state, so N > 1 needs
``--store redis://...`` (refused with the memory store: a turn landing on another worker
would silently lose its reuse).

Threading model: the CLI runs in the main thread; each process serves one event loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the router's modules load only when `kvtier router` runs
    from fastapi import FastAPI

    from kvtier.router.config import RouterConfig

_CONFIG_ENV = "KVTIER_ROUTER_CONFIG_JSON"  # the config handed to --workers processes
DEFAULT_STACK_STATE = ".kvtier/stack.json"  # where `kvtier stack up` writes its state

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with any ``extra=`` fields (request ids...)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname,
               "logger": record.name, "msg": record.getMessage()}
        for k, v in vars(record).items():
            if k not in _RESERVED and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def register(subparsers: argparse._SubParsersAction) -> None:
    ap = subparsers.add_parser("router", help="run the KV-aware P/D router (OpenAI-compatible)")
    ap.add_argument("--config", help="YAML or JSON RouterConfig file")
    ap.add_argument("--prefill", action="append", default=None, metavar="URL",
                    help="a prefill instance (repeatable)")
    ap.add_argument("--decode", action="append", default=None,
                    metavar="URL[,feed=tcp://H:P][,lease=tcp://H:P]",
                    help="a decode instance (repeatable), with its params feed and lease "
                         "server when not in the stack state")
    ap.add_argument("--stack-state", default=None, metavar="FILE",
                    help="a `kvtier stack up` state file: its instances (with each decode "
                         "node's feed and lease), or, with --prefill/--decode, the feed and "
                         f"lease of the URLs it knows (default {DEFAULT_STACK_STATE} when it "
                         "exists and no --config is given)")
    ap.add_argument("--indexer", default=None, metavar="URL")
    ap.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=None, help="port (default 8000)")
    ap.add_argument("--api-key", action="append", default=None, dest="api_keys",
                    help="accepted bearer token (repeatable); none = no auth")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--decode-kv-ttl", type=float, default=None, dest="decode_kv_ttl_s",
                    help="the decode nodes' decoder_kv_blocks_ttl in seconds")
    ap.add_argument("--stream-capture", choices=["stream", "buffered", "passthrough"], default=None)
    ap.add_argument("--cost-model", default=None, dest="cost_model", metavar="FILE",
                    help="cost model JSON (kvtier calibrate --out): pick the reuse path per "
                         "turn by expected TTFT and hand the prefill only that path's params")
    ap.add_argument("--cost-refit", action="store_true", default=None, dest="cost_refit",
                    help="refit the cost model online from the prefill legs the router times "
                         "(needs --cost-model)")
    ap.add_argument("--store", default=None, metavar="memory|redis://HOST:PORT/DB",
                    help="conversation store (default memory; redis is shared by routers "
                         "and workers)")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes serving the port (default 1; >1 needs --store redis://)")
    ap.add_argument("--engine-api-key", default=None, dest="engine_api_key",
                    help="bearer token sent to engines (their --api-key)")
    ap.add_argument("--prefill-timeout", type=float, default=None, metavar="S",
                    help="whole prefill leg, seconds (default 60)")
    ap.add_argument("--decode-idle-timeout", type=float, default=None, metavar="S",
                    help="longest gap between two bytes of a decode leg, seconds (default 120)")
    ap.add_argument("--decode-lease-s", type=float, default=None, dest="decode_lease_s",
                    metavar="S", help="lease of each retained turn on decode nodes that have "
                    "a lease endpoint (config: instances[].lease), renewed while held "
                    "(default 30)")
    ap.add_argument("--retention", choices=["renew", "adaptive"], default=None,
                    help="hold retained turns while the store keeps them (renew, default) or "
                         "per conversation from the cost model and observed waits (adaptive; "
                         "needs --cost-model)")
    ap.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    from kvtier.router.config import RouterConfig, load_config

    overrides = {k: getattr(args, k, None) for k in (
        "prefill", "decode", "indexer", "host", "port", "api_keys", "block_size",
        "decode_kv_ttl_s", "stream_capture", "cost_model", "cost_refit", "store", "workers",
        "engine_api_key", "decode_lease_s", "retention")}
    timeouts = {k: v for k, v in (("prefill_s", getattr(args, "prefill_timeout", None)),
                                  ("decode_idle_s", getattr(args, "decode_idle_timeout", None)))
                if v is not None}
    if args.config:
        cfg = load_config(args.config, **overrides)
        if timeouts:
            merged = {**cfg.timeouts.model_dump(), **timeouts}
            cfg = RouterConfig.model_validate({**cfg.model_dump(), "timeouts": merged})
        return cfg
    raw = {k: v for k, v in overrides.items() if v is not None}
    state = _stack_state(getattr(args, "stack_state", None))
    if state is not None:
        raw.update(with_stack_state(raw.pop("prefill", None), raw.pop("decode", None), state))
    if timeouts:
        raw["timeouts"] = timeouts
    return RouterConfig.model_validate(raw)


def _stack_state(path: str | None) -> list[dict[str, Any]] | None:
    """The router instances of a ``kvtier stack up`` state file; None when there is none to
    read (no ``--stack-state`` and no default file)."""
    if path is None:
        if not os.path.exists(DEFAULT_STACK_STATE):
            return None
        path = DEFAULT_STACK_STATE
    try:
        state = json.loads(Path(path).read_text())
        insts = state["router"]["instances"]
    except OSError as e:
        raise ValueError(f"--stack-state {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--stack-state {path}: not a `kvtier stack up` state file "
                         "(no router.instances)") from None
    if not isinstance(insts, list):
        raise ValueError(f"--stack-state {path}: router.instances is not a list")
    return insts


def with_stack_state(prefill: list[str] | None, decode: list[str] | None,
                     state: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``instances`` (or ``prefill``/``decode``) of a config from the flags and a stack's
    state: no flags, the stack's instances; flags, those instances, each decode node given
    the feed and lease the state knows for its URL (what the flag says wins)."""
    from kvtier.router.config import parse_instance

    if not prefill and not decode:
        return {"instances": state}
    known = {str(i.get("url", "")).rstrip("/"): i for i in state}
    out: dict[str, Any] = {"prefill": prefill or []}
    decodes: list[dict[str, Any]] = []
    for n, spec in enumerate(decode or []):
        given = parse_instance(spec)
        inst: dict[str, Any] = {"name": f"decode-{n}"}
        found = known.get(given["url"].rstrip("/"), {})
        inst.update({k: found[k] for k in ("params_feed", "lease") if found.get(k)})
        inst.update(given)
        decodes.append(inst)
    out["decode"] = decodes
    return out


def _setup_logging(cfg: RouterConfig) -> None:
    if cfg.log_json:
        h = logging.StreamHandler()
        h.setFormatter(JsonFormatter())
        root = logging.getLogger()
        root.handlers[:] = [h]
        if root.level == logging.NOTSET or root.level > logging.INFO:
            root.setLevel(logging.INFO)
    # httpx logs every upstream request at INFO: one line per leg is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _freeze() -> None:
    """A router process's imports and app live as long as it does: keep them out of the
    cyclic collector's generations so its pauses (a request's p99) stay short."""
    import gc

    gc.collect()
    gc.freeze()


def worker_app() -> FastAPI:
    """The app of one ``--workers`` process (a uvicorn factory): the parent's validated
    config, from the environment."""
    from kvtier.router.app import create_app
    from kvtier.router.config import RouterConfig

    cfg = RouterConfig.model_validate_json(os.environ[_CONFIG_ENV])
    _setup_logging(cfg)
    app = create_app(cfg)
    _freeze()
    return app


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from kvtier.router.app import create_app

    try:
        cfg = config_from_args(args)
    except (ValidationError, ValueError, OSError) as e:
        print(f"kvtier router: bad configuration: {e}", file=sys.stderr)
        return 2
    _setup_logging(cfg)
    if cfg.workers > 1:
        os.environ[_CONFIG_ENV] = cfg.model_dump_json()
        uvicorn.run("kvtier.router.cli:worker_app", factory=True, workers=cfg.workers,
                    host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                    timeout_keep_alive=cfg.client_keepalive_s)
        return 0
    app = create_app(cfg)
    _freeze()
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                timeout_keep_alive=cfg.client_keepalive_s)
    return 0
