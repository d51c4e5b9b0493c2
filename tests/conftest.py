"""Shared pytest fixtures: GPU tests skip with a stated reason when the core or a GPU is absent."""
import pytest

import nanograph


def _gpu_skip_reason():
    if not nanograph.core_available():
        return f"the C++/CUDA core is not built ({nanograph.CORE_ERROR})"
    if not nanograph.gpu_available():
        return "no CUDA GPU is visible"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and GPU_SKIP_REASON is not None:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))
