"""accelerate's real FSDP2 path on a CPU-only machine, for tests.

accelerate drops its FSDP plugin when it runs on the CPU (``cpu=True``, or no accelerator), but
torch's ``fully_shard`` runs on gloo. ``fsdp2_on_cpu()`` patches ``Accelerator.__init__`` so that
every accelerator made inside it (``Trainer`` makes one) keeps an FSDP2 plugin: the accelerator
state's ``fsdp_plugin`` is set and its ``distributed_type`` (also in ``PartialState``'s shared
state) is ``FSDP``, so ``accelerator.prepare`` runs ``fsdp2_prepare_model`` -- auto-wrap of the
decoder layers, the embedding and ``[final norm, LM head]`` units, the root -- and ``Trainer``
takes its FSDP branches (sharded checkpoints, ``save_fsdp_model``, ...).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def force_fsdp2(accelerator: Any, plugin: Any) -> None:
    """Make ``accelerator`` (already built, on the CPU) use ``plugin`` as if launched with FSDP2."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


@contextmanager
def fsdp2_on_cpu(state_dict_type: str = "SHARDED_STATE_DICT", **plugin_kwargs: Any) -> Iterator[None]:
    """Inside: every new ``Accelerator`` runs FSDP2 on the CPU (see the module docstring).
    ``plugin_kwargs`` go to ``FullyShardedDataParallelPlugin`` (``reshard_after_forward``, ...)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    original = Accelerator.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        plugin = kwargs.pop("fsdp_plugin", None)
        original(self, *args, **kwargs)
        if plugin is None:
            plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2,
                auto_wrap_policy="transformer_based_wrap",
                state_dict_type=state_dict_type,
                **plugin_kwargs,
            )
        force_fsdp2(self, plugin)

    Accelerator.__init__ = init
    try:
        yield
    finally:
        Accelerator.__init__ = original
