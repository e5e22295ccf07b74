"""``kvtier demo`` (what ``./run demo`` runs): a short live ``kvtier ab`` on the tiny model.

Threading model: runs on the caller's thread (the runner owns its helper threads).
"""

from __future__ import annotations

import argparse

from kvtier.ab.live.ab import run_ab

DEMO_STRATEGIES = "recompute,device-ttl"


def run_demo(args: argparse.Namespace) -> int:
    """``kvtier ab`` with the demo's fixed settings; only strategies, output directory and
    time scale come from the command line."""
    ns = argparse.Namespace(
        model="tiny", strategies=args.strategies, trace=None, out=args.out,
        time_scale=args.time_scale, simulate=False, conversations=3, turns=4, seed=0,
        decode_ttl=None, host_mib=None, prefill=1, decode=1, block_size=32, max_model_len=2048,
        cost=None, no_progress=False, repeats=1)
    return run_ab(ns)
