import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.cost.reuse import align_down, reusable_tokens
from kvtier.router.store import _common_prefix


@pytest.mark.parametrize(
    "C,N,L,bs,expected",
    [
        (128, 169, 0, 32, 128),   # D holds 128 of a 169-token prompt: read 4 blocks
        (128, 169, 64, 32, 64),   # 2 blocks already local: read the other 2
        (128, 100, 0, 32, 96),    # prompt shorter than what D holds: aligned min
        (0, 100, 0, 32, 0),
        (128, 169, 160, 32, 0),   # local already covers more than the source
        (31, 169, 0, 32, 0),      # less than a block is never reusable
    ],
)
def test_reusable_tokens(C, N, L, bs, expected):
    assert reusable_tokens(C, N, L, bs) == expected


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 256))
def test_reusable_tokens_properties(C, N, L, bs):
    m = reusable_tokens(C, N, L, bs)
    assert 0 <= m <= max(0, min(C, N) - L)
    if L % bs == 0 and m:
        assert (m + L) % bs == 0  # whole blocks only
    # Never more than one block short of the unaligned optimum.
    assert m >= max(0, min(C, N) - L) - bs + 1 or m == 0


def test_negative_counts_rejected():
    with pytest.raises(ValueError):
        reusable_tokens(-1, 10, 0, 32)
    with pytest.raises(ValueError):
        align_down(10, 0)


@given(st.lists(st.integers(0, 3), max_size=600), st.lists(st.integers(0, 3), max_size=600))
def test_common_prefix_len(a, b):
    """The router's prefix proof (``prove_prefix``) trims retained KV to this length."""
    n = _common_prefix(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]
