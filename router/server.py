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
from kvtier.runtime import ServerThread, listen, listen_on_free_port

# The CLI's default port: an in-process router is never meant to take it.
_DEFAULT_PORT = 8000


class RouterServer:
    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None,
                 health_checks: bool = True) -> None:
        # The port is bound before the app is built (which can take a while), so nothing
        # else can take it meanwhile, and the app is built with the port it serves on.
        if config.port in (0, _DEFAULT_PORT):
            sock = listen_on_free_port(config.host)
        else:
            sock = listen(config.host, config.port)
        port = sock.getsockname()[1]
        self.config = config.model_copy(update={"port": port})
        try:
            self.app: FastAPI = create_app(self.config, transport=transport,
                                           health_checks=health_checks)
        except BaseException:
            sock.close()
            raise
        self._thread = ServerThread(self.app, self.config.host, name="kvtier-router", sock=sock,
                                    keepalive_s=self.config.client_keepalive_s)

    @property
    def url(self) -> str:
        return self._thread.url

    @property
    def router(self) -> Router:
        router: Router = self.app.state.router
        return router

    def start(self, timeout_s: float = 60.0) -> Self:
        self._thread.start(timeout_s)
        return self

    def stop(self) -> None:
        self._thread.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
