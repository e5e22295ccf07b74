"""deploy/: every overlay renders with ``kubectl kustomize``, every object validates against the
Kubernetes schema of ``KUBE_VERSION`` (kubernetes-validate, strict), and the manifests agree
with the code (tests/deploycheck.py says what is checked). A copy of deploy/ with planted errors
shows each check reports its error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from kvtier.tier.env import InstanceEnv
from tests import deploycheck as dc

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not on this machine: deploy/'s overlays cannot be rendered "
           "(`kubectl kustomize`); install kubectl to run these checks")


def _problems(docs: list[dict[str, Any]], tmp: Path) -> list[str]:
    return dc.pod_problems(docs) + dc.wiring_problems(docs) + dc.kvtier_problems(docs, tmp)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {o: dc.render(DEPLOY / "overlays" / o) for o in dc.OVERLAYS}


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schema(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy",
            "PodDisruptionBudget"} <= kinds
    assert dc.schema_problems(docs) == []


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_overlay_agrees_with_the_code(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                      tmp_path: Path) -> None:
    assert _problems(rendered[overlay], tmp_path) == []


def test_overlays_run_what_they_say(rendered: dict[str, list[dict[str, Any]]]) -> None:
    shipped = json.loads((REPO / "configs" / "nixl-bidirectional-lease.json").read_text())
    for overlay, docs in rendered.items():
        eng = dc.engines(docs)
        roles = sorted(e.role for e in eng)
        want = ["decode", "prefill"] if overlay != "cuda-xpyd" else ["decode"] * 2 + ["prefill"] * 2
        assert roles == want, overlay
        cuda = overlay.startswith("cuda")
        for e in eng:
            kv = e.json_flag("--kv-transfer-config")
            assert kv == {**shipped, "kv_buffer_device": "cuda" if cuda else "cpu"}, e.name
            assert e.env[InstanceEnv.POD_NAME] == e.name
            assert e.env[InstanceEnv.NIXL_SIDE_CHANNEL_HOST] == dc.FIELD_STAND_IN["status.podIP"]
        routers = [w for w in dc.workloads(docs) if w.labels.get("app.kubernetes.io/component")
                   == "router"]
        assert [w.replicas for w in routers] == [2]


def test_the_allow_listed_vllm_names_are_vllms() -> None:
    names = [n for n in [*dc.ALLOWED_ENV, *dc.KVTIER_ENV] if n.startswith("VLLM_")]
    if dc.vllm_reads(names[0]) is None:
        pytest.skip("vLLM is not installed here: its env table cannot be read")
    assert [n for n in names if not dc.vllm_reads(n)] == []


def test_prometheus_operator_component_scrapes_declared_ports(tmp_path: Path) -> None:
    deploy = os.path.relpath(DEPLOY, tmp_path)  # kustomize refuses absolute paths
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{deploy}/overlays/cpu]\n"
        f"components: [{deploy}/components/prometheus-operator]\n")
    docs = dc.render(tmp_path)
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert len(monitors) == 2
    for m in monitors:
        pods = [w for w in dc.workloads(docs) if dc.selects(m["spec"]["selector"], w.labels)]
        assert pods, m["metadata"]["name"]
        for ep in m["spec"]["podMetricsEndpoints"]:
            assert all(ep["port"] in w.ports() for w in pods), (m["metadata"]["name"], ep)
    assert _problems(docs, tmp_path) == []


# (file under deploy/, text there, planted text, what must be reported)
PLANTS = [
    ("base/decode.yaml", "readinessProbe:\n            httpGet: {path: /health, port: http}",
     "readinessProbe:\n            httpGet: {path: /health, port: web}",
     "StatefulSet/decode container vllm: readinessProbe port 'web' is not a port of the container"),
    ("base/router.yaml", "          readinessProbe:\n            httpGet: {path: /healthz, port: http}\n"
     "            periodSeconds: 5\n            timeoutSeconds: 3\n", "",
     "Deployment/kvtier-router container router: no readinessProbe"),
    ("base/prefill.yaml", "            - name: VLLM_NO_USAGE_STATS\n",
     "            - name: KVTIER_PARAMS_FEED_PROT\n              value: \"6600\"\n"
     "            - name: VLLM_NO_USAGE_STATS\n",
     "StatefulSet/prefill container vllm: env KVTIER_PARAMS_FEED_PROT is read by nothing"),
    ("base/config/router.yaml", "tcp://decode-0.decode:6600", "tcp://decode-0.decode:6700",
     "router config: instance decode-0:"),
    ("base/indexer.yaml", "targetPort: http", "targetPort: api",
     "Service/kvtier-indexer: targetPort 'api' is not a port of Deployment/kvtier-indexer"),
    ("base/indexer.yaml", "            timeoutSeconds: 3\n", "            timeoutSecond: 3\n",
     "Deployment/kvtier-indexer: schema"),
]


def test_negative_control_planted_errors_are_reported(tmp_path: Path) -> None:
    schema = find_spec("kubernetes_validate") is not None  # else its plant is not looked for
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    for rel, old, new, _ in PLANTS:
        f = copy / rel
        text = f.read_text()
        assert text.count(old) >= 1, f"plant site gone from {rel}: {old!r}"
        f.write_text(text.replace(old, new, 1))
    docs = dc.render(copy / "overlays" / "cpu")
    found = "\n".join((dc.schema_problems(docs) if schema else []) + _problems(docs, tmp_path))
    missed = [want for *_, want in PLANTS if want not in found and (schema or "schema" not in want)]
    assert missed == [], f"not reported: {missed}\nreported:\n{found}"


def test_negative_control_a_broken_kustomization_does_not_render(tmp_path: Path) -> None:
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    k = copy / "overlays" / "cpu" / "kustomization.yaml"
    k.write_text(k.read_text().replace("path: engines.yaml", "path: no-such-patch.yaml"))
    with pytest.raises(subprocess.CalledProcessError):
        dc.render(copy / "overlays" / "cpu")


def test_decode_manifest_is_the_prefill_manifest_with_its_role() -> None:
    def body(name: str) -> str:
        text = (DEPLOY / "base" / f"{name}.yaml").read_text()
        return text[text.index("apiVersion:"):]

    assert body("decode") == body("prefill").replace("prefill", "decode")
