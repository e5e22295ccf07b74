"""Client helpers shared by probe_peer.py and probe_pd.py (GPU serve benchmarks).

TTFT here = time from sending a streaming completion until its first chunk arrives
(HTTP included), with ``max_tokens`` > 1 so the same request also yields the greedy
tokens compared across paths. Servers are watched: every call first checks that the
server processes (``SERVER_PIDS``) are alive, and no call waits past the deadline."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any

import httpx


class Dead(RuntimeError):
    pass


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


class Client:
    def __init__(self, deadline: float, model: str = "m8b"):
        self.deadline = deadline
        self.model = model
        self.pids = [int(x) for x in os.environ.get("SERVER_PIDS", "").split(",") if x]
        self.c = httpx.Client(timeout=120)

    def left(self) -> float:
        return self.deadline - time.time()

    def alive(self) -> None:
        for p in self.pids:
            try:
                os.kill(p, 0)
            except OSError:
                raise Dead(f"server process {p} exited") from None

    def _timeout(self) -> float:
        self.alive()
        t = min(120.0, self.left())
        if t <= 1:
            raise TimeoutError("deadline reached")
        return t

    def wait_health(self, urls: list[str]) -> float:
        t0 = time.time()
        while self.left() > 0:
            self.alive()
            ok = 0
            for u in urls:
                try:
                    ok += self.c.get(f"{u}/health", timeout=2).status_code == 200
                except httpx.HTTPError:  # not listening yet
                    pass
            if ok == len(urls):
                log(f"all healthy after {time.time() - t0:.1f}s")
                return time.time() - t0
            time.sleep(1)
        raise TimeoutError("servers not healthy before the deadline")

    def body(self, prompt: list[int], n: int, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                "return_token_ids": True, **{k: v for k, v in extra.items() if v is not None}}

    def complete(self, url: str, prompt: list[int], n: int, **extra: Any) -> tuple[float, dict]:
        """Non-streaming completion: (wall seconds, response json)."""
        t = time.perf_counter()
        r = self.c.post(f"{url}/v1/completions", json=self.body(prompt, n, **extra),
                        timeout=self._timeout())
        dt = time.perf_counter() - t
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code} from {url}: {r.text[:400]}")
        return dt, r.json()

    def stream(self, url: str, prompt: list[int], n: int, **extra: Any
               ) -> tuple[float, float, list[int]]:
        """Streaming completion: (TTFT s, total s, generated token ids)."""
        body = self.body(prompt, n, stream=True, **extra)
        t = time.perf_counter()
        ttft = None
        toks: list[int] = []
        with self.c.stream("POST", f"{url}/v1/completions", json=body,
                           timeout=self._timeout()) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code} from {url}: {r.text[:400]}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if ttft is None:
                    ttft = time.perf_counter() - t
                ch = (json.loads(data).get("choices") or [{}])[0]
                toks.extend(ch.get("token_ids") or [])
        total = time.perf_counter() - t
        return (ttft if ttft is not None else total), total, toks

    def post(self, url: str, path: str) -> None:
        r = self.c.post(f"{url}{path}", timeout=self._timeout())
        r.raise_for_status()

    def reset_prefix_cache(self, url: str, tries: int = 20) -> int:
        """``/reset_prefix_cache`` until it reports success; returns the tries it took
        (0: refused every time; the measurement after it is then marked).
        vLLM refuses the reset (``{"success": false}``, HTTP 200) while blocks are held, e.g.
        by a finished request whose connector store or NIXL send is still pending; those
        are released at the engine's next steps, which a 4-token request (no whole block:
        nothing stored) makes it take."""
        for i in range(1, tries + 1):
            r = self.c.post(f"{url}/reset_prefix_cache", timeout=self._timeout())
            r.raise_for_status()
            try:
                ok = bool(r.json().get("success", True))
            except ValueError:  # an older server answers with no JSON body
                ok = True
            if ok:
                return i
            self.complete(url, [11, 12, 13, 14], 1)
            time.sleep(0.2)
        log(f"{url}: prefix cache reset refused {tries} times")
        return 0

    def scrape(self, url: str) -> str:
        try:
            return self.c.get(f"{url}/metrics", timeout=10).text
        except httpx.HTTPError as e:
            return f"#ERR {e!r}"


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    tot = 0.0
    for line in text.splitlines():
        m = re.match(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "")
                                            for k, v in labels.items()):
            tot += float(m.group(3))
    return tot


def metric_lines(text: str, prefix: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


def median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


def main_guard(fn) -> None:
    """Run ``fn``; a dead server or the deadline ends the probe with what it has."""
    try:
        fn()
    except Dead as e:
        log(f"STOP: {e}")
        sys.exit(3)
    except TimeoutError as e:
        log(f"STOP: {e}")
        sys.exit(4)
