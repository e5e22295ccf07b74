"""kvtier's connectors are registered with vLLM's factory by name without the entry point.

vLLM's MultiConnector rebuilds each child's stats by class name
(``KVConnectorFactory.get_connector_class_by_name``), in the API server process too, where
kvtier was only reached through ``kv_connector_module_path``. With kvtier on ``PYTHONPATH``
(no ``vllm.general_plugins`` entry point) that lookup must still succeed. Each case runs in a
fresh interpreter with ``VLLM_PLUGINS`` naming no plugin, so the entry point is not run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory",
                    reason="vLLM is part of the test environment (./run test installs it)")

NAMES = ("KVTierConnector", "CostAwareConnector", "KVTierNixlConnector")


def _run(code: str) -> str:
    env = dict(os.environ, VLLM_PLUGINS="none-such-plugin")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_module_path_lookup_registers_every_name_and_multiconnector_stats_resolve():
    out = _run(f"""
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # VLLM_PLUGINS names no plugin: kvtier's entry point is not run
        names = {NAMES!r}
        for n in names:  # negative control: nothing registered them yet
            try:
                KVConnectorFactory.get_connector_class_by_name(n)
            except ValueError:
                pass
            else:
                raise SystemExit(f"{{n}} registered before kvtier was imported")
        # what vLLM does with a MultiConnector config in the API server process
        extra = {{"connectors": [{{"kv_connector": "KVTierNixlConnector",
                                   "kv_connector_module_path": "kvtier.connectors",
                                   "kv_role": "kv_both"}}]}}
        MultiConnector.requires_piecewise_for_cudagraph(extra)
        for n in names:
            assert KVConnectorFactory.get_connector_class_by_name(n).__name__ == n, n
        stats = MultiConnector.build_kv_connector_stats(data={{"KVTierNixlConnector": {{}}}})
        print("stats", type(stats).__name__, sorted(stats.data))
    """)
    assert "stats MultiKVConnectorStats ['KVTierNixlConnector']" in out


def test_package_imported_before_vllm_registers_on_first_class_load():
    out = _run(f"""
        import kvtier.connectors as kc
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        kc.register  # the entry point's function exists; not called here
        kc.KVTierConnector  # what get_connector_class does with kv_connector_module_path
        for n in {NAMES!r}:
            assert KVConnectorFactory.get_connector_class_by_name(n).__name__ == n, n
        kc.register()  # idempotent: a second registration (entry point + import) is harmless
        print("ok")
    """)
    assert "ok" in out
