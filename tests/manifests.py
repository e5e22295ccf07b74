"""Run a rendered kustomize overlay's pods as local processes, one network namespace per pod
(tests/e2e/test_deploy_cpu.py).

The rendered objects are the source of truth; what differs from a cluster is listed here:

- **Pods.** Every Deployment and StatefulSet makes ``replicas`` pods named as their controllers
  name them (``decode-0``; ``kvtier-router-<template hash>-<5 chars>``). Each pod gets a network
  namespace of its own (``tests.netns.Net``: a veth ``eth0`` on one bridge, its own address, a
  default route as a pod has), so every port is the one its manifest says. Init containers run
  first, in order, each to exit 0; then the containers. UTS namespace: the pod's hostname.
- **Images.** Not pulled (no registry here): a container's command runs with this machine's
  executables, ``PATH`` starting with the venv's ``bin`` (``python3``, ``vllm``, ``kvtier``), as
  the images' own ``PATH`` starts with theirs. A container with ``args`` only runs its image's
  entrypoint (``IMAGE_ENTRYPOINT``). The images' ``USER`` is not taken: this machine's Python
  lives under a directory only root may enter, so every process runs as root.
- **Env.** The container's ``env`` in order, ``$(NAME)`` expanded as Kubernetes does
  (``$$`` escapes), ConfigMap keys read from the rendered ConfigMaps, ``metadata.name`` the pod's
  name, ``status.podIP`` its address, a ``resourceFieldRef`` the container's request or limit
  (``requests.cpu: 1`` -> ``1``); the service-link variables Kubernetes adds for every
  Service with a cluster IP (``KVTIER_REDIS_SERVICE_HOST``, ``KVTIER_REDIS_PORT``, ...); and no
  variable of the test's own environment (a base ``PATH``, ``HOME``, ``LANG``,
  ``PYTHONUNBUFFERED`` only).
- **Volumes** are mounted where the manifest says, in each container's own mount namespace
  (``ip netns exec`` makes one; nothing propagates to this machine): a ConfigMap as a
  directory of its keys' files, an ``emptyDir`` as a directory of the pod's (shared by its
  containers), bind-mounted at ``mountPath`` (read-only where ``readOnly``); an ``emptyDir`` with
  ``medium: Memory`` as a private tmpfs of its ``sizeLimit`` (``/dev/shm``: pods share no memory).
  A mount point missing here (``/models``, ``/etc/kvtier``) is created empty and removed after.
  No path in a command, argument or env value is changed.
- **Services and DNS.** Every pod's ``/etc/hosts`` (``/etc/netns/NS/hosts``, which ``ip netns
  exec`` mounts) names each StatefulSet pod as ``POD.SERVICE`` and each Service with a cluster IP
  by the address of one of its pods (client pod i gets backend i mod n: a spread, not
  kube-proxy's per-connection balancing); a Service whose port differs from its target port
  cannot be served this way and is refused. ``resolv.conf`` names no server: a name outside
  the cluster fails at once, as no cluster DNS answers here.
- **Probes** are run by ``Cluster.probe`` from the root namespace (as the kubelet does, from the
  node): HTTP GET, TCP connect, or the exec command in the pod's namespace.
- **Processes.** Each container is a process group of its own (``stop`` signals the group), in
  the test's session: Linux schedules each session as one group (autogroup), so containers
  started as sessions of their own would each take a full share of a busy core whatever their
  threads' nice levels, and the engines' NIXL progress threads, which spin and which the test
  demotes (``kvtier.devstack.placement``), would take half of the other engine's core, as a
  cluster's CPU limits would not let them.
- **Not emulated:** NetworkPolicies (no CNI), resource requests and limits, security contexts.

Threading model: one thread (the test's) drives a ``Cluster``: ``start``, ``poll``/``wait_ready``,
``probe``, ``stop``; not thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.deploycheck import Workload, config_maps, containers, of_kind, selects, workloads
from tests.netns import Net

VENV_BIN = Path(sys.executable).parent
NAMESPACE = "default"
# What an image runs when its container gives ``args`` only (redis:7.2's entrypoint script
# execs redis-server with them).
IMAGE_ENTRYPOINT = {"redis": ["redis-server"]}
BASE_ENV = {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what Kubernetes uses in generated names
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
          "G": 10**9}


class PodFailed(RuntimeError):
    """A container exited (an init container with a nonzero status, any other at all)."""


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion: ``$(NAME)`` -> its value (left as written when unset), ``$$`` -> ``$``."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), s)


def quantity(q: str) -> int:
    """A Kubernetes quantity (``1Gi``, ``512Mi``) in bytes."""
    for unit, mult in _UNITS.items():
        if q.endswith(unit):
            return int(float(q[: -len(unit)]) * mult)
    return int(q)


def _cpu(q: str) -> float:
    """A CPU quantity (``500m``, ``1``, ``0.5``) in cores."""
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _gen(n: int, seed: str | None = None) -> str:
    raw = hashlib.sha256(seed.encode()).digest() if seed else secrets.token_bytes(n)
    return "".join(_NAME_CHARS[b % len(_NAME_CHARS)] for b in raw[:n])


@dataclass
class Pod:
    """One pod of a workload, as its controller names it."""

    name: str
    workload: Workload
    subdomain: str | None  # a StatefulSet's serviceName: the pod is POD.SUBDOMAIN
    ns: str = ""
    address: str = ""
    dir: Path = Path()
    queue: list[dict[str, Any]] = field(default_factory=list)  # containers still to start
    running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    init_running: str | None = None

    @property
    def labels(self) -> dict[str, str]:
        return self.workload.labels


def make_pods(docs: list[dict[str, Any]]) -> list[Pod]:
    pods = []
    for w in workloads(docs):
        if w.kind == "StatefulSet":
            for i in range(w.replicas):
                pods.append(Pod(f"{w.name}-{i}", w, w.obj["spec"].get("serviceName")))
        else:
            rs = f"{w.name}-{_gen(10, json.dumps(w.pod, sort_keys=True))}"
            pods += [Pod(f"{rs}-{_gen(5)}", w, None) for _ in range(w.replicas)]
    return pods


class Cluster:
    """The pods of ``docs`` in network namespaces, their files under ``root``."""

    def __init__(self, docs: list[dict[str, Any]], root: Path) -> None:
        self.docs = docs
        self.root = root
        self.cms = config_maps(docs)
        self.pods = make_pods(docs)
        self.services = list(of_kind(docs, "Service"))
        self.net: Net | None = None
        self._etc: list[Path] = []
        self._made: list[Path] = []  # mount points created here

    # -- set-up ----------------------------------------------------------------------------

    def start(self) -> None:
        """Namespaces, hosts files, volumes; then every pod's first container."""
        self.net = Net(tuple(p.name for p in self.pods))
        self.net.attach_root()
        for p in self.pods:
            p.ns, p.address = self.net.ns(p.name), self.net.addr[p.name]
            self.net.default_route(p.name)
        for i, p in enumerate(self.pods):
            etc = Path("/etc/netns") / p.ns
            etc.mkdir(parents=True, exist_ok=True)
            self._etc.append(etc)
            (etc / "hosts").write_text(self._hosts(p, i))
            (etc / "resolv.conf").write_text("# no cluster DNS here: names are in /etc/hosts\n")
            p.dir = self.root / p.name
            p.dir.mkdir(parents=True)
            (p.dir / "home").mkdir()
            p.queue = [dict(c, _init=True) for c in containers(p.workload, init=True)] + \
                containers(p.workload)
        for p in self.pods:
            self._next(p)

    def _backend(self, svc: dict[str, Any], client: int) -> Pod:
        pods = [p for p in self.pods if selects(svc["spec"].get("selector", {}), p.labels)]
        if not pods:
            raise ValueError(f"Service/{svc['metadata']['name']} selects no pods")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):
                target = pods[0].workload.ports()[target]
            if target != port["port"]:
                raise NotImplementedError(
                    f"Service/{svc['metadata']['name']}: port {port['port']} -> {target}: "
                    "a hosts-file Service cannot remap ports")
        return pods[client % len(pods)]

    def _hosts(self, pod: Pod, index: int) -> str:
        lines = ["127.0.0.1 localhost", f"{pod.address} {pod.name}"]
        for p in self.pods:
            if p.subdomain:
                fq = f"{p.name}.{p.subdomain}.{NAMESPACE}.svc.cluster.local"
                lines.append(f"{p.address} {p.name}.{p.subdomain} {fq}")
        for s in self.services:
            name = s["metadata"]["name"]
            if s["spec"].get("clusterIP") == "None":
                continue
            b = self._backend(s, index)
            lines.append(f"{b.address} {name} {name}.{NAMESPACE} "
                         f"{name}.{NAMESPACE}.svc.cluster.local")
        return "\n".join(lines) + "\n"

    def _service_links(self, index: int) -> dict[str, str]:
        """The ``{SVC}_SERVICE_HOST``/``{SVC}_PORT...`` variables of every cluster-IP Service."""
        env: dict[str, str] = {}
        for s in self.services:
            if s["spec"].get("clusterIP") == "None":
                continue
            n = s["metadata"]["name"].upper().replace("-", "_")
            host = self._backend(s, index).address
            ports = s["spec"]["ports"]
            env[f"{n}_SERVICE_HOST"] = host
            env[f"{n}_SERVICE_PORT"] = str(ports[0]["port"])
            env[f"{n}_PORT"] = f"tcp://{host}:{ports[0]['port']}"
            for p in ports:
                if "name" in p:
                    env[f"{n}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
                pre = f"{n}_PORT_{p['port']}_TCP"
                env.update({pre: f"tcp://{host}:{p['port']}", f"{pre}_PROTO": "tcp",
                            f"{pre}_PORT": str(p["port"]), f"{pre}_ADDR": host})
        return env

    # -- containers ------------------------------------------------------------------------

    def _env(self, pod: Pod, c: dict[str, Any]) -> dict[str, str]:
        env = {**BASE_ENV, "HOME": str(pod.dir / "home"), "HOSTNAME": pod.name,
               **self._service_links(self.pods.index(pod))}
        for e in c.get("env", []):
            src = e.get("valueFrom")
            if src is None:
                env[e["name"]] = expand(str(e.get("value", "")), env)
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                env[e["name"]] = self.cms[ref["name"]][ref["key"]]
            elif "fieldRef" in src:
                path = src["fieldRef"]["fieldPath"]
                fields = {"metadata.name": pod.name, "status.podIP": pod.address,
                          "metadata.namespace": NAMESPACE}
                env[e["name"]] = fields[path]
            elif "resourceFieldRef" in src:
                env[e["name"]] = self._resource(pod, c, src["resourceFieldRef"])
            else:
                raise NotImplementedError(f"{pod.name}: env {e['name']}: {src}")
        return env

    def _resource(self, pod: Pod, c: dict[str, Any], ref: dict[str, Any]) -> str:
        """A ``resourceFieldRef``: the named container's request or limit in units of its
        ``divisor``, rounded up as the kubelet does (``requests.cpu: 1`` -> ``"1"``)."""
        name = ref.get("containerName", c["name"])
        target = next(x for x in containers(pod.workload) if x["name"] == name)
        kind, _, res = ref["resource"].partition(".")
        have = target.get("resources", {}).get(kind, {}).get(res)
        if have is None:
            raise NotImplementedError(f"{pod.name}: {ref['resource']} of {name} is not set")
        amount = quantity(str(have)) if res != "cpu" else _cpu(str(have))
        div = str(ref.get("divisor", "1"))
        return str(math.ceil(amount / (quantity(div) if res != "cpu" else _cpu(div))))

    def _volumes(self, pod: Pod, c: dict[str, Any]) -> list[str]:
        """Shell lines mounting the container's volumes in its own mount namespace."""
        vols = {v["name"]: v for v in pod.workload.pod["spec"].get("volumes", [])}
        lines: list[str] = []
        for m in c.get("volumeMounts", []):
            v, path = vols[m["name"]], m["mountPath"]
            empty = v.get("emptyDir")
            if empty is not None and empty.get("medium") == "Memory":
                size = quantity(str(empty.get("sizeLimit", "64Mi")))
                self._mountpoint(Path(path))
                lines.append(f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(path)}")
                continue
            d = pod.dir / "volumes" / m["name"]
            if not d.exists():
                d.mkdir(parents=True)
                if "configMap" in v:
                    for key, text in self.cms[v["configMap"]["name"]].items():
                        (d / key).write_text(text)
                elif empty is None:
                    raise NotImplementedError(f"{pod.name}: volume {m['name']}: {v}")
            self._mountpoint(Path(path))
            lines.append(f"mount --bind {shlex.quote(str(d))} {shlex.quote(path)}")
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {shlex.quote(path)}")
        return lines

    def _mountpoint(self, path: Path) -> None:
        """Make ``path`` exist here (an empty directory, removed by ``stop``)."""
        missing = [d for d in (path, *path.parents) if not d.exists()]
        for d in reversed(missing):
            d.mkdir()
            self._made.append(d)

    def argv(self, pod: Pod, c: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """The container's command line and environment, as run here (before the wrapper)."""
        env = self._env(pod, c)
        image = str(c["image"]).rsplit("/", 1)[-1].split(":")[0].split("@")[0]
        cmd = c.get("command") or IMAGE_ENTRYPOINT[image]
        return [expand(a, env) for a in [*cmd, *c.get("args", [])]], env

    def _next(self, pod: Pod) -> None:
        if not pod.queue:
            return
        c = pod.queue.pop(0)
        argv, env = self.argv(pod, c)
        mounts = self._volumes(pod, c)
        script = " && ".join([f"hostname {shlex.quote(pod.name)}", *mounts, 'exec "$@"'])
        wrapped = ["ip", "netns", "exec", pod.ns, "unshare", "--uts", "sh", "-c", script, "sh",
                   *argv]
        log = (pod.dir / f"{c['name']}.log").open("wb")
        (pod.dir / f"{c['name']}.argv").write_text(json.dumps(argv, indent=1))
        proc = subprocess.Popen(wrapped, cwd=pod.dir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                process_group=0)
        log.close()
        pod.running[c["name"]] = proc
        if c.get("_init"):
            pod.init_running = c["name"]
        else:
            pod.init_running = None
            self._next(pod)  # the pod's other containers start together

    def poll(self) -> None:
        """Start containers whose init containers finished; PodFailed when one exited."""
        for p in self.pods:
            for name, proc in list(p.running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                if name == p.init_running and rc == 0:
                    p.init_running = None
                    self._next(p)
                elif name == p.init_running or not self._was_init(p, name):
                    raise PodFailed(f"{p.name}/{name} exited {rc}:\n{self.log_tail(p, name)}")

    def _was_init(self, pod: Pod, name: str) -> bool:
        return name in {c["name"] for c in containers(pod.workload, init=True)}

    def log_tail(self, pod: Pod, name: str, chars: int = 3000) -> str:
        f = pod.dir / f"{name}.log"
        return f.read_text(errors="replace")[-chars:] if f.exists() else ""

    # -- probes ----------------------------------------------------------------------------

    def probe(self, pod: Pod, c: dict[str, Any], kind: str) -> bool:
        """Whether the container's ``kind`` probe (``readinessProbe``, ...) succeeds now."""
        pr = c[kind]
        timeout = float(pr.get("timeoutSeconds", 1))
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
        try:
            if "httpGet" in pr:
                g = pr["httpGet"]
                port = ports.get(g["port"], g["port"])
                with httpx.Client(trust_env=False) as http:
                    r = http.get(f"http://{pod.address}:{port}{g.get('path', '/')}",
                                 timeout=timeout)
                return 200 <= r.status_code < 400
            if "tcpSocket" in pr:
                port = ports.get(pr["tcpSocket"]["port"], pr["tcpSocket"]["port"])
                with socket.create_connection((pod.address, int(port)), timeout=timeout):
                    return True
            if "exec" in pr:
                r2 = subprocess.run(["ip", "netns", "exec", pod.ns, *pr["exec"]["command"]],
                                    env={**BASE_ENV}, capture_output=True, timeout=timeout)
                return r2.returncode == 0
        except (httpx.HTTPError, OSError, subprocess.TimeoutExpired):
            return False
        raise NotImplementedError(f"{pod.name}: probe {pr}")

    def probe_fails(self, pod: Pod, c: dict[str, Any], kind: str) -> bool:
        """Whether the container's ``kind`` probe fails as the kubelet counts a failure: its
        ``failureThreshold`` (default 3) attempts in a row, ``periodSeconds`` (default 10)
        apart, all fail. One slow attempt (an exec probe's process start past its 1 s
        ``timeoutSeconds`` on a loaded machine) does not make a pod unready or restart it."""
        pr = c[kind]
        attempts = int(pr.get("failureThreshold", 3))
        for i in range(attempts):
            if self.probe(pod, c, kind):
                return False
            if i + 1 < attempts:
                time.sleep(float(pr.get("periodSeconds", 10)))
        return True

    def ready(self, pod: Pod) -> bool:
        if pod.init_running is not None or pod.queue:
            return False
        return all(self.probe(pod, c, "readinessProbe") for c in containers(pod.workload)
                   if "readinessProbe" in c)

    def wait_ready(self, timeout_s: float) -> float:
        """Poll until every pod is ready (its readiness probes answer); seconds taken."""
        t0 = time.monotonic()
        waiting = list(self.pods)
        while waiting:
            self.poll()
            waiting = [p for p in waiting if not self.ready(p)]
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: "
                                   f"{[p.name for p in waiting]}\n" + "\n".join(
                                       f"--- {p.name}/{n}\n{self.log_tail(p, n, 1500)}"
                                       for p in waiting for n in p.running))
            time.sleep(1.0)
        return time.monotonic() - t0

    def of(self, component: str) -> list[Pod]:
        """Pods whose component (``router``, ``engine``, ...) or llm-d role is ``component``."""
        return [p for p in self.pods if p.labels.get("app.kubernetes.io/component") == component
                or p.labels.get("llm-d.ai/role") == component]

    def url(self, pod: Pod, port: str = "http") -> str:
        return f"http://{pod.address}:{pod.workload.ports()[port]}"

    # -- tear-down -------------------------------------------------------------------------

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to every process group, SIGKILL after ``grace_s``; namespaces removed."""
        procs = [proc for p in self.pods for proc in p.running.values() if proc.poll() is None]
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            _signal(proc, signal.SIGKILL)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self.net is not None:
            self.net.close()
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        for d in reversed(self._made):
            try:
                d.rmdir()  # empty here: the volumes were mounted only in the pods
            except OSError:
                pass


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
