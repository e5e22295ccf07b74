"""The ``kvtier`` console script.

Each subcommand lives in its own module that exposes
``register(subparsers) -> None``; the parser it adds sets ``func`` to a
callable taking the parsed namespace and returning an exit code. Only modules
listed here are loaded, and only subcommands that work are registered.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvtier.runtime import unwind_on_sigterm

# Modules whose subcommands make up `kvtier`.
SUBCOMMAND_MODULES = (
    "kvtier.devstack.cli",  # kvtier stack up|place
    "kvtier.indexer.cli",   # kvtier indexer
    "kvtier.router.cli",    # kvtier router
    "kvtier.ab.live.cli",   # kvtier ab, kvtier calibrate, kvtier ab-report, kvtier demo
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV-cache store, KV-event indexer and KV-aware P/D router for vLLM.",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Not built yet in this checkout: the subcommand is simply absent.
            if e.name and name.startswith(e.name):
                continue
            raise
        mod.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    # SIGTERM unwinds like Ctrl-C (kvtier.runtime), so every command's `finally` and context
    # managers run and the servers a command started (vLLM stacks of `kvtier ab`, say) are
    # stopped, not orphaned. Daemons that run uvicorn in the main thread install their own.
    unwind_on_sigterm()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
