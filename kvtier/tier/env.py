"""The environment variables an engine instance's kvtier connectors read: one table.

One connector config file serves every instance of a stack, so what differs per instance
(ports, the pod name, the peer address) comes from the instance's environment.
``kvtier.devstack.spec.InstanceSpec.env()`` writes these names; ``HostTierConfig.resolved``
and ``ParamsFeedConfig.resolved`` read them.

Threading model: constants.
"""

from __future__ import annotations

from enum import StrEnum


class InstanceEnv(StrEnum):
    # KVTierConnector (kvtier.tier.config)
    TIER_EVENTS_PORT = "KVTIER_TIER_EVENTS_PORT"  # the tier's KV-event PUB
    TIER_REPLAY_PORT = "KVTIER_TIER_REPLAY_PORT"  # ... and its replay ROUTER
    P2P_PORT = "KVTIER_P2P_PORT"  # the peer-fetch side channel
    P2P_HOST = "KVTIER_P2P_HOST"  # the address peers are given
    METRICS_PORT = "KVTIER_METRICS_PORT"  # the tier's Prometheus /metrics
    POD_NAME = "KVTIER_POD_NAME"  # the instance's name in metrics and events
    # KVTierNixlConnector (kvtier.tier.params_feed)
    PARAMS_FEED_PORT = "KVTIER_PARAMS_FEED_PORT"  # finished requests' params PUB
    LEASE_PORT = "KVTIER_LEASE_PORT"  # decode-lease control (metrics on the port + 1)
    # vLLM's NIXL side channel: the base of the deprecated ``*_port_offset`` keys
    NIXL_SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
    NIXL_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
