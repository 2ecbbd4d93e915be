"""GPU tests run only where CUDA (and, for the rollout tests, SGLang) is available; elsewhere every
``@pytest.mark.gpu`` test in this folder is skipped with the reason, never failed."""

import importlib.util

import pytest


def _why_not() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("sglang") is None:
        return "needs SGLang (see docs/gpu.md for the GPU install)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    reason = _why_not()
    if reason:
        for it in gpu_items:
            it.add_marker(pytest.mark.skip(reason=reason))
