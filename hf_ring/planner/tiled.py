"""What head groups and tiled layers leave of a layer's recompute and backward: the planner's terms.

``hf_ring.enable_head_groups(model, G)`` runs the heads in ``G`` groups inside the ring: the ring's float32
accumulators, its K/V messages and dK/dV accumulators exist for one group at a time
(``ring_group_bytes``). ``hf_ring.enable_tiled_layers(model, tile)`` computes a layer's two halves over
tiles of ``tile`` tokens (``hf_ring.ops.tiled_layer``): what stays full-length through a layer's backward is
the layer's input, the attention output (``o_proj``'s input) with each head's float32 log-sum-exp, the MLP
half's input, and the gradients flowing in and out (``[tokens, hidden]`` each); q, k, v, their gradients and
the ring's working set exist for one head group, norms, projections, adapters and the MLP for one tile
(``tiled_layer_terms``). Fitted to ``testkit.live_tensors.LiveTensorBytes`` peaks of small Llamas on CPU
(``benchmarks/bench_memory.py``, ``tests/test_planner.py``).

Imports neither torch nor transformers.
"""

from __future__ import annotations

import math

from .models import ModelShape

__all__ = ["check_head_groups", "check_tiled_layers", "ring_group_bytes", "tiled_fixed_bytes", "tiled_layer_terms"]


def _heads(m: ModelShape, ulysses: int) -> tuple[int, int]:
    """Elements per token of q and of k (or v) of the rank's shard (K/V heads repeated under Ulysses)."""
    rep = ulysses // math.gcd(m.kv_heads, ulysses)
    return m.heads * m.head_dim, m.kv_heads * m.head_dim * rep


def ring_group_bytes(m: ModelShape, b: int, cp: int, ulysses: int = 1, groups: int = 1) -> float:
    """Per-token bytes of the ring's working set in attention backward (``hf_ring.ops.ring``) with ``groups``
    head groups, beyond the tensors the layer saves: per group, the float32 dQ accumulator, the K/V message
    and its receive buffer, the travelling float32 dK/dV accumulator and its receive buffer, one block's
    kernel gradients and the group's dOut made contiguous; with more than one group also the whole dQ, dK, dV
    the Function returns, filled group by group. One ring position (``cp == ulysses``): one kernel call."""
    q, kv = _heads(m, ulysses)
    kernel_grads = b * (q + 2 * kv)  # one kernel call's dq, dk, dv
    a2a = 3 * kernel_grads if ulysses > 1 else 0  # dq, dk, dv stacked into one message, and the message received
    if cp == ulysses:
        return max(kernel_grads, a2a)
    per_group = 4 * q + 2 * 2 * kv * b + 2 * 2 * kv * 4 + kernel_grads + b * q
    return max(a2a, per_group / groups + (kernel_grads if groups > 1 else 0))


def tiled_layer_terms(
    m: ModelShape,
    b: int,
    cp: int,
    ulysses: int = 1,
    groups: int = 1,
    lora: tuple[int, tuple[str, ...]] | None = None,
    lora_fp32: bool = True,
) -> dict[str, float]:
    """Bytes of a tiled layer's recompute and backward beyond its input (``b``: bytes per element).

    Per token of the rank's shard:

    - ``saved``: ``o_proj``'s input (the attention output, ``b Hq d``) and every head's float32
      log-sum-exp, kept from the attention half's recompute to its backward;
    - ``mlp_input``: the MLP half's saved input (``b H``), until its backward is done;
    - ``grads``: the gradient flowing into a half and the one it returns (``2 b H``);
    - ``group``: one head group's q, k, v, the gradient of its output, and the ring's backward working set
      for it (``ring_group_bytes`` without its contiguous dOut: the group's gradient is made contiguous
      once); under Ulysses also the group's all-to-all buffers (q, k, v out and back, and out, dOut again:
      estimated, not measured); ``group_grads``: the group's dq, dk, dv, which the tiles' backward reads
      after the ring's buffers are freed;
    - ``group_forward``: the same in the recompute's forward (q, k, v, the float32 output accumulator, the
      K/V messages).

    Per token of one tile (``attn_tile``, ``mlp_tile``): the norm (its float32 input and output), the
    group's rows of q, k, v and their gradients, a LoRA adapter's float32 copy of its input (one at a time
    per projection), and the MLP's saved tensors and gradients; ``attn_fixed`` / ``mlp_fixed``: bytes per
    layer whatever the length (the float32 sums of trained weights' gradients, each group's slice of them).
    """
    h, i = m.hidden, m.intermediate
    q, kv = _heads(m, ulysses)
    ring = cp // ulysses
    lse = 4 * m.heads
    qkv = b * (q + 2 * kv)
    if ring > 1:
        # dQ, K/V message and receive buffer, dK/dV and receive buffer, one block's gradients
        ring_bwd = 4 * q + 2 * 2 * kv * b + 2 * 2 * kv * 4 + qkv
        ring_fwd = 4 * q + 4 * m.heads + 2 * 2 * kv * b  # float32 out and lse accumulators, K/V message + receive
    else:
        ring_bwd, ring_fwd = qkv, b * q + 4 * m.heads
    a2a = (3 * qkv + 4 * b * q) if ulysses > 1 else 0
    adapters = 0.0
    if lora:
        rank, targets = lora
        copies = [fan_in for t, (fan_in, _) in m.linear_shapes().items() if t in targets and t != "o_proj"]
        adapters = 4 * (max(copies, default=0) + rank) if lora_fp32 and b != 4 else 0
    norm = 4 * h + b * h + 4
    attn_tile = 2 * norm + 2 * b * h + 3 * qkv / groups + adapters + 4 * h
    # gate and up (and down's output), silu(gate), their product, the gradients of gate and up and of the
    # product; the norm's float32 values (measured: 6.25 i b + 3 b h per token of a tile, float32)
    mlp_tile = (6.25 if m.mlp_gated else 3.25) * i * b + b * h + 2 * 4 * h + adapters
    return {
        "saved": b * q + lse,
        "mlp_input": b * h,
        "grads": 2 * b * h,
        "group": (qkv + b * q + ring_bwd + a2a) / groups,
        "group_grads": qkv / groups,
        "group_forward": (qkv + ring_fwd + b * q + a2a) / groups,
        "attn_tile": attn_tile,
        "mlp_tile": mlp_tile,
    }


def tiled_fixed_bytes(m: ModelShape, b: int, full: bool, groups: int = 1) -> dict[str, float]:
    """Bytes per layer, whatever the length, of a tiled layer's backward with every weight trained
    (``full``): the float32 sums of the attention half's weight gradients (and each group's slice of them in
    ``b``), of the MLP half's (and one tile's own); 0 with LoRA (small adapters)."""
    if not full:
        return {"attn": 0.0, "mlp": 0.0}
    h, i = m.hidden, m.intermediate
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    attn = 4 * (2 * q + 2 * kv) * h + b * (2 * q + 2 * kv) * h / groups
    mlp = (3 if m.mlp_gated else 2) * h * i * (4 + b)
    return {"attn": attn, "mlp": mlp}


def check_head_groups(m: ModelShape, groups: int, ulysses: int = 1) -> None:
    """Raise ``ValueError`` unless ``groups`` divides the K/V heads each rank attends with (``Hkv``, or under
    Ulysses ``U`` the ``Hkv r / U`` after the all-to-all, ``r`` the K/V replication)."""
    rep = ulysses // math.gcd(m.kv_heads, ulysses)
    local = m.kv_heads * rep // ulysses
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or local % groups:
        fits = [g for g in range(1, local + 1) if local % g == 0]
        raise ValueError(
            f"head_groups={groups!r} must divide the {local} K/V heads each rank attends with (GQA groups are kept "
            f"whole{f', Ulysses {ulysses}' if ulysses > 1 else ''}); pick one of {fits}"
        )


def check_tiled_layers(m: ModelShape, checkpointing: bool) -> None:
    """Raise ``ValueError`` for a model whose layers the tiled forward does not compute (pre-norm attention
    and a gated MLP: Llama, Qwen2, Qwen3, Mistral), or a plan without activation checkpointing."""
    what = [w for w, has in (("mixture-of-experts MLPs", m.moe), ("linear token mixers", m.mixer is not None),
                             ("an attention output gate", m.attn_gate), ("attention sinks", m.sinks),
                             ("a vision tower", m.vision is not None), ("an MLP without gate", not m.mlp_gated))
            if has]  # fmt: skip
    if what:
        raise ValueError(
            f"tiled_layers: {m.name} has {', '.join(what)}; the tiled forward computes Llama, Qwen2, Qwen3 and "
            "Mistral layers (plan it with tiled_mlp and head_groups instead)"
        )
    if not checkpointing:
        raise ValueError("tiled_layers is planned with activation checkpointing (the layers' recompute is tiled)")
