"""vLLM adapters (installed as kvtier.connectors).

``"kv_connector": "KVTierConnector", "kv_connector_module_path":
"kvtier.connectors"`` loads the connector; the ``vllm.general_plugins`` entry
point (``register``) also registers the name with vLLM's connector factory so
the module path can be omitted. Importing this package does not import vLLM;
the classes load on first attribute access.
"""

from __future__ import annotations

import importlib

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
    return getattr(importlib.import_module(module), name)


def register() -> None:
    """vllm.general_plugins entry point: register kvtier's connectors by name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in _LAZY.items():
        try:
            KVConnectorFactory.register_connector(name, module, name)
        except ValueError:
            pass  # already registered (plugins load once per process, but be safe)
