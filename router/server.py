"""Run a router app in a background thread (tests, demo, A/B harness).

    with RouterServer(config) as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="x")...

The thread, the uvicorn server and the start/stop protocol are the shared
``kvtier.runtime.ServerThread``; this only builds the app and picks the port.

Threading model: uvicorn runs its own event loop in one daemon thread; the
caller only reads ``url`` and ``app`` and calls ``stop()`` (idempotent).
"""

from __future__ import annotations

from typing import Self

import httpx
from fastapi import FastAPI
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router

from kvtier.runtime import ServerThread, free_ports

# The CLI's default port: an in-process router is never meant to take it.
_DEFAULT_PORT = 8000


class RouterServer:
    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None,
                 health_checks: bool = True) -> None:
        port = config.port
        if port in (0, _DEFAULT_PORT):
            port = free_ports(1)[0]
        # The app is built with the port it will really serve on.
        self.config = config.model_copy(update={"port": port})
        self.app: FastAPI = create_app(self.config, transport=transport,
                                       health_checks=health_checks)
        self._thread = ServerThread(self.app, self.config.host, port, name="kvtier-router")

    @property
    def url(self) -> str:
        return self._thread.url

    @property
    def router(self) -> Router:
        router: Router = self.app.state.router
        return router

    def start(self, timeout_s: float = 30.0) -> Self:
        self._thread.start(timeout_s)
        return self

    def stop(self) -> None:
        self._thread.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
