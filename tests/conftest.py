import pytest
import torch


def pytest_sessionstart(session):
    """Every test needs this checkout's patched megatron-core; say how to get it, once."""
    from megatron.training.patched_core import PatchedCoreError, require_patched_core

    try:
        require_patched_core()
    except PatchedCoreError as error:
        raise pytest.UsageError(str(error))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (CPU-only machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
