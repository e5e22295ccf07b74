"""``kvtier stack up``: run a local P/D fleet of vLLM servers until Ctrl-C.
``kvtier stack place PID``: fix the thread placement of a vLLM-CPU server started elsewhere."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kvtier.configs import load_config_file
from kvtier.devstack.models import PRESETS, build_model
from kvtier.devstack.placement import SPINNER_CHOICES, SPINNER_NICE
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack

# What a new user gets: streaming that keeps reuse (the params feed) and leases the router
# renews and releases (DELETE frees the blocks; a dead router's lapse within one lease).
DEFAULT_KV_CONFIG = "nixl-bidirectional-lease"


def resolve_model(model: str) -> str:
    """A preset name (tiny, bench) builds/caches it; anything else is a path."""
    if model in PRESETS:
        return str(build_model(model))
    if not Path(model).exists():
        raise SystemExit(f"model {model!r} is neither a preset {sorted(PRESETS)} nor a directory")
    return model


def _stack_up(args: argparse.Namespace) -> int:
    spec = StackSpec(
        model=resolve_model(args.model),
        prefill=args.prefill,
        decode=args.decode,
        kv_transfer_config=load_config_file(args.kv_config),
        base_port=args.base_port,
        num_blocks=args.num_blocks,
        cpus=args.cpus,
    )
    stack = LocalStack(spec, Path(args.log_dir))
    # `kvtier` installed kvtier.runtime's SIGTERM policy: `kill` unwinds like Ctrl-C.
    try:
        stack.start()
        state = stack.state()
        if args.state_file:
            Path(args.state_file).parent.mkdir(parents=True, exist_ok=True)
            Path(args.state_file).write_text(json.dumps(state, indent=2))
        print(json.dumps(state, indent=2), flush=True)
        print("stack is up; Ctrl-C stops it"
              + (f"; `kvtier router` reads its instances from {args.state_file}"
                 if args.state_file else ""), flush=True)
        while all(i.alive() for i in stack.instances):
            time.sleep(1)
        dead = [i.spec.name for i in stack.instances if not i.alive()]
        print(f"instance(s) {dead} exited; stopping the stack")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def parse_cpus(text: str) -> tuple[int, ...]:
    """``--cpus`` (``1``, ``0,1``, ``0-3``) as core ids, in the order given; ArgumentTypeError
    for a core this process may not use."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected core ids like 1 or 0,1 or 0-3") \
            from None
    allowed = os.sched_getaffinity(0)
    if not out or any(c not in allowed for c in out):
        raise argparse.ArgumentTypeError(f"{text!r}: this process may use cores "
                                         f"{sorted(allowed)} only")
    return tuple(out)


def _stack_place(args: argparse.Namespace) -> int:
    from kvtier.devstack.placement import place, priority_name, spinner_priority

    nice = spinner_priority(args.spinner_nice)
    placed = place(args.pid, args.core, nice=nice)
    if not placed:
        print(f"no vLLM worker process (VLLM::Worker) under pid {args.pid}")
        return 1
    for p in placed:
        print(f"worker {p.pid}: " + (f"model thread moved to core {args.core}; "
                                     if p.rebound else "affinity unchanged; ")
              + f"{len(p.demoted)} spinning thread(s) moved to {priority_name(nice)} {p.demoted}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("stack", help="local P/D stack of vLLM servers")
    st_sub = st.add_subparsers(dest="stack_cmd", metavar="ACTION", required=True)
    up = st_sub.add_parser("up", help="start N prefill + M decode vLLM servers; Ctrl-C stops them")
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--model", default="tiny", help="preset (tiny, bench) or model directory")
    up.add_argument("--kv-config", default=DEFAULT_KV_CONFIG,
                    help="name of a --kv-transfer-config file in configs/ (default "
                         f"{DEFAULT_KV_CONFIG}: vLLM's bidirectional NixlConnector with kvtier's "
                         "params feed, so streamed turns keep their KV, and decode leases)")
    up.add_argument("--num-blocks", type=int, default=None,
                    help="KV capacity of each instance in blocks (--num-gpu-blocks-override; "
                         "default: vLLM's own sizing, on the CPU VLLM_CPU_KVCACHE_SPACE=1 GiB)")
    up.add_argument("--cpus", type=parse_cpus, default=None, metavar="LIST",
                    help="cores to bind the instances to, one each in turn (e.g. 1 or 0,1; "
                         "default: every core this process may use, from the first). Give "
                         "a second stack on the same machine cores of its own")
    up.add_argument("--base-port", type=int, default=None,
                    help="first of 8 consecutive ports per instance (default: OS-assigned)")
    up.add_argument("--log-dir", default=".kvtier/logs")
    up.add_argument("--state-file", default=".kvtier/stack.json",
                    help="where to write the instances' endpoints (JSON)")
    up.set_defaults(func=_stack_up)
    pl = st_sub.add_parser(
        "place", help="fix a running vLLM-CPU server's thread placement (NixlConnector moves "
                      "its model thread; NIXL's progress thread spins): see kvtier.devstack.placement")
    pl.add_argument("pid", type=int, help="the vLLM server's pid (its workers are found below "
                                          "it); run this while the server is idle")
    pl.add_argument("--core", type=int, default=None,
                    help="the core its model should run on (its VLLM_CPU_OMP_THREADS_BIND)")
    pl.add_argument("--spinner-nice", default=str(SPINNER_NICE),
                    choices=SPINNER_CHOICES, metavar="0..19|idle",
                    help=f"priority for NIXL's spinning progress threads (default {SPINNER_NICE}; "
                         "'idle': SCHED_IDLE, which starves READs this server is the target of)")
    pl.set_defaults(func=_stack_place)
