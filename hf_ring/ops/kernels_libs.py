"""The optional attention libraries: whether each imports, and its kernel, probed once per process.

flash-attn 3 (``flash_attn_3`` / ``flash_attn_interface``), flash-attn 4 (``flash_attn.cute``) and cuDNN
attention (a CUDA build of torch with cuDNN 9). A library that is installed but fails to load (built against
another torch, a release hf_ring does not know) is reported once with a warning and passed over by "auto".
flash-attn 2 is probed in ``kernels`` (its tests replace that probe). This module imports only torch.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .kernels_cudnn import CudnnKernel
from .kernels_fa3 import FlashAttn3Kernel
from .kernels_fa4 import FlashAttn4Kernel

__all__ = ["INSTALL", "importable", "load", "cudnn_kernel", "flash_attn_3_kernel", "flash_attn_4_kernel"]

INSTALL = {
    "flash_attn": "`pip install hf-ring[flash]`",
    "flash_attn_3": "flash-attn 3 (built from flash-attention's hopper/, or the kernels hub build)",
    "flash_attn_4": "`pip install flash-attn-4`",
    "cudnn": "a CUDA build of torch with cuDNN 9",
}


def importable(*names: str) -> bool:
    """Whether any of the modules ``names`` can be found (without importing it)."""
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # a parent package that is not installed
            continue
    return False


def load(what: str, modules: tuple[str, ...], make: Callable[[], Any]) -> tuple[Any | None, str]:
    """``(kernel, "")``, or ``(None, why)`` when none of ``modules`` is installed or ``make`` fails (warned once:
    "auto" then goes on to the next kernel)."""
    if not importable(*modules):
        return None, f"{what} is not installed"
    try:
        return make(), ""
    except Exception as e:  # an extension built against another torch, a release hf_ring does not know
        why = f"{what} is installed but unusable ({type(e).__name__}: {e})"
        warnings.warn(f"{why}; hf_ring's backend='auto' goes on without it.", RuntimeWarning, stacklevel=3)
        return None, why


@functools.cache
def flash_attn_3_kernel() -> tuple[FlashAttn3Kernel | None, str]:
    """flash-attn 3 (``flash_attn_3`` / ``flash_attn_interface``), loaded once per process."""
    return load("flash-attn 3", ("flash_attn_3", "flash_attn_interface"), FlashAttn3Kernel)  # type: ignore[return-value]


@functools.cache
def flash_attn_4_kernel() -> tuple[FlashAttn4Kernel | None, str]:
    """flash-attn 4 (``flash_attn.cute``), loaded once per process."""
    return load("flash-attn 4", ("flash_attn.cute",), FlashAttn4Kernel)  # type: ignore[return-value]


@functools.cache
def cudnn_kernel() -> tuple[CudnnKernel | None, str]:
    """cuDNN attention of this torch: needs a CUDA build with cuDNN 9 or newer."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not version:
        return None, "this torch has no cuDNN"
    return CudnnKernel(version=version), ""
