"""Which e2e failures may run once more (tests/conftest.py applies it).

A rerun is allowed only for a failure whose cause lies outside the router, on a machine
shared with other jobs:

1. a stack that did not start (``StackStartError``: an engine exited, logged a fatal line or
   never became ready);
2. a port already taken (``OSError`` ``EADDRINUSE``: a free port picked, then bound by
   someone else first);
3. a connection refused by an engine (``httpx.ConnectError`` whose request went to one of
   the running stack's engines, not to a router).

Everything else fails the run: a check (``AssertionError``), pytest-timeout, and every
timeout, broken connection or HTTP error status from a router (the class of the stalls a
rerun once hid) or from anything that is not an engine of the stack (an indexer, a
subprocess router). Engine timeouts and 5xx fail it too: kvtier's connectors run inside the
engines. The exception is read with its ``__cause__`` chain (``raise ... from``), never its
``__context__`` (an exception raised while handling another is not caused by it).
"""

from __future__ import annotations

import errno
from collections.abc import Collection, Iterator

import httpx

from kvtier.devstack.stack import StackStartError


def rerun_allowed(error: BaseException | None, engine_urls: Collection[str]) -> bool:
    """Whether a test that failed with ``error`` may run once more; ``engine_urls``: the
    base URLs of the running stack's engines."""
    if error is None or isinstance(error, AssertionError):
        return False
    engines = {_origin(u) for u in engine_urls}
    return any(_outside_router(e, engines) for e in _causes(error))


def _outside_router(e: BaseException, engines: set[tuple[str, int | None]]) -> bool:
    if isinstance(e, StackStartError):
        return True
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return True
    if isinstance(e, httpx.ConnectError):
        try:
            url = e.request.url
        except RuntimeError:  # raised without a request: nobody can say where it went
            return False
        return _origin(url) in engines
    return False


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__


def _origin(url: str | httpx.URL) -> tuple[str, int | None]:
    u = httpx.URL(url)
    host = "127.0.0.1" if u.host == "localhost" else u.host
    return host, u.port
