"""Negative control for test_foundation_pd: with bidirectional mode off, the
decode node hands back nothing to read, so the D→P checks there really depend
on the transfer (a separate module so the e2e order can group stack specs)."""

from __future__ import annotations

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.transfer_params import KVTransferParams
from tests.e2e.pd import pd_complete

pytestmark = pytest.mark.e2e


def test_without_bidirectional_mode_decode_retains_nothing(stack_pool, tiny_model):
    stack = stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                     kv_transfer_config=load_config_file("nixl-unidirectional")))
    client = httpx.Client(timeout=120)
    P, D = stack.prefill[0].url, stack.decode[0].url
    _, dec = pd_complete(client, P, D, tiny_model, "uni: the agent calls a tool and reads the result " * 10, 8)
    params = KVTransferParams.from_wire(dec.get("kv_transfer_params"))
    assert params is None or params.nixl is None or not params.nixl.has_remote_blocks
