"""Count the calls that make a CUDA stream and the host wait for each other, on any device (CPU too).

``HostSyncs`` is a ``TorchFunctionMode`` that records, while active, every call of these kinds with
the file and line that made it (the innermost frame outside torch):

- ``to_device``: host data made into a tensor (``torch.tensor``, ``as_tensor``, ``asarray``,
  ``from_numpy``) or a tensor copied to a named device (``.to(device)``, ``.cuda()``, ``.copy_``
  from another device): on CUDA a pageable host-to-device copy, which waits for the stream;
- ``to_host``: a tensor's data read on the host (``.item()``, ``.tolist()``, ``.numpy()``,
  ``bool()`` / ``int()`` / ``float()`` / ``__index__``);
- ``data_shape``: an op whose output shape depends on the data (``nonzero``, ``unique``,
  ``masked_select``, ``argwhere``).

On the CPU none of them waits, but each is one wait per call on CUDA. ``backward(loss)`` runs the
backward with the mode still in force (``Tensor.backward`` would run it with the mode suspended), so
custom autograd Functions' backward and checkpoint recomputes are counted too.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch.autograd import Variable
from torch.overrides import TorchFunctionMode

from testkit.frames import package_dir, package_path

_TORCH = package_dir(torch)

TO_DEVICE = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy}
TO_HOST = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
DATA_SHAPE = {"nonzero", "unique", "masked_select", "argwhere", "unique_consecutive"}
COPIES = {"to", "cuda", "copy_"}


def _names_device(args: tuple, kwargs: dict) -> bool:
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args[1:]) or (
        len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].device != args[0].device
    )


def _kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    name = getattr(func, "__name__", "")
    if func in TO_DEVICE:
        return "to_device"
    if name in COPIES and args and isinstance(args[0], torch.Tensor) and _names_device(args, kwargs):
        return "to_device"
    if name in TO_HOST:
        return "to_host"
    if name in DATA_SHAPE:
        return "data_shape"
    return None


def _call_site() -> str:
    """The innermost frame outside torch: ``hf_ring/<path>:<line>`` in hf_ring's package, else its full path
    (decided by the package directories, so that a checkout in a folder named ``hf_ring`` or ``torch`` changes
    nothing)."""
    frame = sys._getframe(2)
    while frame is not None and (
        package_path(frame.f_code.co_filename, _TORCH) is not None or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    where = package_path(frame.f_code.co_filename) or frame.f_code.co_filename
    return f"{where}:{frame.f_lineno}"


class HostSyncs(TorchFunctionMode):
    """Records ``(kind, function, call site)`` of every synchronising call made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None:
            self.events.append((kind, getattr(func, "__name__", str(func)), _call_site()))
        return func(*args, **kwargs)

    def count(self, *prefixes: str) -> Counter:
        """Events whose call site lies in hf_ring's package under one of ``prefixes`` (``"hf_ring/"``: anywhere in
        it; ``"hf_ring/ops/mixers/"``), by ``(kind, function, site)``."""
        return Counter(e for e in self.events if e[2].startswith(prefixes))


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` with the active torch-function modes in force during the backward."""
    Variable._execution_engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)
