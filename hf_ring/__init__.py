"""hf_ring: exact zigzag ring attention for long-context fine-tuning of Hugging Face models.

``import hf_ring`` registers ``attn_implementation="ring"`` with transformers. The layers, from the
bottom: ``hf_ring.ops`` (kernels, schedules, the ring, zigzag sharding, chunked cross-entropy,
tiled MLP, offload; torch only), ``hf_ring.parallel`` (process groups and the default CP group),
``hf_ring.transformers`` (the only glue that knows transformers), ``hf_ring.data``,
``hf_ring.trainer``, ``hf_ring.planner``. See docs/architecture.md.
"""

from .data.loader import count_targets, dp_sampler, prepare_dataloader
from .ops.cross_entropy import chunked_causal_lm_loss
from .parallel import ContextParallel, ring_attention, setup_context_parallel, shard, ulysses_attention, unshard
from .transformers import register
from .transformers.batch import shard_batch
from .transformers.context import RingContext
from .transformers.patches import (
    disable_chunked_loss,
    disable_tiled_mlp,
    enable_activation_checkpointing,
    enable_chunked_loss,
    enable_tiled_mlp,
)
from .transformers.support import RingNotSupported

__version__ = "0.1.0"

__all__ = [
    "ContextParallel",
    "RingContext",
    "RingNotSupported",
    "RingTrainer",
    "RingTrainingArguments",
    "chunked_causal_lm_loss",
    "count_targets",
    "disable_chunked_loss",
    "disable_tiled_mlp",
    "dp_sampler",
    "enable_activation_checkpointing",
    "enable_chunked_loss",
    "enable_tiled_mlp",
    "prepare_dataloader",
    "register",
    "ring_attention",
    "setup_context_parallel",
    "shard",
    "shard_batch",
    "ulysses_attention",
    "unshard",
]


def __getattr__(name: str):
    # RingTrainer imports transformers.Trainer and accelerate: load it on first use, so that
    # `import hf_ring` stays light.
    if name in ("RingTrainer", "RingTrainingArguments"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
