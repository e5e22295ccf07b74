"""What a local stack is made of: one ``InstanceSpec`` per vLLM server, one ``StackSpec``.

Threading model: immutable values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.devstack.placement import SPINNER_NICE
from kvtier.devstack.platform import VLLM_SERVER_ARGV, cpu_dtype, is_cpu_platform
from kvtier.ids import PodId, Role
from kvtier.runtime import free_ports
from kvtier.tier.env import InstanceEnv


class InstanceSpec(BaseModel):
    """Everything needed to start one vLLM server."""

    model_config = ConfigDict(frozen=True)

    name: PodId
    role: Role
    model: str
    http_port: int
    side_channel_port: int
    events_port: int
    replay_port: int
    # kvtier's host tier (KVTierConnector): its own KV-event PUB + replay and
    # the peer-fetch side channel. Exported as KVTIER_* env vars; unused when
    # the instance runs without the connector.
    tier_events_port: int
    tier_replay_port: int
    tier_p2p_port: int
    tier_metrics_port: int  # the tier's Prometheus /metrics (kvtier_tier_*)
    cpu_bind: str | None = None  # e.g. "0"; None lets vLLM decide
    kv_cache_gib: int = 1
    # KV capacity in blocks (--num-gpu-blocks-override) instead of kv_cache_gib's GiB. On the
    # CPU a NIXL engine starts ~10 s sooner with 2,048 blocks than with 1 GiB (it registers
    # less memory); the test suite's stacks use that (tests/conftest.py).
    num_blocks: int | None = Field(None, ge=1)
    block_size: int = 32
    max_model_len: int = 4096
    kv_transfer_config: dict | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = Field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.name}"

    def argv(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": self.topic,
        }
        argv = [
            *VLLM_SERVER_ARGV,
            "--model", self.model,
            "--served-model-name", Path(self.model).name, self.model,
            "--host", "127.0.0.1",
            "--port", str(self.http_port),
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--kv-events-config", json.dumps(events),
        ]
        if is_cpu_platform():
            # torch.compile warm-up costs ~45 s per start on 2 cores and buys
            # nothing for these tiny models.
            argv += ["--dtype", cpu_dtype(), "--enforce-eager"]
        if self.num_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        # last, so that an extra --num-gpu-blocks-override (a regime's, per role) wins
        return argv + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            InstanceEnv.NIXL_SIDE_CHANNEL_HOST: "127.0.0.1",
            InstanceEnv.NIXL_SIDE_CHANNEL_PORT: str(self.side_channel_port),
        })
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_NO_USAGE_STATS="1",
            # Enables /reset_prefix_cache, which tests and `kvtier ab` use to
            # force a cold device cache between runs. A local dev stack only.
            VLLM_SERVER_DEV_MODE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        env.update({
            InstanceEnv.TIER_EVENTS_PORT: str(self.tier_events_port),
            InstanceEnv.TIER_REPLAY_PORT: str(self.tier_replay_port),
            InstanceEnv.P2P_PORT: str(self.tier_p2p_port),
            # One host: the tier's peer server on loopback, as every address here is
            # (kvtier.tier.config resolves KVTIER_P2P_HOST; other hosts set their own).
            InstanceEnv.P2P_HOST: "127.0.0.1",
            InstanceEnv.METRICS_PORT: str(self.tier_metrics_port),
            InstanceEnv.POD_NAME: self.name,
        })
        if self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        env.update(self.extra_env)
        return env


    def router_endpoints(self) -> dict[str, str]:
        """This instance's params feed and lease server as a router on this host reaches
        them (``InstanceConfig.params_feed`` / ``lease``): what its KVTierNixlConnector binds
        (``kvtier.tier.params_feed.ParamsFeedConfig``); empty for other connectors."""
        kv = self.kv_transfer_config or {}
        if kv.get("kv_connector") != "KVTierNixlConnector":
            return {}
        from kvtier.tier.params_feed import ParamsFeedConfig

        env = {InstanceEnv.NIXL_SIDE_CHANNEL_PORT: str(self.side_channel_port),
               **{k: v for k, v in self.extra_env.items() if k.startswith("KVTIER_")}}
        cfg = ParamsFeedConfig.from_extra_config(kv.get("kv_connector_extra_config")).resolved(env)
        out = {}
        if cfg.params_feed_endpoint:
            out["params_feed"] = _reachable(cfg.params_feed_endpoint)
        if cfg.lease_endpoint and cfg.decode_lease_s > 0:
            out["lease"] = _reachable(cfg.lease_endpoint)
        return out


def _reachable(bound: str) -> str:
    """A bind address (``tcp://*:PORT``) as a client on this host connects to it."""
    return bound.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://0.0.0.0:",
                                                                  "tcp://127.0.0.1:")


PORTS_PER_INSTANCE = 8


class StackSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str
    prefill: int = 1
    decode: int = 1
    kv_transfer_config: dict | None = None
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    num_blocks: int | None = Field(None, ge=1)  # see InstanceSpec.num_blocks
    base_port: int | None = None  # None: ports picked by the OS
    # The cores the instances are bound to, one each in turn (VLLM_CPU_OMP_THREADS_BIND: one
    # OpenMP thread per instance). None: every core this process may use, from the first. Two
    # stacks on one machine each start from the first core unless given their own.
    cpus: tuple[int, ...] | None = Field(None, min_length=1)
    extra_args: tuple[str, ...] = ()
    # CPU platform, after start (kvtier.devstack.placement): "full" moves each model thread back to
    # its core and gives NIXL's busy-polling threads a low priority; "rebind" only the former;
    # "off" neither.
    cpu_placement: Literal["full", "rebind", "off"] = "full"
    # "full": the spinners' nice level; None puts them at SCHED_IDLE (starves the READs a
    # busy instance is the target of: kvtier.devstack.placement's docstring has the numbers).
    spinner_nice: int | None = Field(SPINNER_NICE, ge=0, le=19)
    # Start each instance once the one before it is ready. None: on CUDA only, where instances
    # share a GPU and vLLM sizes its KV cache from the memory free while it profiles, so a
    # neighbour allocating meanwhile leaves it "No available memory for the cache blocks";
    # unless the KV cache has a fixed size (--kv-cache-memory-bytes: vLLM skips that
    # profiling), when all start at once.
    one_at_a_time: bool | None = None

    def starts_one_at_a_time(self) -> bool:
        if self.one_at_a_time is not None:
            return self.one_at_a_time
        fixed_kv = any(a.split("=")[0] == "--kv-cache-memory-bytes" for a in self.extra_args)
        return not fixed_kv and not is_cpu_platform()

    def instances(self) -> list[InstanceSpec]:
        total = self.prefill + self.decode
        if total < 1:
            raise ValueError("a stack needs at least one instance")
        if self.base_port is None:
            ports = free_ports(PORTS_PER_INSTANCE * total)
        else:
            ports = list(range(self.base_port, self.base_port + PORTS_PER_INSTANCE * total))
        cpus = list(self.cpus) if self.cpus is not None else sorted(os.sched_getaffinity(0))
        out = []
        roles = [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode
        counters = {Role.PREFILL: 0, Role.DECODE: 0}
        for i, role in enumerate(roles):
            idx = counters[role]
            counters[role] += 1
            p = ports[PORTS_PER_INSTANCE * i: PORTS_PER_INSTANCE * (i + 1)]
            out.append(
                InstanceSpec(
                    name=PodId(f"{role.value}-{idx}"),
                    role=role,
                    model=self.model,
                    http_port=p[0],
                    side_channel_port=p[1],
                    events_port=p[2],
                    replay_port=p[3],
                    tier_events_port=p[4],
                    tier_replay_port=p[5],
                    tier_p2p_port=p[6],
                    tier_metrics_port=p[7],
                    # Spread instances over cores so P and D do not fight for one.
                    cpu_bind=str(cpus[i % len(cpus)]),
                    kv_cache_gib=self.kv_cache_gib,
                    num_blocks=self.num_blocks,
                    block_size=self.block_size,
                    max_model_len=self.max_model_len,
                    kv_transfer_config=self.kv_transfer_config,
                    extra_args=self.extra_args,
                )
            )
        return out

