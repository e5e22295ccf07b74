"""The e2e rerun rule (tests/reruns.py): one case per class of failure."""

from __future__ import annotations

import errno

import httpx
import pytest

from kvtier.devstack.stack import StackStartError
from tests.reruns import rerun_allowed

ENGINE = "http://127.0.0.1:8101"
ROUTER = "http://127.0.0.1:9100"
ENGINES = [ENGINE, "http://127.0.0.1:8102"]


def _req(url: str) -> httpx.Request:
    return httpx.Request("POST", url + "/v1/completions")


def _status(url: str, code: int) -> httpx.HTTPStatusError:
    req = _req(url)
    return httpx.HTTPStatusError(f"{code}", request=req, response=httpx.Response(code,
                                                                                request=req))


def _caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def _in_context(outer: BaseException, context: BaseException) -> BaseException:
    outer.__context__ = context
    return outer


ALLOWED = {
    "stack did not start": StackStartError("prefill-0 exited with code 1 during startup"),
    "port taken": OSError(errno.EADDRINUSE, "Address already in use"),
    "port taken, wrapped": _caused(RuntimeError("router did not start"),
                                   OSError(errno.EADDRINUSE, "Address already in use")),
    "engine refused": httpx.ConnectError("refused", request=_req(ENGINE)),
    "engine refused, as localhost": httpx.ConnectError(
        "refused", request=_req("http://localhost:8101")),
}

REFUSED = {
    "no exception": None,
    "a check": AssertionError("differs from single-instance recompute"),
    "pytest-timeout": pytest.fail.Exception("Timeout (>900.0s) from pytest-timeout."),
    "router read timeout": httpx.ReadTimeout("timed out", request=_req(ROUTER)),
    "router 5xx": _status(ROUTER, 502),
    "router refused": httpx.ConnectError("refused", request=_req(ROUTER)),
    "router broke the connection": httpx.RemoteProtocolError("closed", request=_req(ROUTER)),
    "engine read timeout": httpx.ReadTimeout("timed out", request=_req(ENGINE)),
    "engine 5xx": _status(ENGINE, 500),
    "connect error without a request": httpx.ConnectError("refused"),
    "another OSError": OSError(errno.ECONNRESET, "reset"),
    "router timeout while handling an engine refusal": _in_context(
        httpx.ReadTimeout("timed out", request=_req(ROUTER)),
        httpx.ConnectError("refused", request=_req(ENGINE))),
    "a check caused by a port taken": _caused(AssertionError("x"),
                                              OSError(errno.EADDRINUSE, "in use")),
}


@pytest.mark.parametrize("error", ALLOWED.values(), ids=ALLOWED.keys())
def test_a_cause_outside_the_router_may_run_again(error: BaseException) -> None:
    assert rerun_allowed(error, ENGINES)


@pytest.mark.parametrize("error", REFUSED.values(), ids=REFUSED.keys())
def test_anything_else_fails_the_run(error: BaseException | None) -> None:
    assert not rerun_allowed(error, ENGINES)


def test_an_engine_refusal_counts_only_for_the_running_stack() -> None:
    assert not rerun_allowed(httpx.ConnectError("refused", request=_req(ENGINE)), [])
