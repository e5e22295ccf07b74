"""Agentic multi-turn traces: what the A/B harness replays, identically, under every strategy.

A conversation is a sequence of turns. Turn 0 sends the system + user prompt ``H``
(``new_tokens``) and asks for ``R`` tokens (``response_tokens``). Every later turn
waits ``wait_s`` (the tool runs), optionally strips the first ``strip_reasoning``
tokens of the previous response from the history (the reasoning part, which
precedes the answer), and appends ``T`` new tokens (the tool output). So the
prompt of turn ``i`` is::

    prompt_i = prompt_{i-1} + response_{i-1}[strip_reasoning_i:] + new_tokens_i

and the *proven prefix* (tokens that are bit-identical to what some instance
already holds KV for) is ``prompt_{i-1} + response_{i-1}`` when nothing is
stripped, or only ``prompt_{i-1}`` when reasoning is stripped. `turn_plan`
computes these numbers so the simulator and the live runner agree on them.

Token contents do not matter to KV timing, so a trace stores counts only; the
ids of each turn's new tokens come from `token_ids`, deterministic in the
conversation's seed. A trace is a file (`Trace.save` / `Trace.load`), so A and B
see identical work.

File format (JSONL, UTF-8)
--------------------------
Native trace, written by `Trace.save`::

    {"kind": "kvtier-trace", "version": 1, "name": "...", "vocab_size": 4096}
    {"conversation_id": "c0", "start_s": 0.0, "seed": 17,
     "turns": [{"new_tokens": 512, "response_tokens": 64, "wait_s": 0.0, "strip_reasoning": 0}, ...]}
    ...

Recorded trace, accepted by `Trace.load` (e.g. exported from production logs).
The header line is optional; without it the name is the file stem and
``vocab_size`` defaults to `DEFAULT_VOCAB_SIZE`::

    {"kind": "kvtier-recorded-trace", "name": "prod-0412", "vocab_size": 32000}
    {"conversation_id": "abc", "turns": [
        {"t": 1712900000.0, "done_t": 1712900001.2, "new_tokens": 812, "response_tokens": 120},
        {"t": 1712900004.5, "new_token_ids": [5, 9, ...],
         "response_tokens": 80, "strip_reasoning": 40}]}

- ``t``: wall-clock time (seconds, any epoch) the turn was sent.
- ``new_tokens`` or ``new_token_ids`` (only its length is kept: content does not
  change KV timing, and replay uses `token_ids`).
- ``response_tokens``: tokens generated (replayed as ``max_tokens``).
- ``done_t`` (optional): when this turn's response finished. The next turn's
  ``wait_s = t_{i+1} - done_t_i`` when present, else
  ``t_{i+1} - t_i`` (an upper bound on the tool wait: it includes serving time).
- ``strip_reasoning`` (optional, default 0).

Conversations start at ``t_0 - min(t_0 over all conversations)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtier.ids import ConversationId

TRACE_KIND = "kvtier-trace"
RECORDED_KIND = "kvtier-recorded-trace"
TRACE_VERSION = 1
DEFAULT_VOCAB_SIZE = 4096  # the `tiny` and smallest presets in kvtier.devstack.models
# Ids below this are left alone: tokenizers keep their special tokens there.
FIRST_PLAIN_TOKEN_ID = 16


class TurnSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One turn. See the module docstring for how turns build the prompt."""

    new_tokens: int  # T: tool output appended this turn (turn 0: the system+user prompt H)
    response_tokens: int  # R: max_tokens for this turn
    wait_s: float  # tool wait before this turn is sent (0 for turn 0)
    strip_reasoning: int = 0  # first tokens of the previous response removed from history


class ConversationSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    conversation_id: ConversationId
    start_s: float  # when turn 0 is sent, seconds since the run starts
    seed: int  # seeds `token_ids` for this conversation
    turns: list[TurnSpec]


class _Header(msgspec.Struct, frozen=True):
    kind: str
    version: int = TRACE_VERSION
    name: str = ""
    vocab_size: int = DEFAULT_VOCAB_SIZE


class Trace(msgspec.Struct, frozen=True):
    name: str
    vocab_size: int
    conversations: list[ConversationSpec]

    def save(self, path: str | Path) -> None:
        """Write the native JSONL format (header + one conversation per line)."""
        enc = msgspec.json.Encoder()
        with open(path, "wb") as f:
            f.write(enc.encode(_Header(TRACE_KIND, TRACE_VERSION, self.name, self.vocab_size)) + b"\n")
            for conv in self.conversations:
                f.write(enc.encode(conv) + b"\n")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a native trace or a recorded one (see the module docstring)."""
        path = Path(path)
        lines = [ln for ln in path.read_bytes().splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"{path}: empty trace file")
        first = json.loads(lines[0])
        if not isinstance(first, dict):
            raise ValueError(f"{path}:1: expected a JSON object")
        if first.get("kind") == TRACE_KIND:
            header = msgspec.json.decode(lines[0], type=_Header)
            if header.version != TRACE_VERSION:
                raise ValueError(f"{path}: trace version {header.version}, this kvtier reads {TRACE_VERSION}")
            dec = msgspec.json.Decoder(ConversationSpec)
            convs = []
            for i, ln in enumerate(lines[1:], start=2):
                try:
                    convs.append(dec.decode(ln))
                except msgspec.ValidationError as e:
                    raise ValueError(f"{path}:{i}: {e}") from None
            trace = cls(header.name, header.vocab_size, convs)
        else:
            if first.get("kind") == RECORDED_KIND:
                header = msgspec.convert(first, _Header)
                body = lines[1:]
                start_line = 2
            else:
                header = _Header(RECORDED_KIND, name=path.stem)
                body = lines
                start_line = 1
            trace = from_recorded(
                [json.loads(ln) for ln in body],
                name=header.name or path.stem,
                vocab_size=header.vocab_size,
                first_line=start_line,
            )
        validate(trace)
        return trace

    def total_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def validate(trace: Trace) -> None:
    """Raise ValueError on anything the runner or simulator could not replay."""
    if trace.vocab_size <= FIRST_PLAIN_TOKEN_ID:
        raise ValueError(f"vocab_size {trace.vocab_size} too small")
    seen: set[str] = set()
    for conv in trace.conversations:
        if conv.conversation_id in seen:
            raise ValueError(f"duplicate conversation_id {conv.conversation_id!r}")
        seen.add(conv.conversation_id)
        if conv.start_s < 0 or not conv.turns:
            raise ValueError(f"{conv.conversation_id}: negative start or no turns")
        prev_resp = 0
        for i, t in enumerate(conv.turns):
            if t.new_tokens < 1 or t.response_tokens < 1 or t.wait_s < 0 or t.strip_reasoning < 0:
                raise ValueError(f"{conv.conversation_id} turn {i}: bad counts {t}")
            if i == 0 and (t.strip_reasoning or t.wait_s):
                raise ValueError(f"{conv.conversation_id} turn 0: wait_s and strip_reasoning must be 0")
            if t.strip_reasoning > prev_resp:
                raise ValueError(f"{conv.conversation_id} turn {i}: strips more than the previous response")
            prev_resp = t.response_tokens


def from_recorded(rows: list[dict[str, Any]], name: str, vocab_size: int = DEFAULT_VOCAB_SIZE,
                  first_line: int = 1) -> Trace:
    """Convert recorded conversations (absolute timestamps) into a Trace."""
    parsed: list[tuple[str, list[dict[str, Any]]]] = []
    for n, row in enumerate(rows, start=first_line):
        if not isinstance(row, dict) or "conversation_id" not in row or not row.get("turns"):
            raise ValueError(f"line {n}: need conversation_id and a non-empty turns list")
        parsed.append((str(row["conversation_id"]), row["turns"]))
    t0 = min(float(turns[0]["t"]) for _, turns in parsed) if parsed else 0.0
    convs = []
    for n, (cid, turns) in enumerate(parsed, start=first_line):
        specs = []
        for i, t in enumerate(turns):
            if "new_token_ids" in t:
                new = len(t["new_token_ids"])
            elif "new_tokens" in t:
                new = int(t["new_tokens"])
            else:
                raise ValueError(f"line {n} turn {i}: need new_tokens or new_token_ids")
            if i == 0:
                wait = 0.0
            else:
                prev = turns[i - 1]
                ref = prev.get("done_t", prev["t"])
                wait = max(0.0, float(t["t"]) - float(ref))
            specs.append(TurnSpec(new, int(t["response_tokens"]), wait,
                                  int(t.get("strip_reasoning", 0)) if i else 0))
        seed = xxhash.xxh64_intdigest(cid.encode()) & 0x7FFFFFFF
        convs.append(ConversationSpec(ConversationId(cid), float(turns[0]["t"]) - t0, seed, specs))
    return Trace(name, vocab_size, convs)


def token_ids(conv: ConversationSpec, turn_index: int, n: int, vocab_size: int) -> list[int]:
    """The ids of turn ``turn_index``'s ``n`` new tokens: a pure function of the arguments.

    Ids are uniform in ``[FIRST_PLAIN_TOKEN_ID, vocab_size)``, so no special token
    (BOS/EOS/chat markers) appears and two conversations share no prefix by accident.
    """
    if n < 0 or vocab_size <= FIRST_PLAIN_TOKEN_ID:
        raise ValueError(f"bad n={n} or vocab_size={vocab_size}")
    rng = np.random.default_rng([conv.seed & 0xFFFFFFFFFFFF, turn_index])
    return rng.integers(FIRST_PLAIN_TOKEN_ID, vocab_size, size=n).tolist()


class TurnPlan(msgspec.Struct, frozen=True):
    """Token accounting of one turn, derived from the specs (no serving involved).

    ``proven_prefix``: tokens at the start of this prompt that equal the previous
    turn's prompt + response (the KV a previous turn left somewhere is reusable
    only up to here). 0 on turn 0.
    """

    prompt_tokens: int
    proven_prefix: int
    context_after: int  # prompt_tokens + response_tokens


def turn_plan(conv: ConversationSpec) -> list[TurnPlan]:
    out: list[TurnPlan] = []
    prev_prompt = prev_resp = 0
    for i, t in enumerate(conv.turns):
        if i == 0:
            prompt, proven = t.new_tokens, 0
        else:
            prompt = prev_prompt + prev_resp - t.strip_reasoning + t.new_tokens
            proven = prev_prompt + prev_resp if t.strip_reasoning == 0 else prev_prompt
        out.append(TurnPlan(prompt, proven, prompt + t.response_tokens))
        prev_prompt, prev_resp = prompt, t.response_tokens
    return out


# --------------------------------------------------------------------------- synthetic


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LengthDist(_Frozen):
    """Integer lengths uniform in ``mean * (1 ± spread)``, at least 1."""

    mean: int = Field(ge=1)
    spread: float = Field(0.0, ge=0.0, le=1.0)

    def draw(self, rng: np.random.Generator) -> int:
        if self.spread == 0:
            return self.mean
        lo = max(1, math.floor(self.mean * (1 - self.spread)))
        hi = max(lo, math.ceil(self.mean * (1 + self.spread)))
        return int(rng.integers(lo, hi + 1))


class WaitDist(_Frozen):
    """Tool wait before each turn after the first.

    ``lognormal``: median ``median_s``, log-space sigma ``sigma`` (sigma ≈ 1 gives
    the long tail of real tool calls: p99 ≈ 10× the median), capped at ``max_s``.
    ``fixed``: always ``median_s``.
    """

    kind: Literal["lognormal", "fixed"] = "lognormal"
    median_s: float = Field(2.0, ge=0.0)
    sigma: float = Field(1.0, ge=0.0)
    max_s: float = Field(600.0, gt=0.0)

    def draw(self, rng: np.random.Generator) -> float:
        if self.kind == "fixed" or self.median_s == 0:
            return min(self.median_s, self.max_s)
        return float(min(self.max_s, self.median_s * math.exp(self.sigma * rng.standard_normal())))


class SyntheticTraceConfig(_Frozen):
    """Parameters of `synthetic`. Defaults: a short agentic session on the tiny model."""

    name: str = "synthetic"
    conversations: int = Field(8, ge=1)
    turns: int = Field(6, ge=1)
    first_prompt_tokens: LengthDist = LengthDist(mean=512, spread=0.25)
    response_tokens: LengthDist = LengthDist(mean=64, spread=0.5)
    tool_output_tokens: LengthDist = LengthDist(mean=256, spread=0.5)
    wait: WaitDist = WaitDist()
    # Arrival: "waves" starts `concurrency` conversations every `wave_interval_s`
    # (staggered by `stagger_s` inside a wave); "poisson" starts them at
    # exponential inter-arrival times with rate `arrival_rate_per_s`.
    arrival: Literal["waves", "poisson"] = "waves"
    concurrency: int = Field(4, ge=1)
    wave_interval_s: float = Field(60.0, ge=0.0)
    stagger_s: float = Field(0.25, ge=0.0)
    arrival_rate_per_s: float = Field(0.1, gt=0.0)
    strip_reasoning_prob: float = Field(0.0, ge=0.0, le=1.0)
    reasoning_fraction: float = Field(0.5, gt=0.0, le=1.0)  # of the previous response, when stripped
    seed: int = 0
    max_context_tokens: int = Field(4096, ge=2)  # prompt + response never exceeds this
    vocab_size: int = Field(DEFAULT_VOCAB_SIZE, gt=FIRST_PLAIN_TOKEN_ID)

    @model_validator(mode="after")
    def _fits(self) -> SyntheticTraceConfig:
        if self.first_prompt_tokens.mean + self.response_tokens.mean > self.max_context_tokens:
            raise ValueError("first prompt + response mean exceed max_context_tokens")
        return self


def synthetic(cfg: SyntheticTraceConfig) -> Trace:
    """Generate a trace; the same config (seed included) gives the same trace.

    A conversation ends after ``cfg.turns`` turns or when the context reaches
    ``max_context_tokens``: the turn that would overflow is shrunk to fit
    (response first kept, then tool output), so long traces end exactly at the
    limit, which is where reuse matters most.
    """
    root = np.random.default_rng(cfg.seed)
    convs: list[ConversationSpec] = []
    t_poisson = 0.0
    for ci in range(cfg.conversations):
        seed = int(root.integers(0, 2**31 - 1))
        rng = np.random.default_rng(seed)
        if cfg.arrival == "waves":
            start = (ci // cfg.concurrency) * cfg.wave_interval_s + (ci % cfg.concurrency) * cfg.stagger_s
        else:
            start = t_poisson
            t_poisson += float(root.exponential(1.0 / cfg.arrival_rate_per_s))
        turns: list[TurnSpec] = []
        context = 0  # tokens in the history after the previous turn's response
        prev_resp = 0
        for ti in range(cfg.turns):
            new = cfg.first_prompt_tokens.draw(rng) if ti == 0 else cfg.tool_output_tokens.draw(rng)
            resp = cfg.response_tokens.draw(rng)
            wait = 0.0 if ti == 0 else cfg.wait.draw(rng)
            strip = 0
            if ti > 0 and rng.random() < cfg.strip_reasoning_prob:
                strip = min(prev_resp, max(1, round(prev_resp * cfg.reasoning_fraction)))
            room = cfg.max_context_tokens - (context - strip)
            if room < 2:
                break
            if new + resp > room:
                resp = min(resp, max(1, room // 4))
                new = room - resp
            turns.append(TurnSpec(new, resp, round(wait, 6), strip))
            context = context - strip + new + resp
            prev_resp = resp
        convs.append(ConversationSpec(ConversationId(f"{cfg.name}-{ci:04d}"), round(start, 6), seed, turns))
    trace = Trace(cfg.name, cfg.vocab_size, convs)
    validate(trace)
    return trace
