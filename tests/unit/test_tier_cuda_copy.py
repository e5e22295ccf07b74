"""The CUDA copier's address arithmetic, checked on CPU tensors (no GPU needed): the
contiguous pieces of one block that the DMA-only store hands to ``cuMemcpyBatchAsync``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.tier.cuda_copy import batch_memcpy, block_pieces


def _page_from_pieces(view: torch.Tensor, base: torch.Tensor, b: int) -> np.ndarray:
    raw = base.view(torch.uint8).numpy().reshape(-1)
    start = b * view.stride(0) * view.element_size()
    return np.concatenate([raw[start + s: start + s + n] for s, _, n in block_pieces(view)])


@pytest.mark.parametrize("shape,block_dim,pieces", [
    ((2, 6, 4, 2, 8), 1, 2),  # vLLM FlashAttention: [2, num_blocks, block, heads, head]
    ((6, 2, 4, 2, 8), 0, 1),  # block-first and contiguous: one piece per block
    ((3, 6, 4, 8), 1, 3),  # a leading dimension of 3: three pieces
])
def test_pieces_concatenate_to_the_slot_page(shape, block_dim, pieces):
    t = torch.arange(int(np.prod(shape)), dtype=torch.int16).reshape(shape)
    view = t.movedim(block_dim, 0)
    got = block_pieces(view)
    assert len(got) == pieces
    # destination offsets tile the page in order, with no gap
    assert [d for _, d, _ in got] == [sum(n for _, _, n in got[:i]) for i in range(pieces)]
    for b in range(view.shape[0]):
        page = view[b].contiguous().view(torch.uint8).numpy().reshape(-1)
        assert np.array_equal(_page_from_pieces(view, t, b), page)


def test_no_driver_means_no_batch_copy_and_no_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA driver is present")
    assert batch_memcpy() is None
