"""Where ``kvtier router`` spends its CPU at 128 streams, at its defaults, on the fakes of
``bench_router.py`` (py-spy, sampling the router process from outside).

    .venv/bin/python benchmarks/bench_router_profile.py --py-spy PATH/py-spy \\
        --label NAME --out benchmarks/router-profile-DATE.json [--seconds 15]

Starts the same fakes and router as ``bench_router.py`` (router on core 0, the rest on core
1), warms it for 2 s of 128 streams, then records ``py-spy record --rate 250 --nonblocking
--format raw`` while the load runs, and adds to ``--out`` (a JSON of labelled profiles) the
run's requests, CPU per request, and the samples by the module of the frame they were in
(``leaf``) and by function (``self``, the top 30). py-spy is not a dependency: install it
where you like (``pip install py-spy`` into a venv of its own) and name it.

Threading model: one process; the load runs in ``asyncio.run``, py-spy in a child.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench_router_fleet import Fleet
from bench_router_load import CHAT, measured

_LIBS = ("aiohttp", "aiohappyeyeballs", "yarl", "multidict", "uvicorn", "starlette", "fastapi",
         "pydantic", "json", "logging", "zmq", "asyncio", "cachetools", "numpy",
         "prometheus_client", "threading", "httptools", "uuid", "random", "contextlib", "enum",
         "_weakrefset")


def module_of(frame: str) -> str:
    """``func (path:line)`` -> the library, or the repository file, it belongs to."""
    m = re.search(r"\(([^:]+):\d+\)$", frame)
    f = m.group(1) if m else frame
    for lib in _LIBS:
        if f.startswith(lib):
            return lib
    return f if f.startswith(("router/", "kvtier/")) else "other"


def summarize(raw: Path, top: int = 30) -> dict:
    leaf: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        last = stack.split(";")[-1]
        leaf[module_of(last)] += int(n)
        own[last] += int(n)
    pct = {k: round(100 * v / total, 1) for k, v in leaf.most_common()}
    return {"samples": total, "leaf_pct": pct,
            "self_pct": {k: round(100 * v / total, 1) for k, v in own.most_common(top)}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--py-spy", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--tmp", default="/tmp/kvtier-bench-router-profile")
    a = ap.parse_args()
    tmp = Path(a.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {1})
    fleet = Fleet(tmp, "0", "1")
    try:
        p, d = fleet.pair("")
        pr, url = fleet.kvtier("kvtier", p, d)
        url += "/v1/chat/completions"
        measured(url, CHAT, 128, 2, pr.pid)  # warm: connections, caches
        raw = tmp / "profile.txt"
        spy = subprocess.Popen([a.py_spy, "record", "--pid", str(pr.pid), "--rate", "250",
                                "--nonblocking", "--format", "raw", "-o", str(raw),
                                "--duration", str(int(a.seconds))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        load = measured(url, CHAT, 128, a.seconds, pr.pid)
        spy.wait()
    finally:
        fleet.close()
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc[a.label] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "loadavg": os.getloadavg(), "argv": sys.argv, "load": load,
                    **summarize(raw)}
    out.write_text(json.dumps(doc, indent=2))
    print(json.dumps({a.label: {k: v for k, v in doc[a.label].items() if k != "self_pct"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
