"""hf_ring: exact zigzag ring attention for long-context fine-tuning of Hugging Face models.

``import hf_ring`` registers ``attn_implementation="ring"`` with transformers.
"""

from .batch import shard_batch
from .data import count_targets, dp_sampler, prepare_dataloader
from .integration import register
from .parallel import ContextParallel, setup_context_parallel
from .ring import ring_attention
from .sharding import shard, unshard

__version__ = "0.1.0"

__all__ = [
    "ContextParallel",
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
