"""Access to the compiled C++/CUDA core (nanograph._C), which may be absent or unusable."""
from __future__ import annotations

import importlib.util

if importlib.util.find_spec(f"{__package__}._C") is None:
    core = None
    CORE_ERROR: str | None = "nanograph was installed without its C++/CUDA core (no nvcc at install time)"
else:
    try:
        from . import _C as core
        CORE_ERROR = None
    except ImportError as exc:  # e.g. a shared library it links (cuBLAS) is missing
        core = None
        CORE_ERROR = f"the compiled core failed to load: {exc}"


def core_available() -> bool:
    return core is not None


def gpu_available() -> bool:
    """True when the core is built and sees at least one CUDA device."""
    return core is not None and core.device_count() > 0


def require_core():
    """The core module, or a RuntimeError that says why it cannot be used."""
    if core is None:
        raise RuntimeError(
            "the nanograph C++/CUDA core is not available "
            f"({CORE_ERROR}); reinstall with nvcc on PATH (`pip install .`), "
            "or use the torch backend (device='cpu')")
    if core.device_count() == 0:
        raise RuntimeError("no CUDA GPU is visible to the nanograph core; "
                           "use the torch backend (device='cpu')")
    return core
