"""vLLM adapters (installed as kvtier.connectors).

``"kv_connector": "KVTierConnector", "kv_connector_module_path":
"kvtier.connectors"`` loads the connector. vLLM also looks connectors up by name alone
(``KVConnectorFactory.get_connector_class_by_name``: MultiConnector rebuilds each child's
stats that way in the API server process), so every name in ``_LAZY`` must be registered
with vLLM's factory in each process that reads stats. Two ways do it, so kvtier works
installed or only on ``PYTHONPATH``:

- the ``vllm.general_plugins`` entry point (``register``), when kvtier is installed;
- importing this package once vLLM's factory is loaded (which is how vLLM imports it:
  ``kv_connector_module_path`` resolves through the factory, in the API server process too
  when it checks the children's CUDA-graph needs), and loading any connector class from it.

The same registration adds ``"kvtier-peer"`` to vLLM's secondary-tier factory
(``kvtier.connectors.peer_tier``): kvtier's peer fetch under vLLM's own CPU offloading, which
vLLM builds without importing this package, so there it needs the entry point.

Importing this package does not import vLLM; the classes load on first attribute access.
Registration is idempotent.
"""

from __future__ import annotations

import importlib
import sys

_LAZY = {
    "KVTierConnector": "kvtier.connectors.kvtier_connector",
    "CostAwareConnector": "kvtier.connectors.cost_connector",
    # Registered too: inside a MultiConnector vLLM rebuilds each child's stats by class name
    # from this registry ("Connector 'KVTierNixlConnector' is not registered" otherwise).
    "KVTierNixlConnector": "kvtier.connectors.params_feed",
}


def __getattr__(name: str) -> type:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.connectors' has no attribute {name!r}")
    cls: type = getattr(importlib.import_module(module), name)
    register()  # this package may have been imported before vLLM: the class import loaded it
    return cls


def register() -> None:
    """vllm.general_plugins entry point: register kvtier's connectors by name (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in _LAZY.items():
        try:
            KVConnectorFactory.register_connector(name, module, name)
        except ValueError:
            pass  # already registered: by the entry point or an earlier import
    # kvtier's peer fetch as a secondary tier of vLLM's CPU offloading (TieringOffloadingSpec,
    # "type": "kvtier-peer"); the class loads when a config names it.
    from kvtier.connectors.compat import secondary_tier_factory

    factory = secondary_tier_factory()
    if factory is not None:
        try:
            factory.register_tier("kvtier-peer", "kvtier.connectors.peer_tier", "KVTierPeerTier")
        except ValueError:
            pass  # already registered


# Imported by vLLM (through kv_connector_module_path) with no entry point: register here.
if "vllm.distributed.kv_transfer.kv_connector.factory" in sys.modules:
    register()
