"""How long a decode node should keep a finished turn's KV: the device TTL, from the cost model.

vLLM's bidirectional NixlConnector pins a turn's blocks on the decode device for a fixed
``decoder_kv_blocks_ttl`` (480 s by default) so the next turn's prefill can read them D->P.
Holding them is not free (the blocks are the decode batch's memory), and when a host copy of
the same KV exists the device copy only buys the difference between two reads. This module
picks the TTL that maximizes the expected TTFT saved minus the memory held, over the tool
waits a deployment has seen.

For one retained turn with ``n`` reusable tokens whose next turn comes after ``w`` seconds:

- **gain** if ``w <= T`` (the device copy is still there): ``alt(n) - dp_read(n)``, where
  ``alt`` is the next best path once the device copy is gone: a peer host-tier read when the
  strategy keeps host copies (and that read beats recomputing), else recomputing the ``n``
  tokens (``b·n + c·n²/2``, the cost model's break-even term). Where host copies are evicted
  before their turn comes back (a small host tier), ``host_copy`` is the observed chance that
  one survives and ``alt`` the mix of the two;
- **price** of holding: ``recompute(n) · min(w, T) / horizon_s``. ``horizon_s`` is the one
  knob: without a cheaper fallback, holding a turn's blocks for ``horizon_s`` seconds costs as
  much as recomputing them. It makes the price scale with the model and hardware (a block that
  is cheap to recompute is cheap to drop) instead of being a constant in block-seconds.

``J(T) = Σ_i [w_i <= T]·gain_i - Σ_i recompute(n_i)·min(w_i, T)/horizon_s`` is maximized over
``T`` in ``{min_ttl_s} ∪ {w_i}`` (J only changes slope at the observed waits), clipped to
``[min_ttl_s, max_ttl_s]``; the TTL configured is that wait plus ``TTL_SLACK`` (20%). With a host copy on this CPU (device and host reads both move DRAM
over NIXL) the gain is milliseconds and ``T`` comes out at the minimum; with no host copy it
comes out at the wait quantile where the tail stops paying for itself.

Threading model: pure functions of immutable values; safe from any thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from kvtier.cost.model import CostModel

DEFAULT_HORIZON_S = 60.0
MIN_TTL_S = 1.0      # vLLM's TTL is whole seconds; 0 would disable retention
MAX_TTL_S = 480.0    # vLLM's default, the longest anyone configures today
# The configured TTL is the covered wait plus this fraction: a turn that comes back exactly at
# an observed wait must still find its blocks, and the router drops its entry a margin early.
TTL_SLACK = 0.2


class WaitSample(msgspec.Struct, frozen=True):
    """One observed tool wait: ``wait_s`` after a turn whose retained KV covered ``tokens``."""

    wait_s: float
    tokens: int


class TtlChoice(msgspec.Struct, frozen=True):
    ttl_s: float            # what to configure: covers_wait_s plus TTL_SLACK
    covers_wait_s: float    # the longest observed wait the choice is meant to cover
    samples: int
    covered: float          # fraction of the observed waits the TTL covers
    expected_gain_s: float  # Σ gain of covered waits (seconds of TTFT)
    expected_price_s: float  # Σ holding price at this TTL (seconds of TTFT)
    explanation: str
    # False: no TTL earns more than it costs (J <= 0 everywhere): retain nothing on the
    # device at all; ``ttl_s`` is then only the shortest TTL, for a deployment that must
    # keep the device path on.
    retain: bool = True


def recompute_s(cost: CostModel, n: int) -> float:
    """Extra prefill seconds of recomputing ``n`` tokens instead of loading them (L = 0)."""
    return cost.prefill_b_s_per_token * n + cost.prefill_c_s_per_token_ctx * n * n / 2


def host_odds(host_copy: bool | float) -> float:
    """``host_copy`` as the chance that a host copy still serves the next turn: True is 1,
    False 0, a float (an observed rate, ``HoldPolicy``) itself, clipped to [0, 1]."""
    p = float(host_copy)
    if not math.isfinite(p):
        raise ValueError(f"host_copy must be a bool or a probability, got {host_copy!r}")
    return min(1.0, max(0.0, p))


def fallback_s(cost: CostModel, n: int, host_copy: bool | float) -> float:
    """What the ``n`` tokens cost once the device copy is gone: a peer host-tier read where
    the host copy is there (``host_copy``: whether it is, or the chance that it still is)
    and that read beats recomputing, else recomputing them."""
    rc = recompute_s(cost, n)
    p = host_odds(host_copy)
    if p > 0 and "p2p" in cost.reads:
        return p * min(rc, cost.read_s("p2p", n)) + (1 - p) * rc
    return rc


def choose_device_ttl(cost: CostModel, waits: Sequence[WaitSample], *, host_copy: bool | float,
                      horizon_s: float = DEFAULT_HORIZON_S, min_ttl_s: float = MIN_TTL_S,
                      max_ttl_s: float = MAX_TTL_S) -> TtlChoice:
    """The device TTL that maximizes expected gain minus holding price (module docstring)."""
    if horizon_s <= 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
    if not 0 < min_ttl_s <= max_ttl_s:
        raise ValueError(f"need 0 < min_ttl_s <= max_ttl_s, got {min_ttl_s}, {max_ttl_s}")
    if "dp_read" not in cost.reads:
        raise ValueError("the cost model has no dp_read link: nothing to retain for")
    obs = [(max(0.0, w.wait_s), max(0, w.tokens)) for w in waits if math.isfinite(w.wait_s)]
    if not obs:
        return TtlChoice(max_ttl_s, max_ttl_s, 0, 0.0, 0.0, 0.0,
                         f"no waits observed yet: the longest TTL ({max_ttl_s:g} s) until there are")
    obs.sort()
    gain = [max(0.0, fallback_s(cost, n, host_copy) - cost.read_s("dp_read", n)) for _, n in obs]
    price = [recompute_s(cost, n) / horizon_s for _, n in obs]  # seconds of TTFT per second held
    # With the waits sorted, J(t) for t in [w_k, w_k+1) is: the gains of waits 0..k, minus the
    # price of those held until their turn came (p_i·w_i), minus the rest held for t (t·p_i).
    # Prefix/suffix sums make every candidate O(1).
    n_obs = len(obs)
    pre_gain, pre_pw, suf_p = [0.0] * (n_obs + 1), [0.0] * (n_obs + 1), [0.0] * (n_obs + 1)
    for i, ((w, _), g, p) in enumerate(zip(obs, gain, price)):
        pre_gain[i + 1] = pre_gain[i] + g
        pre_pw[i + 1] = pre_pw[i] + p * w
    for i in range(n_obs - 1, -1, -1):
        suf_p[i] = suf_p[i + 1] + price[i]
    candidates = sorted({min_ttl_s, *(min(max_ttl_s, max(min_ttl_s, w)) for w, _ in obs)})
    best_t, best_j, best_gp = min_ttl_s, -math.inf, (0.0, 0.0)
    k = 0  # waits obs[:k] are <= t
    for t in candidates:  # ascending: ties keep the shorter TTL (less memory for the same J)
        while k < n_obs and obs[k][0] <= t:
            k += 1
        g, p = pre_gain[k], pre_pw[k] + t * suf_p[k]
        if g - p > best_j + 1e-12:
            best_t, best_j, best_gp = t, g - p, (g, p)
    covered = sum(1 for w, _ in obs if w <= best_t) / n_obs
    ttl = min(max_ttl_s, best_t * (1 + TTL_SLACK))
    retain = best_j > 0
    p_host = host_odds(host_copy) if "p2p" in cost.reads else 0.0
    alt = ("a peer host-tier read" if p_host == 1 else "recomputing" if p_host == 0 else
           f"a host-tier read where the host copy survives ({p_host:.0%} of turns), else "
           f"recomputing")
    mean_gain = sum(gain) / len(gain)
    expl = (f"{len(obs)} waits observed; once the device copy is gone the fallback is {alt}; "
            f"a device read saves {mean_gain * 1e3:.3g} ms per turn on average; holding a turn for "
            f"{horizon_s:g} s costs as much as recomputing it; ")
    if retain:
        expl += (f"covering waits up to {best_t:.3g} s ({covered:.0%} of them; gain "
                 f"{best_gp[0]:.3g} s, price {best_gp[1]:.3g} s) -> TTL {ttl:.3g} s")
    else:
        expl += (f"no TTL gains more than it costs (the best, {best_t:.3g} s, covers "
                 f"{covered:.0%} of the waits: gain {best_gp[0]:.3g} s, price "
                 f"{best_gp[1]:.3g} s) -> no device retention")
    return TtlChoice(ttl, best_t, len(obs), covered, best_gp[0], best_gp[1], expl, retain)


def observed_waits(turns: Sequence, time_scale: float = 1.0) -> list[WaitSample]:
    """Tool waits seen in finished turns (``TurnRecord``s of any runs): the gap between a turn's
    end and its conversation's next turn, divided by ``time_scale`` (a scaled live run's waits
    back in trace seconds), with the tokens the first turn left behind."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    by_conv: dict[tuple[str, str], list] = {}
    for t in turns:
        if t.ok:
            by_conv.setdefault((t.strategy, t.conversation_id), []).append(t)
    out: list[WaitSample] = []
    for seq in by_conv.values():
        seq.sort(key=lambda t: t.turn)
        for a, b in zip(seq, seq[1:]):
            if b.turn == a.turn + 1:
                wait = (b.t_start - (a.t_start + a.e2e_s)) / time_scale
                out.append(WaitSample(max(0.0, wait), a.prompt_tokens + a.response_tokens))
    return out
