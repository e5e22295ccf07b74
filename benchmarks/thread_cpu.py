"""CPU time of every thread of a local stack's processes, sampled from /proc while it runs.

Why: tiered-adaptive's turns were slower than host-p2p's on the same reuse path only while
turns overlapped (``benchmarks/AB.md``, "Why, on the current code"), not in one engine alone
or with one conversation at a time. This shows where the two cores went meanwhile: per
thread, the CPU seconds its ``utime + stime`` grew by while sampled, with its role (the vLLM
instance it belongs to, by the ``kv@NAME`` topic of its API server's command line; the
router, the indexer or the A/B harness), its process and thread names and its nice level
(``kvtier.devstack.placement`` moves NIXL's spinning progress thread to nice 10).

    .venv/bin/python benchmarks/thread_cpu.py sample OUT.json &   # SIGTERM ends it
    .venv/bin/kvtier ab ... --strategies host-p2p --repeats 1 ...; kill %1
    .venv/bin/python benchmarks/thread_cpu.py table A.json B.json  # the README's table

A thread's CPU before its first sample is not counted (sampled every second), nor are
threads that live under a second. Linux only.

Threading model: a single-threaded script.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
ROLES = ("prefill-0", "prefill-1", "decode-0", "decode-1")


def _procs() -> dict[int, tuple[int, str]]:
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
            st = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        out[int(p)] = (int(st.rsplit(")", 1)[1].split()[1]), cmd)
    return out


def _role(pid: int, ps: dict[int, tuple[int, str]]) -> str | None:
    for _ in range(6):
        if pid not in ps:
            return None
        cmd = ps[pid][1]
        if "api_server" in cmd or "vllm serve" in cmd:
            return next((r for r in ROLES if f"kv@{r}" in cmd), "engine")
        if "kvtier" in cmd and "router" in cmd:
            return "router"
        if "kvtier" in cmd and "indexer" in cmd:
            return "indexer"
        if "kvtier" in cmd and " ab " in cmd:
            return "harness"
        pid = ps[pid][0]
    return None


def threads(pid: int) -> dict[int, tuple[str, int, float]]:
    """Thread id -> (name, nice, CPU seconds so far: ``utime + stime``) of every thread of
    ``pid`` alive now ({} for a process gone)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            f = Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
        except OSError:
            continue
        out[int(t)] = (comm, int(f[16]), (int(f[11]) + int(f[12])) / HZ)
    return out


def sample(out: Path, interval_s: float = 1.0) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    last: dict[tuple[int, int], float] = {}
    tot: dict[str, float] = collections.defaultdict(float)
    t0 = time.time()
    while not stop:
        ps = _procs()
        for pid in ps:
            role = _role(pid, ps)
            if role is None:
                continue
            for t, (comm, nice, cpu) in threads(pid).items():
                key = (pid, t)
                d = cpu - last[key] if key in last else 0.0
                last[key] = cpu
                parts = ps[pid][1].split()
                pname = parts[0].rsplit("/", 1)[-1][:20] if parts else "?"
                tot[f"{role}|{pname}|{comm}|tid{t}|nice{nice}"] += d
        time.sleep(interval_s)
    out.write_text(json.dumps({"seconds": time.time() - t0,
                               "cpu_s": dict(sorted(tot.items(), key=lambda x: -x[1]))},
                              indent=1))


def per_thread(doc: dict) -> list[tuple[float, str, str, str]]:
    """(CPU s, role, thread id, names and nice levels seen), busiest first."""
    cpu: dict[tuple[str, str], float] = collections.defaultdict(float)
    names: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for k, v in doc["cpu_s"].items():
        role, pname, comm, tid, nice = k.split("|")[:5]
        cpu[(role, tid)] += v
        names[(role, tid)].add(f"{comm} ({nice.removeprefix('nice')})")
    return sorted(((v, r, t, ", ".join(sorted(names[(r, t)]))) for (r, t), v in cpu.items()),
                  reverse=True)


def table(paths: list[Path], top: int = 10) -> str:
    lines = []
    for p in paths:
        doc = json.loads(p.read_text())
        rows = per_thread(doc)
        lines += [f"`{p.name}`: {doc['seconds']:.1f} s sampled, {sum(r[0] for r in rows):.1f} "
                  "CPU s in all", "", "| CPU s | role | thread | names (nice) |",
                  "|---|---|---|---|"]
        lines += [f"| {v:.1f} | {r} | {t} | {n} |" for v, r, t, n in rows[:top]]
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("out")
    t = sub.add_parser("table")
    t.add_argument("json", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "sample":
        sample(Path(a.out))
    else:
        print(table([Path(x) for x in a.json]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
