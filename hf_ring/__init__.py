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

register()
