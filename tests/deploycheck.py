"""What tests/unit/test_deploy.py checks in deploy/'s rendered manifests, one problem per line.

Rendering is ``kubectl kustomize`` (``render``); every check takes the rendered objects and
returns a list of problems, so a planted error in a copy of deploy/ shows up as one line.

- ``schema_problems``: every object against the Kubernetes JSON schema of ``KUBE_VERSION``
  (``kubernetes-validate``, strict: an unknown field is an error).
- ``pod_problems``: every container has an image; every long-running one a readiness and a
  liveness probe on a port it declares, and resource requests; every env var it sets is one
  the code reads (``kvtier.tier.env.InstanceEnv``, ``ALLOWED_ENV``) or one its own command
  uses as ``$(NAME)``, and every ``$(NAME)`` it uses is set; scrape annotations name a
  declared port.
- ``wiring_problems``: Services, NetworkPolicies, PodDisruptionBudgets and StatefulSets'
  serviceName select pods that exist, by ports those pods declare.
- ``kvtier_problems``: the router's and the indexer's commands, parsed by their own CLIs
  (``kvtier.router.cli``, ``kvtier.indexer.cli``) with the config from their ConfigMap,
  name exactly the engine pods the StatefulSets make, at their DNS names and declared ports;
  each decode pod's params feed and lease server are where its connector config
  (``kvtier.tier.params_feed.ParamsFeedConfig``, resolved with the pod's env) binds them;
  block size, TTL and model agree; a replicated router or indexer uses a shared Redis.

Also used to start the CPU overlay's containers as local processes (``containers``,
``resolved_env``, ``expand``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvtier.tier.env import InstanceEnv

KUBE_VERSION = "1.30.0"
OVERLAYS = ("cuda-1p1d", "cuda-xpyd", "cpu")
# Kinds outside Kubernetes' own schema (CRDs of optional components): not schema-checked.
CRD_GROUPS = ("monitoring.coreos.com/",)

# Env names a container may set besides kvtier's own (InstanceEnv), and who reads each.
ALLOWED_ENV = {
    "VLLM_NO_USAGE_STATS": "vLLM: no usage report",
    "VLLM_CPU_KVCACHE_SPACE": "vLLM-CPU: KV cache GiB",
    "VLLM_CPU_OMP_THREADS_BIND": "vLLM-CPU: which cores its OpenMP threads take",
    "OMP_NUM_THREADS": "OpenMP (torch): how many threads",
    "UCX_TLS": "UCX, NIXL's transport: which transports",
    "UCX_NET_DEVICES": "UCX: which network device",
    "HF_TOKEN": "huggingface_hub: downloads of gated models",
}
KVTIER_ENV = {e.value for e in InstanceEnv}
# What a downward-API field stands for when the checks resolve a pod's env.
FIELD_STAND_IN = {"status.podIP": "10.0.0.1"}

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def render(kustomization_dir: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIR`` as objects; CalledProcessError (with kubectl's stderr) if it
    does not render."""
    import yaml

    out = subprocess.run(["kubectl", "kustomize", str(kustomization_dir)], check=True,
                         capture_output=True, text=True, timeout=60)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def vllm_reads(name: str) -> bool | None:
    """Whether vLLM's env table (vllm/envs.py) names ``name``; None without vLLM here.
    Read as text: importing vllm.envs costs seconds."""
    spec = find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    envs = Path(next(iter(spec.submodule_search_locations))) / "envs.py"
    return f'"{name}"' in envs.read_text(encoding="utf-8")


# -- the objects -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj["kind"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def replicas(self) -> int:
        return int(self.obj["spec"].get("replicas", 1))

    @property
    def pod(self) -> dict[str, Any]:
        return dict(self.obj["spec"]["template"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.pod["metadata"].get("labels", {}))

    def pod_names(self) -> list[str]:
        """StatefulSet pods' names (NAME-0, NAME-1, ...); [] for a Deployment's."""
        return [f"{self.name}-{i}" for i in range(self.replicas)] if self.kind == "StatefulSet" else []

    def ports(self) -> dict[str, int]:
        return {p["name"]: int(p["containerPort"]) for c in containers(self)
                for p in c.get("ports", []) if "name" in p}

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


def workloads(docs: list[dict[str, Any]]) -> list[Workload]:
    return [Workload(d) for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(w: Workload, init: bool = False) -> list[dict[str, Any]]:
    spec = w.pod["spec"]
    return list(spec.get("initContainers", [])) if init else list(spec["containers"])


def config_maps(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}


def of_kind(docs: list[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    return (d for d in docs if d["kind"] == kind)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels/matchExpressions, or a Service's plain map)."""
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for e in selector.get("matchExpressions", []):
        op, have = e["operator"], labels.get(e["key"])
        if (op == "In" and have not in e["values"]) or (op == "NotIn" and have in e["values"]) \
                or (op == "Exists" and have is None) or (op == "DoesNotExist" and have is not None):
            return False
    return True


def resolved_env(w: Workload, c: dict[str, Any], pod_name: str,
                 cms: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's env as it would be in pod ``pod_name`` (secrets left out)."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        src = e.get("valueFrom")
        if src is None:
            env[e["name"]] = str(e.get("value", ""))
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            env[e["name"]] = cms.get(ref["name"], {}).get(ref["key"], "")
        elif "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            env[e["name"]] = pod_name if path == "metadata.name" else FIELD_STAND_IN.get(path, "")
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(NAME)`` expansion of command/args (an unset NAME stays as written)."""
    return [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def argv(c: dict[str, Any]) -> list[str]:
    return [*c.get("command", []), *c.get("args", [])]


# -- checks ------------------------------------------------------------------------------------


def schema_problems(docs: list[dict[str, Any]], version: str = KUBE_VERSION) -> list[str]:
    import kubernetes_validate

    bad = []
    for d in docs:
        if d["apiVersion"].startswith(CRD_GROUPS):
            continue
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            bad.append(f"{d['kind']}/{d['metadata']['name']}: schema {version}: {e.message}")
    return bad


def _probe_port(probe: dict[str, Any]) -> Any:
    for how in ("httpGet", "tcpSocket", "grpc"):
        if how in probe:
            return probe[how]["port"]
    return None  # exec


def pod_problems(docs: list[dict[str, Any]]) -> list[str]:
    bad = []
    for w in workloads(docs):
        for c in containers(w, init=True) + containers(w):
            if not c.get("image"):
                bad.append(f"{w} container {c['name']}: no image")
        for c in containers(w):
            where = f"{w} container {c['name']}"
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    if kind != "startupProbe":
                        bad.append(f"{where}: no {kind}")
                    continue
                port = _probe_port(probe)
                if port is not None and port not in ports and port not in ports.values():
                    bad.append(f"{where}: {kind} port {port!r} is not a port of the container")
            req = c.get("resources", {}).get("requests", {})
            if not {"cpu", "memory"} <= set(req):
                bad.append(f"{where}: resource requests need cpu and memory, has {sorted(req)}")
            used = {m.group(1) for a in argv(c) for m in _VAR.finditer(a)}
            names = {e["name"] for e in c.get("env", [])}
            for n in sorted(names - used - KVTIER_ENV - set(ALLOWED_ENV)):
                bad.append(f"{where}: env {n} is read by nothing (not in kvtier.tier.env."
                           f"InstanceEnv, the allow-list or its command)")
            for n in sorted(used - names):
                bad.append(f"{where}: command uses $({n}), which it does not set")
        ann = w.pod["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") == "true":
            port = int(ann.get("prometheus.io/port", 0))
            if port not in w.ports().values():
                bad.append(f"{w}: prometheus.io/port {port} is not a container port")
    return bad


def _selected(docs: list[dict[str, Any]], selector: dict[str, Any]) -> list[Workload]:
    return [w for w in workloads(docs) if selects(selector, w.labels)]


def wiring_problems(docs: list[dict[str, Any]]) -> list[str]:
    bad = []
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    for name, s in services.items():
        pods = _selected(docs, s["spec"].get("selector", {}))
        if not pods:
            bad.append(f"Service/{name}: selects no pods")
        for p in s["spec"]["ports"]:
            t = p.get("targetPort", p["port"])
            for w in pods:
                if t not in w.ports() and t not in w.ports().values():
                    bad.append(f"Service/{name}: targetPort {t!r} is not a port of {w}")
    for w in workloads(docs):
        if w.kind == "StatefulSet":
            s = services.get(w.obj["spec"].get("serviceName", ""))
            if s is None or s["spec"].get("clusterIP") != "None" or w not in _selected(
                    docs, s["spec"]["selector"]):
                bad.append(f"{w}: serviceName is not a headless Service selecting its pods")
    for np in of_kind(docs, "NetworkPolicy"):
        where = f"NetworkPolicy/{np['metadata']['name']}"
        targets = _selected(docs, np["spec"]["podSelector"])
        if not targets:
            bad.append(f"{where}: selects no pods")
        for rule in np["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer \
                        and not _selected(docs, peer["podSelector"]):
                    bad.append(f"{where}: a rule's podSelector selects no pods")
            for p in rule.get("ports", []):
                for w in targets:
                    if p["port"] not in w.ports() and p["port"] not in w.ports().values():
                        bad.append(f"{where}: port {p['port']!r} is not a port of {w}")
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        pods = _selected(docs, pdb["spec"]["selector"])
        least = str(pdb["spec"].get("minAvailable", 0))
        floor = 0 if least.endswith("%") else int(least)
        if not pods or any(w.replicas <= floor for w in pods):
            bad.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: needs pods with more "
                       f"replicas than minAvailable")
    return bad


# -- kvtier's own wiring ---------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    """One engine pod as its StatefulSet makes it: name, DNS name, ports, env and argv."""

    name: str
    role: str
    host: str
    ports: dict[str, int]
    env: dict[str, str]
    argv: list[str]

    def flag(self, name: str) -> str | None:
        return self.argv[self.argv.index(name) + 1] if name in self.argv else None

    def json_flag(self, name: str) -> dict[str, Any]:
        value = self.flag(name)
        return json.loads(value) if value else {}


def engines(docs: list[dict[str, Any]]) -> list[Engine]:
    cms = config_maps(docs)
    out = []
    for w in workloads(docs):
        role = w.labels.get("llm-d.ai/role")
        if role is None:
            continue
        c = containers(w)[0]
        for pod in w.pod_names():
            env = resolved_env(w, c, pod, cms)
            out.append(Engine(pod, role, f"{pod}.{w.obj['spec']['serviceName']}", w.ports(),
                              env, expand(argv(c), env)))
    return out


def _port_of(endpoint: str | None) -> int | None:
    return int(endpoint.rsplit(":", 1)[1]) if endpoint else None


def engine_problems(e: Engine) -> list[str]:
    """One engine's connector config and KV-event config against its declared ports."""
    from kvtier.tier.config import HostTierConfig
    from kvtier.tier.params_feed import NixlKnobs, ParamsFeedConfig

    bad = []
    if e.role not in ("prefill", "decode"):
        bad.append(f"{e.name}: llm-d.ai/role {e.role!r} is not prefill or decode")
    if _port_of(f":{e.env.get(InstanceEnv.NIXL_SIDE_CHANNEL_PORT, 0)}") != e.ports.get("nixl"):
        bad.append(f"{e.name}: {InstanceEnv.NIXL_SIDE_CHANNEL_PORT} is not its port nixl")
    kv = e.json_flag("--kv-transfer-config")
    todo = [kv, *kv.get("kv_connector_extra_config", {}).get("connectors", [])]
    for conn in todo:
        extra = conn.get("kv_connector_extra_config", {})
        try:
            if conn.get("kv_connector") == "KVTierNixlConnector":
                NixlKnobs.model_validate({k: extra[k] for k in NixlKnobs.model_fields
                                          if k in extra})
                feed = ParamsFeedConfig.from_extra_config(extra).resolved(e.env)
                if e.role == "decode":
                    for port, want in ((_port_of(feed.params_feed_endpoint), "feed"),
                                       (_port_of(feed.lease_endpoint), "lease")):
                        if port != e.ports.get(want):
                            bad.append(f"{e.name}: its connector binds {want} on {port}, "
                                       f"its port {want} is {e.ports.get(want)}")
                    lease = _port_of(feed.lease_endpoint)
                    if lease is not None and lease + 1 != e.ports.get("lease-metrics"):
                        bad.append(f"{e.name}: lease metrics on {lease + 1} is not its port "
                                   f"lease-metrics")
                    if not feed.decode_lease_s:
                        bad.append(f"{e.name}: decode node without leases (decode_lease_s)")
            elif conn.get("kv_connector") == "KVTierConnector":
                HostTierConfig.from_extra_config(extra)
        except ValueError as err:
            bad.append(f"{e.name}: connector config: {err}")
    if not kv:
        bad.append(f"{e.name}: no --kv-transfer-config")
    events = e.json_flag("--kv-events-config")
    for key, want in (("endpoint", "kv-events"), ("replay_endpoint", "kv-replay")):
        if _port_of(events.get(key)) != e.ports.get(want):
            bad.append(f"{e.name}: --kv-events-config {key} is not its port {want}")
    return bad


def _daemon(docs: list[dict[str, Any]], component: str) -> tuple[Workload, dict[str, Any]] | None:
    for w in workloads(docs):
        if w.labels.get("app.kubernetes.io/component") == component:
            return w, containers(w)[0]
    return None


def _daemon_argv(docs: list[dict[str, Any]], w: Workload, c: dict[str, Any],
                 tmp: Path) -> list[str]:
    """The daemon's argv, ``--config`` pointing at its ConfigMap's file written under tmp."""
    cms = config_maps(docs)
    args = expand(argv(c), resolved_env(w, c, w.name, cms))
    i = args.index("--config") + 1
    path = Path(args[i])
    mount = next(m for m in c.get("volumeMounts", []) if Path(m["mountPath"]) == path.parent)
    vol = next(v for v in w.pod["spec"]["volumes"] if v["name"] == mount["name"])
    f = tmp / f"{w.name}-{path.name}"
    f.write_text(cms[vol["configMap"]["name"]][path.name])
    args[i] = str(f)
    return args


def _service_problems(docs: list[dict[str, Any]], url: str, component: str, what: str) -> list[str]:
    """``url`` (http:// or redis://) names a Service port that selects ``component`` pods."""
    u = urlparse(url)
    for s in of_kind(docs, "Service"):
        if s["metadata"]["name"] == u.hostname and any(p["port"] == u.port
                                                        for p in s["spec"]["ports"]):
            if any(w.labels.get("app.kubernetes.io/component") == component
                   for w in _selected(docs, s["spec"]["selector"])):
                return []
    return [f"{what} {url}: no Service port there that reaches the {component}"]


def kvtier_problems(docs: list[dict[str, Any]], tmp: Path) -> list[str]:
    from kvtier.indexer import cli as indexer_cli
    from kvtier.router import cli as router_cli

    ap = argparse.ArgumentParser(prog="kvtier")
    sub = ap.add_subparsers(dest="command")
    router_cli.register(sub)
    indexer_cli.register(sub)
    eng = engines(docs)
    bad = [p for e in eng for p in engine_problems(e)]
    if {e.role for e in eng} != {"prefill", "decode"}:
        bad.append(f"engines: need prefill and decode pods, have {sorted({e.role for e in eng})}")
    block = {e.flag("--block-size") for e in eng}
    model = {e.flag("--served-model-name") for e in eng}
    ttl = {e.json_flag("--kv-transfer-config").get("kv_connector_extra_config", {})
           .get("decoder_kv_blocks_ttl") for e in eng if e.role == "decode"}

    router = _daemon(docs, "router")
    if router is None:
        return [*bad, "no router Deployment"]
    w, c = router
    try:
        rcfg = router_cli.config_from_args(ap.parse_args(_daemon_argv(docs, w, c, tmp)[1:]))
    except (ValueError, SystemExit, StopIteration, KeyError) as err:
        return [*bad, f"router config: {err!r}"]
    want = {e.name: (e.role, f"http://{e.host}:{e.ports['http']}",
                     f"tcp://{e.host}:{e.ports['feed']}" if e.role == "decode" else None,
                     f"tcp://{e.host}:{e.ports['lease']}" if e.role == "decode" else None)
            for e in eng}
    have = {str(i.name): (i.role.value, i.url, i.params_feed, i.lease) for i in rcfg.instances}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            bad.append(f"router config: instance {name}: {have.get(name)} where the pods "
                       f"make {want.get(name)}")
    if (rcfg.host, rcfg.port) != ("0.0.0.0", w.ports().get("http")):
        bad.append(f"router config: listens on {rcfg.host}:{rcfg.port}, not 0.0.0.0:<port http>")
    if block != {str(rcfg.block_size)}:
        bad.append(f"router config: block_size {rcfg.block_size}, engines {sorted(map(str, block))}")
    if ttl != {rcfg.decode_kv_ttl_s}:
        bad.append(f"router config: decode_kv_ttl_s {rcfg.decode_kv_ttl_s}, decode nodes' "
                   f"decoder_kv_blocks_ttl {sorted(map(str, ttl))}")
    if rcfg.indexer is None:
        bad.append("router config: no indexer")
    else:
        bad += _service_problems(docs, rcfg.indexer, "indexer", "router config: indexer")
    if w.replicas > 1 and rcfg.store == "memory":
        bad.append("router config: replicas > 1 need a shared store (redis://)")
    elif rcfg.store != "memory":
        bad += _service_problems(docs, rcfg.store, "redis", "router config: store")

    indexer = _daemon(docs, "indexer")
    if indexer is None:
        return [*bad, "no indexer Deployment"]
    w, c = indexer
    try:
        icfg = indexer_cli.build_config(ap.parse_args(_daemon_argv(docs, w, c, tmp)[1:]))
    except (ValueError, SystemExit, StopIteration, KeyError) as err:
        return [*bad, f"indexer config: {err!r}"]
    iwant = {e.name: {(f"tcp://{e.host}:{e.ports['kv-events']}",
                       f"tcp://{e.host}:{e.ports['kv-replay']}")} for e in eng}
    ihave: dict[str, set[tuple[str, str | None]]] = {}
    for p in icfg.pods:
        ihave.setdefault(str(p.name), set()).add((p.events, p.replay))
    for name in sorted(set(iwant) | set(ihave)):
        if not iwant.get(name, set()) <= ihave.get(name, set()) or name not in iwant:
            bad.append(f"indexer config: pod {name}: streams {sorted(ihave.get(name, []))} "
                       f"where the pod publishes {sorted(iwant.get(name, []))}")
    models = {icfg.model_of(p) for p in icfg.pods}
    if models != model:
        bad.append(f"indexer config: model {sorted(models)}, engines serve {sorted(model)}")
    if block != {str(icfg.block_size)}:
        bad.append(f"indexer config: block_size {icfg.block_size}, engines {sorted(block)}")
    if (icfg.host, icfg.port) != ("0.0.0.0", w.ports().get("http")):
        bad.append(f"indexer config: listens on {icfg.host}:{icfg.port}, not 0.0.0.0:<port http>")
    if w.replicas > 1 and icfg.backend == "memory":
        bad.append("indexer config: replicas > 1 need a shared backend (redis://)")
    elif icfg.backend != "memory":
        bad += _service_problems(docs, icfg.backend, "redis", "indexer config: backend")
    return bad
