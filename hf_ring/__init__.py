"""hf_ring: exact zigzag ring attention for long-context fine-tuning of Hugging Face models.

``import hf_ring`` registers ``attn_implementation="ring"`` with transformers.
"""

from .batch import shard_batch
from .checkpointing import enable_activation_checkpointing
from .chunked_loss import chunked_causal_lm_loss, disable_chunked_loss, enable_chunked_loss, full_logits
from .data import count_targets, dp_sampler, prepare_dataloader
from .integration import register
from .parallel import ContextParallel, setup_context_parallel
from .ring import ring_attention
from .sharding import shard, unshard
from .tiled_mlp import disable_tiled_mlp, enable_tiled_mlp

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
        from . import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
