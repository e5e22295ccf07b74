"""``kvtier router``: run the KV-aware P/D router.

    kvtier router --config FILE
    kvtier router --prefill URL [--prefill URL ...] --decode URL [...] \\
                  [--indexer URL] [--host 127.0.0.1] [--port 8000] [--api-key KEY ...]

Flags are turned into a ``RouterConfig`` once; flags given next to ``--config``
override the file's values.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router's modules load only when `kvtier router` runs
    from kvtier.router.config import RouterConfig

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
    ap.add_argument("--prefill", action="append", default=None, metavar="URL")
    ap.add_argument("--decode", action="append", default=None, metavar="URL")
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
    ap.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    from kvtier.router.config import RouterConfig, load_config

    overrides = {k: getattr(args, k) for k in (
        "prefill", "decode", "indexer", "host", "port", "api_keys", "block_size",
        "decode_kv_ttl_s", "stream_capture", "cost_model")}
    if args.config:
        return load_config(args.config, **overrides)
    return RouterConfig.model_validate({k: v for k, v in overrides.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from kvtier.router.app import create_app
    from pydantic import ValidationError

    try:
        cfg = config_from_args(args)
    except (ValidationError, ValueError, OSError) as e:
        print(f"kvtier router: bad configuration: {e}", file=sys.stderr)
        return 2
    if cfg.log_json:
        h = logging.StreamHandler()
        h.setFormatter(JsonFormatter())
        root = logging.getLogger()
        root.handlers[:] = [h]
    # httpx logs every upstream request at INFO: one line per leg is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(cfg)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
    return 0
