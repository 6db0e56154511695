"""hf_ring: exact zigzag ring attention for long-context fine-tuning of Hugging Face models.

``import hf_ring`` registers ``attn_implementation="ring"`` with transformers.
"""

from .data.loader import count_targets, dp_sampler, prepare_dataloader
from .ops.cross_entropy import chunked_causal_lm_loss, disable_chunked_loss, enable_chunked_loss, full_logits
from .ops.offload import enable_activation_checkpointing
from .ops.ring import ring_attention
from .ops.tiled_mlp import disable_tiled_mlp, enable_tiled_mlp
from .ops.zigzag import shard, unshard
from .parallel import ContextParallel, setup_context_parallel
from .transformers.attention import register
from .transformers.batch import shard_batch

__version__ = "0.1.0"

__all__ = [
    "ContextParallel",
    "chunked_causal_lm_loss",
    "disable_chunked_loss",
    "enable_activation_checkpointing",
    "enable_chunked_loss",
    "enable_tiled_mlp",
    "disable_tiled_mlp",
    "full_logits",
    "RingTrainer",
    "RingTrainingArguments",
    "count_targets",
    "dp_sampler",
    "prepare_dataloader",
    "register",
    "ring_attention",
    "setup_context_parallel",
    "shard",
    "shard_batch",
    "unshard",
]



def __getattr__(name: str):
    # RingTrainer imports transformers.Trainer and accelerate: load it on first use, so that
    # `import hf_ring` stays light.
    if name in ("RingTrainer", "RingTrainingArguments"):
        from . import trainer as hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
