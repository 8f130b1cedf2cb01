"""Loads the compiled extension ``veloce._C`` and explains how to rebuild it if it fails."""

from __future__ import annotations

import importlib
import os

import torch

_REBUILD = (
    "Rebuild it against the torch you have: from the veloce source tree run\n"
    "    pip install --no-build-isolation .\n"
    "(or `pip install --no-build-isolation -e .` for a development install)."
)

_error: Exception | None = None
loaded = False


def _load() -> None:
    global loaded, _error
    try:
        importlib.import_module("veloce._C")
        loaded = True
    except ImportError as exc:  # missing, or built against another torch (undefined symbols)
        _error = exc
        loaded = False


def require() -> None:
    """Raises a RuntimeError that says how to rebuild when the extension is not loaded."""
    if loaded:
        return
    raise RuntimeError(
        f"veloce's compiled extension (veloce._C) could not be loaded: {_error}\n"
        f"It must be built against the installed torch {torch.__version__}. {_REBUILD}"
    )


def has_cuda_kernels() -> bool:
    """True when veloce._C was built with its CUDA kernels."""
    if not loaded:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("veloce::find", "CUDA")


_load()
if not loaded and os.environ.get("VELOCE_REQUIRE_EXTENSION") == "1":
    require()
