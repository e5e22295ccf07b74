"""The local stack a live run deploys a strategy on (`kvtier.ab.live.runner`): its spec, the
router's view of its instances, an in-process indexer, and the machine-wide lock.

- `stack_spec_for`: the ``StackSpec`` of a strategy (topology, ``--kv-transfer-config``, vLLM
  flags), a `RoleStackSpec` when a regime gives one role its own arguments or environment.
- `router_instances`: the router's ``instances`` for a running stack (decode lease endpoints
  included).
- `indexer_for`: an indexer subscribed to every instance's host-tier events, served over HTTP
  in this process (for tests that drive a router themselves; a live run starts ``kvtier
  indexer`` as a process, ``kvtier.ab.live.services``); `locked_stack`: a ``LocalStack``
  under the machine-wide e2e lock.

Threading model: called from the runner's thread; `indexer_for` starts the indexer's own
threads and stops them on exit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from kvtier.ab.live.lock import e2e_lock
from kvtier.ab.live.probes import lease_endpoint
from kvtier.ab.strategies import StrategySpec
from kvtier.devstack.platform import is_cpu_platform
from kvtier.devstack.spec import InstanceSpec, StackSpec
from kvtier.devstack.stack import LocalStack
from kvtier.runtime import ServerThread

if TYPE_CHECKING:
    from kvtier.indexer.service import IndexerService

log = logging.getLogger("kvtier.ab")


class RoleStackSpec(StackSpec):
    """A ``StackSpec`` whose instances of one role get extra vLLM arguments and environment
    (a regime's scarce decode KV: ``--num-gpu-blocks-override`` on decode nodes only)."""

    role_args: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = Field(default_factory=dict)

    def instances(self) -> list[InstanceSpec]:
        out = []
        for i in super().instances():
            r = i.role.value
            out.append(i.model_copy(update={
                "extra_args": (*i.extra_args, *self.role_args.get(r, ())),
                "extra_env": {**i.extra_env, **self.role_env.get(r, {})}}))
        return out


def stack_spec_for(strategy: StrategySpec, model: str, **kw: Any) -> StackSpec:
    """The local stack that deploys ``strategy``: its topology and ``--kv-transfer-config``
    (and a regime's per-role settings, ``role_args`` / ``role_env``, when given)."""
    extra = tuple(kw.pop("extra_args", ()))
    role_args, role_env = kw.pop("role_args", None), kw.pop("role_env", None)
    on_cpu = is_cpu_platform()
    if on_cpu and strategy.vllm_offload:
        raise ValueError(f"{strategy.name}: vLLM's OffloadingConnector does not run on vLLM's "
                         "CPU platform; this strategy needs a GPU (kvtier's own host tier is "
                         "host-p2p)")
    if not strategy.prefix_caching:
        # StackSpec always passes --enable-prefix-caching (KV events need it);
        # argparse keeps the last of the pair.
        extra = (*extra, "--no-enable-prefix-caching")
    # Usage then reports cached_tokens per request: the prefill's reused tokens.
    extra = (*extra, "--enable-prompt-tokens-details")
    # On CUDA, NIXL moves KV from device memory (a CPU buffer's D->P read never answered on
    # the lent GPU: benchmarks/gpu/pd_bench.sh)
    kv = strategy.kv_transfer_config(nixl_buffer_device=None if on_cpu else "cuda")
    if role_args or role_env:
        return RoleStackSpec(model=model, prefill=strategy.prefill, decode=strategy.decode,
                             kv_transfer_config=kv, extra_args=extra,
                             role_args=role_args or {}, role_env=role_env or {}, **kw)
    return StackSpec(model=model, prefill=strategy.prefill, decode=strategy.decode,
                     kv_transfer_config=kv, extra_args=extra, **kw)


def router_instances(stack: LocalStack) -> list[dict[str, Any]]:
    """The router's ``instances``: name, URL and role of each, and a decode node's ``lease``
    endpoint when the stack's ``--kv-transfer-config`` has decode leases (side-channel port +
    ``lease_port_offset``, ``kvtier.ab.live.probes.lease_endpoint``)."""
    kv = stack.spec.kv_transfer_config
    out: list[dict[str, Any]] = []
    for i in stack.instances:
        inst: dict[str, Any] = {"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
        if i.spec.role.value == "decode":
            lease = lease_endpoint(i.spec.side_channel_port, kv)
            if lease is not None:
                inst["lease"] = lease
        out.append(inst)
    return out


@contextlib.contextmanager
def indexer_for(stack: LocalStack, model_name: str,
                block_size: int) -> Iterator[tuple[IndexerService, str]]:
    """In-process indexer subscribed to every instance's host-tier events, served over HTTP."""
    from kvtier.indexer.config import IndexerConfig, PodSpec
    from kvtier.indexer.http import build_app
    from kvtier.indexer.service import IndexerService

    pods = [PodSpec(name=i.spec.name, events=f"tcp://127.0.0.1:{i.spec.tier_events_port}",
                    replay=f"tcp://127.0.0.1:{i.spec.tier_replay_port}",
                    p2p=f"127.0.0.1:{i.spec.tier_p2p_port}") for i in stack.instances]
    cfg = IndexerConfig(port=0, pods=tuple(pods), default_model=model_name,
                        block_size=block_size)
    svc = IndexerService(cfg)
    svc.start()
    # Replay the trace only once every tier's event PUB is connected, or the first turn's
    # blocks go missing from the host-bytes ledger (seen: host-p2p e2e reporting 0 bytes).
    if not svc.wait_connected(15.0):
        log.warning("host bytes held may be undercounted")
    try:
        with ServerThread(build_app(svc), name="kvtier-ab-idx") as srv:
            yield svc, srv.url
    finally:
        svc.stop()


@contextlib.contextmanager
def locked_stack(spec: StackSpec, log_dir: Path) -> Iterator[LocalStack]:
    """A LocalStack under the machine-wide e2e lock (one stack at a time on this machine)."""
    with e2e_lock(), LocalStack(spec, log_dir) as stack:
        yield stack


StackProvider = Callable[[StackSpec, Path], contextlib.AbstractContextManager[LocalStack]]
