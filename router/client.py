"""A small multi-turn client for the router (demo, A/B harness, tests).

``Conversation`` keeps the turn history as TOKEN IDS and talks to the router's
``/v1/completions`` with a token-list prompt and ``return_token_ids``: every
turn's prompt is exactly ``previous prompt + generated ids + new ids``, so the
router proves the full prefix and the decode node's KV is reused in full
(re-tokenizing decoded text would give different ids; see store.py).
``ChatConversation`` does the same over ``/v1/chat/completions`` with message
history (the router then reuses the proven prefix only).

Threading model: one conversation per thread; each holds its own httpx.Client.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import httpx


def _router_client(base_url: str, api_key: str | None, timeout_s: float,
                   headers: dict[str, str] | None = None) -> httpx.Client:
    h = {"authorization": f"Bearer {api_key}"} if api_key else {}
    h.update(headers or {})
    return httpx.Client(base_url=base_url.rstrip("/"), headers=h, timeout=timeout_s)


@dataclass
class Turn:
    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    usage: dict


@dataclass
class Conversation:
    base_url: str
    model: str
    conversation_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    api_key: str | None = None
    max_tokens: int = 64
    timeout_s: float = 300.0
    history: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._http = _router_client(self.base_url, self.api_key, self.timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, new_ids: Sequence[int], max_tokens: int | None = None,
             **extra: Any) -> Turn:
        """Append ``new_ids`` to the history and run one turn."""
        prompt = [*self.history, *new_ids]
        body = {"model": self.model, "prompt": prompt, "temperature": 0,
                "max_tokens": max_tokens or self.max_tokens, "return_token_ids": True,
                "conversation_id": self.conversation_id, **extra}
        r = self._http.post("/v1/completions", json=body)
        r.raise_for_status()
        out = r.json()
        ch = out["choices"][0]
        turn = Turn(ch["text"], prompt, list(ch.get("token_ids") or []), ch.get("finish_reason"),
                    out.get("usage") or {})
        self.history = [*prompt, *turn.token_ids]
        self.turns.append(turn)
        return turn


@dataclass
class ChatConversation:
    base_url: str
    model: str
    conversation_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    api_key: str | None = None
    max_tokens: int = 64
    timeout_s: float = 300.0
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._http = _router_client(self.base_url, self.api_key, self.timeout_s,
                                    {"x-conversation-id": self.conversation_id})

    def close(self) -> None:
        self._http.close()

    def say(self, content: str, role: str = "user", **extra: Any) -> str:
        self.messages.append({"role": role, "content": content})
        body = {"model": self.model, "messages": self.messages, "temperature": 0,
                "max_tokens": self.max_tokens, **extra}
        r = self._http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        text = r.json()["choices"][0]["message"]["content"] or ""
        self.messages.append({"role": "assistant", "content": text})
        return text
