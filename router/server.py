"""Run a router app in a background thread (tests, demo, A/B harness).

    with RouterServer(config) as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="x")...

Threading model: uvicorn runs its own event loop in one daemon thread; the
caller only reads ``url`` and ``app`` and calls ``stop()`` (idempotent).
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig


class RouterServer:
    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None,
                 health_checks: bool = True):
        port = config.port
        if port == 0 or port == 8000:
            s = socket.socket()
            s.bind((config.host, 0))
            port = s.getsockname()[1]
            s.close()
        self.config = config.model_copy(update={"port": port})
        self.app = create_app(self.config, transport=transport, health_checks=health_checks)
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, host=self.config.host, port=port, log_level="warning",
            access_log=False, lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, name="kvtier-router",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def router(self):
        return self.app.state.router

    def start(self, timeout_s: float = 30.0) -> "RouterServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("router server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def __enter__(self) -> "RouterServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
