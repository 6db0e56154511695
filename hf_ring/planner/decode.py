"""Per-rank memory of greedy decoding under context parallelism (``hf-ring eval ruler``,
``hf-ring plan MODEL --decode``): the KV cache sharded across the CP group.

After the CP prefill every rank keeps the keys and values of ``1/P`` of the prompt for each attention
layer, plus a replicated tail (the last ``< 2P`` prompt tokens and every generated one); a hybrid's
linear layers keep their recurrent state and the short convolution's last rows, replicated (they do
not grow with the sequence). Sliding-window layers keep the whole shard too (the cache is not cut to
the window). Standard library only.
"""

from __future__ import annotations

import math

from .models import ModelShape

__all__ = ["decode_cache_bytes"]


def decode_cache_bytes(
    shape: ModelShape, tokens: int, cp: int, *, new_tokens: int = 128, dtype_bytes: int = 2, batch: int = 1
) -> dict[str, int]:
    """Bytes per rank of the cache that decoding ``new_tokens`` after a prompt of ``tokens`` needs:
    ``kv_shard`` (this rank's ``1/cp`` of the prompt's keys and values), ``kv_tail`` (replicated),
    ``states`` (recurrent states in float32 and convolution rows), ``total``; and ``one_process``, the
    whole cache on one device, for comparison."""
    attention = sum("attention" in b for b in shape.blocks) if shape.blocks else shape.layers
    per_token = 2 * shape.kv_heads * shape.head_dim * dtype_bytes * attention * batch
    shard = math.ceil(tokens / cp) * per_token
    tail = (2 * cp + new_tokens) * per_token
    states = 0
    if shape.mixer is not None:
        linear = shape.layers - attention
        conv = (shape.mixer.conv - 1) * shape.mixer.conv_channels * dtype_bytes
        states = linear * batch * (4 * shape.mixer.state_elems + conv)
    whole = (tokens + new_tokens) * per_token + states
    return {"kv_shard": shard, "kv_tail": tail, "states": states, "total": shard + tail + states,
            "one_process": whole}  # fmt: skip
