"""Live tensor bytes: allocator-style memory accounting on any device, CPU included (test helper).

    with LiveTensorBytes() as mem:
        model(**batch).loss.backward()
    print(mem.peak, mem.host_peak)

Used by the memory tests and benchmarks to check the planner (``hf_ring.planner``) on machines
without allocator statistics; ``hf_ring.ops.offload`` counts its offloaded copies as host memory
through ``host_allocations`` while one is active.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorBytes", "host_allocations"]

_HOST = threading.local()


@contextmanager
def host_allocations() -> Iterator[None]:
    """Context manager: storages created inside count as host memory for ``LiveTensorBytes``
    (used by the activation offload on machines whose "device" is the CPU itself)."""
    depth = getattr(_HOST, "depth", 0)
    _HOST.depth = depth + 1
    try:
        yield
    finally:
        _HOST.depth = depth


class LiveTensorBytes(TorchDispatchMode):
    """Allocator-style accounting on any device, CPU included: inside ``with LiveTensorBytes() as m``,
    every tensor storage that an operation creates is counted from its creation until it is freed;
    ``m.peak`` is the largest total seen, ``m.live`` the current one (bytes). Storages created under
    ``host_allocations()`` (offloaded activations) count in ``m.host_live``/``m.host_peak`` instead.

    Tensors that existed before the block (parameters, the batch) are not counted, nor views or
    in-place results of them; gradients and optimizer state created inside it are. Views share
    their storage and count once. Operations the autograd engine runs in backward are seen too.
    """

    active = 0

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.host_live = self.host_peak = 0
        self._sizes: dict[int, tuple[int, bool]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> LiveTensorBytes:
        LiveTensorBytes.active += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        LiveTensorBytes.active -= 1
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak, self.host_peak = self.live, self.host_live

    def _free(self, key: int) -> None:
        with self._lock:
            n, host = self._sizes.pop(key)
            if host:
                self.host_live -= n
            else:
                self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # outputs that alias an input made outside (views, in-place ops): not new memory
        inputs = {id(x.untyped_storage()) for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        host = getattr(_HOST, "depth", 0) > 0
        for x in tree_leaves(out):
            if not isinstance(x, torch.Tensor) or x.device.type == "meta":
                continue
            s = x.untyped_storage()
            key, n = id(s), s.nbytes()
            with self._lock:
                old = self._sizes.get(key)
                if old is None:
                    if key in inputs:
                        continue
                    self._sizes[key] = (n, host)
                    weakref.finalize(s, self._free, key)
                    old_n, host_k = 0, host
                else:
                    old_n, host_k = old
                    self._sizes[key] = (n, host_k)
                if host_k:
                    self.host_live += n - old_n
                    self.host_peak = max(self.host_peak, self.host_live)
                else:
                    self.live += n - old_n
                    self.peak = max(self.peak, self.live)
        return out
