"""hf_ring: exact zigzag ring attention for long-context fine-tuning of Hugging Face models.

``import hf_ring`` makes ``attn_implementation="ring"`` available to transformers: at once when
transformers is imported already, else as soon as ``import transformers`` (or the import of any of
its modules) has finished. Registering is cheap: two registry entries and one build hook; what a
model needs is installed when it is built, for its own modeling module only
(``hf_ring.transformers.install``, which lists every change; ``hf_ring.uninstall()`` undoes them).
It imports neither torch nor transformers itself: the public names below load their modules on
first use, so ``hf-ring --help`` and ``hf-ring plan`` start quickly.

The layers, from the bottom: ``hf_ring.ops`` (kernels, schedules, the ring, zigzag sharding,
chunked cross-entropy, tiled MLP, offload; torch only), ``hf_ring.parallel`` (process groups and
the default CP group), ``hf_ring.transformers`` (the only glue that knows transformers),
``hf_ring.data``, ``hf_ring.trainer``, ``hf_ring.planner``. See docs/architecture.md.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use of the name)
_EXPORTS = {
    "ContextParallel": "hf_ring.parallel",
    "RingContext": "hf_ring.transformers.context",
    "RingDPOConfig": "hf_ring.trainer.dpo",
    "RingDPOTrainer": "hf_ring.trainer.dpo",
    "RingGRPOConfig": "hf_ring.trainer.grpo",
    "RingGRPOTrainer": "hf_ring.trainer.grpo",
    "RingNotSupported": "hf_ring.errors",
    "RingTrainer": "hf_ring.trainer",
    "RingTrainingArguments": "hf_ring.trainer",
    "chunked_causal_lm_loss": "hf_ring.ops.cross_entropy",
    "count_targets": "hf_ring.data.loader",
    "disable_chunked_loss": "hf_ring.transformers.patches",
    "disable_head_groups": "hf_ring.transformers.layers",
    "disable_tiled_layers": "hf_ring.transformers.layers",
    "disable_tiled_mlp": "hf_ring.transformers.patches",
    "dp_sampler": "hf_ring.data.loader",
    "enable_activation_checkpointing": "hf_ring.transformers.patches",
    "enable_chunked_loss": "hf_ring.transformers.patches",
    "enable_head_groups": "hf_ring.transformers.layers",
    "enable_tiled_layers": "hf_ring.transformers.layers",
    "enable_tiled_mlp": "hf_ring.transformers.patches",
    "prepare_dataloader": "hf_ring.data.loader",
    "register": "hf_ring.transformers",
    "sequence_logprobs": "hf_ring.transformers.sequence",
    "sequence_sums": "hf_ring.transformers.sequence",
    "ring_attention": "hf_ring.parallel",
    "set_attention_backend": "hf_ring.parallel",
    "setup_context_parallel": "hf_ring.parallel",
    "shard": "hf_ring.parallel",
    "shard_batch": "hf_ring.transformers.batch",
    "ulysses_attention": "hf_ring.parallel",
    "uninstall": "hf_ring.transformers",
    "unshard": "hf_ring.parallel",
}
_SUBPACKAGES = ("cli", "data", "errors", "evaluation", "ops", "parallel", "planner", "plots", "recipes", "trainer",
                "training", "transformers")  # fmt: skip

__all__ = [
    "ContextParallel",
    "RingContext",
    "RingDPOConfig",
    "RingDPOTrainer",
    "RingGRPOConfig",
    "RingGRPOTrainer",
    "RingNotSupported",
    "RingTrainer",
    "RingTrainingArguments",
    "chunked_causal_lm_loss",
    "count_targets",
    "disable_chunked_loss",
    "disable_head_groups",
    "disable_tiled_layers",
    "disable_tiled_mlp",
    "dp_sampler",
    "enable_activation_checkpointing",
    "enable_chunked_loss",
    "enable_head_groups",
    "enable_tiled_layers",
    "enable_tiled_mlp",
    "prepare_dataloader",
    "register",
    "ring_attention",
    "sequence_logprobs",
    "sequence_sums",
    "set_attention_backend",
    "setup_context_parallel",
    "shard",
    "shard_batch",
    "ulysses_attention",
    "uninstall",
    "unshard",
]

if TYPE_CHECKING:
    from .data.loader import count_targets, dp_sampler, prepare_dataloader
    from .errors import RingNotSupported
    from .ops.cross_entropy import chunked_causal_lm_loss
    from .parallel import (
        ContextParallel,
        ring_attention,
        set_attention_backend,
        setup_context_parallel,
        shard,
        ulysses_attention,
        unshard,
    )
    from .trainer import RingTrainer, RingTrainingArguments
    from .trainer.dpo import RingDPOConfig, RingDPOTrainer
    from .trainer.grpo import RingGRPOConfig, RingGRPOTrainer
    from .transformers import register, uninstall
    from .transformers.batch import shard_batch
    from .transformers.context import RingContext
    from .transformers.layers import disable_head_groups, disable_tiled_layers, enable_head_groups, enable_tiled_layers
    from .transformers.patches import (
        disable_chunked_loss,
        disable_tiled_mlp,
        enable_activation_checkpointing,
        enable_chunked_loss,
        enable_tiled_mlp,
    )
    from .transformers.sequence import sequence_logprobs, sequence_sums


def __getattr__(name: str) -> Any:
    """A public name (or a subpackage) on first use: its module is imported then, not at ``import hf_ring``."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))


# --- "ring" in transformers ----------------------------------------------------------------------


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands back the spec the other finders give for ``transformers``, its
    loader wrapped so that ``hf_ring.transformers.register()`` runs once that module has finished
    executing. The package ``transformers`` is the first module of any transformers import (a
    submodule's import runs its package first), and when it has finished no other transformers
    module is half-loaded, so ``register`` may import any of them. ``hf_ring.uninstall()`` removes
    it from ``sys.meta_path`` (it looks for ``hf_ring_registers``)."""

    hf_ring_registers = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "transformers":
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    """``loader``'s module, then ``register()``; the module keeps ``loader`` as its own loader."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_source, ...
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        self.loader.exec_module(module)
        # transformers puts a lazy module of its own in sys.modules: give both the real loader back
        for m in (module, sys.modules.get(spec.name)):
            if m is not None and getattr(m, "__loader__", None) is self:
                m.__loader__ = self.loader
        if spec.loader is self:
            spec.loader = self.loader
        _stop_waiting()
        from .transformers import register

        register()


def _stop_waiting() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]


def _register_with_transformers() -> None:
    """Register now if transformers is imported, else once it is (``_RegisterAfterImport``)."""
    if "transformers" in sys.modules:
        _stop_waiting()
        from .transformers import register

        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


_register_with_transformers()
