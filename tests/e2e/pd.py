"""A hand-rolled P/D exchange for foundation tests (the router does this for real)."""

from __future__ import annotations

import re

import httpx

from kvtier.transfer_params import KVTransferParams, NixlParams


def complete(client: httpx.Client, url: str, model: str, prompt, max_tokens: int, params=None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()


def pd_complete(client, p_url, d_url, model, prompt, max_tokens, reuse: NixlParams | None = None):
    """Prefill on P (optionally reading `reuse` from a decode node), decode on D."""
    pre = complete(client, p_url, model, prompt, 1,
                   KVTransferParams.prefill_request(reuse=reuse).to_wire())
    dec = complete(client, d_url, model, prompt, max_tokens, pre["kv_transfer_params"])
    return pre, dec


def metric(client: httpx.Client, url: str, name: str, **labels) -> float:
    """Sum of a Prometheus sample (counter/gauge) whose labels include ``labels``."""
    text = client.get(f"{url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"^(\S+?)(\{.*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        lab = m.group(2) or ""
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(m.group(3))
    return total


def reset_prefix_cache(client: httpx.Client, url: str) -> None:
    r = client.post(f"{url}/reset_prefix_cache")
    r.raise_for_status()
