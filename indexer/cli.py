"""``kvtier indexer``: run the KV-event indexer daemon.

    kvtier indexer --config FILE
    kvtier indexer [--pod SPEC ...] [--host H] [--port 8300] [--backend memory|redis://...]
                   [--stale-after SECONDS]

Flags given next to ``--config`` override the file. ``--pod`` is
``NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,p2p=HOST:PORT][,model=NAME][,stream=S]``;
the same NAME given again adds another event stream to that pod. ``${VAR}`` in a
spec is read from the environment (peer hosts are never defaulted).
"""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from kvtier.indexer.config import IndexerConfig, PodSpec

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "indexer", help="run the KV-event indexer daemon (HTTP API on :8300)",
        description="Subscribe to vLLM KV events of every pod and answer prefix lookups.")
    p.add_argument("--config", help="YAML or JSON IndexerConfig file")
    p.add_argument("--pod", action="append", default=None, metavar="SPEC",
                   help="NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,p2p=HOST:PORT]"
                        "[,model=NAME][,stream=S] (repeatable; a NAME given again adds "
                        "another event stream to that pod)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8300)")
    p.add_argument("--backend", default=None, help="memory (default) or redis://HOST:PORT/DB")
    p.add_argument("--model", dest="default_model", default=None,
                   help="model name for pods without model= (default 'default')")
    p.add_argument("--block-size", type=int, default=None, help="engine block size (32)")
    p.add_argument("--snapshot", dest="snapshot_path", default=None,
                   help="snapshot file (written on shutdown, read on start)")
    p.add_argument("--stale-after", dest="stale_after_s", type=float, default=None,
                   metavar="SECONDS", help="a pod whose event streams have all been down this "
                   "long is not offered as a source (default 10)")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> IndexerConfig:
    overrides = {"host": args.host, "port": args.port, "backend": args.backend,
                 "default_model": args.default_model, "block_size": args.block_size,
                 "snapshot_path": args.snapshot_path, "stale_after_s": args.stale_after_s}
    pods = [PodSpec.parse(s) for s in args.pod] if args.pod else None
    if args.config:
        cfg = IndexerConfig.load(args.config, **overrides)
        if pods:
            cfg = IndexerConfig.model_validate({**cfg.model_dump(), "pods": cfg.pods + tuple(pods)})
        return cfg
    return IndexerConfig.model_validate(
        {k: v for k, v in {**overrides, "pods": pods}.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(args)
    except (ValidationError, ValueError, OSError) as e:
        print(f"kvtier indexer: bad configuration: {e}", file=sys.stderr)
        return 2
    from kvtier.indexer.http import serve
    from kvtier.indexer.native import HOT_PATH
    from kvtier.indexer.service import IndexerService

    log.info("indexer on http://%s:%d, backend %s, %d pod(s), %d stream(s)", cfg.host, cfg.port,
             cfg.backend, len(cfg.pods_by_name()), len(cfg.pods))
    log.info("indexer hot path: %s", HOT_PATH)
    serve(IndexerService(cfg), cfg.host, cfg.port)
    return 0
