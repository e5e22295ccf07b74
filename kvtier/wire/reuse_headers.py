"""The router's reuse decision, as it states it on every answer (response headers).

    x-kvtier-reuse: PATH; tokens=N     PATH a ``kvtier.ids.ReusePath`` value, N the prompt
                                       tokens reused
    x-kvtier-outcome: OUTCOME          a ``kvtier.ids.Outcome`` value

The router writes them (``ReuseReport.headers``); the A/B runner reads them
(``parse_reuse_headers``) as the turn's ``reuse_path`` and ``outcome`` instead of
reverse-engineering them from the engines' wire JSON. N is what the router planned: the
engine may still compute more (a failed or partial load). Parameters after ``tokens``
that this parser does not know are ignored (a router may add some); anything else that is
missing or malformed raises ``ReuseHeaderError`` naming the header and the value.

Threading model: pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import httpx

from kvtier.ids import Outcome, ReusePath

REUSE_HEADER = "x-kvtier-reuse"
OUTCOME_HEADER = "x-kvtier-outcome"

_E = TypeVar("_E", bound=StrEnum)


class ReuseHeaderError(ValueError):
    """The router's answer lacks its reuse headers, or they do not parse."""


@dataclass(frozen=True)
class ReuseReport:
    """The router's reuse decision for one answer: the path its prefill leg took, how many
    prompt tokens that path was planned to supply, and what became of the conversation's
    retained device KV."""

    path: ReusePath = ReusePath.NONE
    tokens: int = 0
    outcome: Outcome = Outcome.NONE

    def headers(self) -> dict[str, str]:
        return {REUSE_HEADER: f"{self.path.value}; tokens={self.tokens}",
                OUTCOME_HEADER: self.outcome.value}


def parse_reuse_headers(headers: Mapping[str, str]) -> ReuseReport:
    """The decision in ``headers`` (an ``httpx.Headers`` or any mapping; names match
    case-insensitively)."""
    reuse = _one(headers, REUSE_HEADER)
    head, *params = reuse.split(";")
    path = _enum(ReusePath, head, REUSE_HEADER, reuse)
    fields: dict[str, str] = {}
    for p in params:
        key, eq, value = p.partition("=")
        if not eq or not key.strip():
            raise ReuseHeaderError(f"{REUSE_HEADER}: {reuse!r}: parameter {p.strip()!r} is not "
                                   f"key=value")
        fields[key.strip().lower()] = value.strip()
    tokens = fields.get("tokens")
    if tokens is None:
        raise ReuseHeaderError(f"{REUSE_HEADER}: {reuse!r}: no tokens=N parameter")
    # isdigit alone accepts non-ASCII digits ('²') that int() then rejects or misreads
    if not (tokens.isascii() and tokens.isdigit()):
        raise ReuseHeaderError(f"{REUSE_HEADER}: {reuse!r}: tokens={tokens!r} is not a "
                               f"non-negative integer")
    outcome_raw = _one(headers, OUTCOME_HEADER)
    outcome = _enum(Outcome, outcome_raw, OUTCOME_HEADER, outcome_raw)
    return ReuseReport(path, int(tokens), outcome)


def _one(headers: Mapping[str, str], name: str) -> str:
    if isinstance(headers, httpx.Headers):
        values = headers.get_list(name)
    else:  # not httpx.Headers(headers): that encodes values as ASCII and raises on others
        values = [v for k, v in headers.items() if k.lower() == name]
    if not values:
        raise ReuseHeaderError(f"the router's answer has no {name} header (a router older "
                               f"than this runner, or not kvtier's router?)")
    if len(values) > 1:
        raise ReuseHeaderError(f"the router's answer has {len(values)} {name} headers: "
                               f"{values!r}")
    return values[0]


def _enum(kind: type[_E], raw: str, header: str, whole: str) -> _E:
    try:
        return kind(raw.strip())
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise ReuseHeaderError(f"{header}: {whole!r}: {raw.strip()!r} is not one of "
                               f"{allowed}") from None
