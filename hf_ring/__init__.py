"""hf_ring: exact zigzag ring attention for long-context fine-tuning of Hugging Face models."""

from .parallel import ContextParallel, setup_context_parallel
from .ring import ring_attention
from .sharding import shard, unshard

__version__ = "0.1.0"

__all__ = [
    "ContextParallel",
    "ring_attention",
    "setup_context_parallel",
    "shard",
    "unshard",
]
