"""What one decoder layer keeps per token: the activation terms the planner adds up.

Per token of a rank's shard (``T = micro_batch * seq_len / cp``), in bytes: what transformers'
Llama/Qwen/Mistral layers save for backward (RMSNorm in float32, the ring attention Function, a
gated MLP or the active experts of an MoE layer, LoRA adapters) and the ring's working set in
attention backward; and the bytes attention sends per layer, ring and Ulysses all-to-all
(``attention_comm_bytes``; a windowed layer: ``window_comm_bytes``). Checked with
``testkit.live_tensors.LiveTensorBytes`` on small models (``tests/test_planner.py``,
``benchmarks/memory.py``).

Imports neither torch nor transformers.
"""

from __future__ import annotations

import math

from .models import ModelShape

__all__ = [
    "DTYPE_BYTES",
    "activation_terms",
    "attention_comm_bytes",
    "ring_buffer_bytes",
    "window_border",
    "window_buffer_bytes",
    "window_comm_bytes",
]

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


def activation_terms(
    m: ModelShape,
    b: int,
    tiled_mlp: bool = False,
    lora: tuple[int, tuple[str, ...]] | None = None,
    lora_fp32: bool = True,
    ulysses: int = 1,
) -> dict[str, float]:
    """Bytes per token of the rank's shard saved for backward, by part (``b``: activation dtype bytes).

    RMSNorm (transformers): upcasts its input to float32 (the input itself when it is float32),
    saves that, ``rsqrt`` (4 B) and, when its weight is trained, the normalised value in the model
    dtype; its output is saved by the next linear layer. Attention: RoPE saves only ``cos``/``sin``;
    the ring Function saves q, k, v, its output and a float32 log-sum-exp. MLP: gate, silu(gate), up
    and their product. LoRA (``lora = (rank, targets)``, frozen base weights and norms): the
    normalised values are not saved, each adapter saves its ``rank``-wide intermediate, and the
    MLP's product is saved only if ``down_proj`` has an adapter. With float32 adapters on a 16-bit
    model (``lora_fp32``: PEFT's default ``autocast_adapter_dtype=True``) every adapter also saves a
    float32 copy of its input. Ulysses (``ulysses = U > 1``, ``hf_ring.ops.ulysses``): the ring
    Function saves q, k, v and its output in the ``[N/R tokens, H/U heads]`` layout (as many
    elements as ``[N/P, H]``), K and V repeated ``U / gcd(Hkv, U)`` times; the output comes back
    through an all-to-all as a new tensor, which ``o_proj`` saves too when its weight is trained.
    """
    h, i, d = m.hidden, m.intermediate, m.head_dim
    f32 = b == 4
    normed = 0 if lora else b * h  # saved for the norm weight's gradient
    norm_io = 4 * h + b * h + normed + 4  # a norm whose input nothing else saves
    norm1 = (0 if f32 else 4 * h) + b * h + normed + 4  # input = the layer input (kept anyway in float32)
    rep = ulysses // math.gcd(m.kv_heads, ulysses)
    attn = b * (2 * m.heads * d + 2 * m.kv_heads * rep * d) + 4 * m.heads
    if ulysses > 1 and not lora:
        attn += b * m.heads * d  # o_proj's input: the output after the all-to-all back
    if m.qk_norm:
        attn += (4 + b) * (m.heads + m.kv_heads) * d + 4 * (m.heads + m.kv_heads)
    mlp = 4 * i * b
    mlp_grads = 2 * i * b  # dL/d(gate), dL/d(up) in flight in the MLP's backward
    if m.moe:
        # each token through its k experts: the gathered input, gate, silu(gate), up and their
        # product per expert; the router's float32 probabilities and the chosen experts' weights
        k, ie = m.active_experts, m.expert_intermediate
        mlp = k * (4 * ie * b + h * b) + 4 * m.experts + k * (4 + 8)
        mlp_grads = 2 * k * ie * b + k * h * b
    adapters = {"attn": 0, "mlp": 0}
    if lora:
        rank, targets = lora
        for t, (fan_in, _) in m.linear_shapes().items():
            if t in targets:
                part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "attn"
                adapters[part] += 4 * (fan_in + rank) if lora_fp32 and not f32 else rank * b
        if "down_proj" not in targets and not m.moe:
            mlp -= i * b
    mlp_total = mlp + adapters["mlp"]  # per token of the MLP, saved for its backward
    return {
        "layer_input": h * b,
        # all a layer saves besides its input (tiled MLP: only its input, the norm's output)
        "layer_saved": norm1 + attn + adapters["attn"] + norm_io + (0 if tiled_mlp else mlp_total),
        "layer_saved_attn": norm1 + attn + adapters["attn"],
        "mlp_saved": mlp_total,
        "rope": 2 * d * b,
        "final_norm": norm_io,
        # backward transients of the MLP phase: dL/d(gate), dL/d(up) in flight, and dL/dx
        # (tiled: the MLP's dL/dx accumulator instead; the tile's own tensors are counted apart)
        "mlp_backward": (h * b if tiled_mlp else mlp_grads) + h * b + 24,
    }


def window_border(m: ModelShape, tokens: int, cp: int, ulysses: int = 1) -> bool:
    """A windowed layer exchanges only its window's border: the window (``W - 1`` keys before a
    query) fits in one zigzag chunk of the ring (``N / 2R`` tokens)."""
    ring = cp // ulysses
    return m.window > 0 and (ring == 1 or m.window - 1 <= tokens // (2 * ring))


def window_buffer_bytes(m: ModelShape, b: int, tokens: int, cp: int, ulysses: int = 1) -> float:
    """Bytes (not per token) of a windowed layer's working set beyond what it saves, when it exchanges
    only the border (``window_border``): for each of the rank's two chunks the ``W - 1`` keys and
    values before it, and their float32 dK/dV going back; 0 without a window or ring."""
    if not window_border(m, tokens, cp, ulysses) or cp // ulysses == 1:
        return 0.0
    kv = m.kv_heads * m.head_dim * (ulysses // math.gcd(m.kv_heads, ulysses))
    return 2 * (m.window - 1) * 2 * kv * (b + 4)


def window_comm_bytes(m: ModelShape, b: int, tokens: int, cp: int, ulysses: int = 1) -> dict[str, float]:
    """Bytes one rank sends per windowed layer for one forward and one backward (as
    ``attention_comm_bytes``; ``m.window`` keys before each query, ``W``).

    When ``W - 1`` fits in a zigzag chunk (``N / 2R`` tokens, ``window_border``) each of the rank's
    two chunks gets the ``W - 1`` keys and values before it from the rank that holds them, and their
    float32 dK/dV go back in backward: ``O(W)``, flat in ``N``. A longer window turns the ring only as
    far as it reaches: a query chunk needs the ``c = ceil((W - 1) / chunk)`` chunks before it, which
    zigzag places ``1..c`` and ``R - 1 .. R - c`` ring steps away, so ``min(R - 1, 2c)`` of the full
    ring's ``R - 1`` hops. The Ulysses all-to-alls are those of a full layer.
    """
    full = attention_comm_bytes(m, b, tokens, cp, ulysses)
    ring = cp // ulysses
    if ring == 1 or not m.window:
        return full
    kv = 2 * m.kv_heads * (ulysses // math.gcd(m.kv_heads, ulysses)) / ulysses * m.head_dim
    chunk = tokens // (2 * ring)
    if window_border(m, tokens, cp, ulysses):
        fwd = 2 * (m.window - 1) * kv * b
        bwd = 2 * (m.window - 1) * kv * 4  # dK/dV of the border, float32
    else:
        share = min(ring - 1, 2 * -(-(m.window - 1) // chunk)) / (ring - 1)
        fwd, bwd = full["ring_forward"] * share, full["ring_backward"] * share
    return {
        "ring_forward": fwd,
        "ring_backward": bwd,
        "all_to_all_forward": full["all_to_all_forward"],
        "all_to_all_backward": full["all_to_all_backward"],
        "total": fwd + bwd + full["all_to_all_forward"] + full["all_to_all_backward"],
    }


def ring_buffer_bytes(m: ModelShape, b: int, cp: int, ulysses: int = 1) -> float:
    """Per-token bytes of the ring's working set in attention backward (``hf_ring.ops.ring``), beyond the
    tensors the layer saves (``b``: bytes per element of the model's dtype). With Ulysses (``ulysses
    = U``) the ring runs over ``cp / U`` positions on ``[N/R, H/U]`` (the same elements per token of
    the rank's shard, K/V repeated ``U / gcd(Hkv, U)`` times), and the gradients of q, k, v leave
    through an all-to-all: its send and receive buffers."""
    rep = ulysses // math.gcd(m.kv_heads, ulysses)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim * rep
    kernel_grads = b * (q + 2 * kv)  # one kernel call's dq, dk, dv
    # after the ring: dq, dk, dv, stacked into one message, and the message received
    a2a = 3 * kernel_grads if ulysses > 1 else 0
    if cp == ulysses:  # one kernel call over the whole shard
        return max(kernel_grads, a2a)
    return max(
        a2a,
        4 * q  # dQ accumulator (fp32)
        + 2 * 2 * kv * b  # the K/V message and its receive buffer
        + 2 * 2 * kv * 4  # the dK/dV accumulator travelling the ring (fp32) and its receive buffer
        + kernel_grads  # of the block in flight (each step's are freed before the next kernel call)
        + b * q,  # dOut made contiguous
    )


def attention_comm_bytes(m: ModelShape, b: int, tokens: int, cp: int, ulysses: int = 1) -> dict[str, float]:
    """Bytes one rank sends per decoder layer for one forward and one backward of attention, by kind.

    ``tokens``: the tokens of the whole sequence (times the micro-batch); ``cp = U * R`` ranks,
    ``ulysses = U`` of them in each Ulysses group (``hf_ring.ops.ulysses``; ``1``: plain ring).
    ``b``: bytes per element of the model's dtype. With activation checkpointing the forward runs
    again in backward: add ``"ring_forward"`` and ``"all_to_all_forward"`` once more.

    - ring (``R = cp / U`` ranks on ``Hq / U`` heads, ``N / R`` tokens each): the K/V message makes
      ``R - 1`` hops forward and again in backward; the float32 dK/dV accumulator makes ``R`` hops.
    - all-to-all (``U`` ranks, ``N / P`` tokens each): before attention q, k, v (K/V heads
      replicated ``U / gcd(Hkv, U)`` times when ``U`` does not divide ``Hkv``), after it the
      output; backward sends their gradients back. Each rank keeps ``1 / U`` of what it sends.
    """
    ring = cp // ulysses
    d = m.head_dim
    kv_heads = m.kv_heads * (ulysses // math.gcd(m.kv_heads, ulysses))
    kv_ring = 2 * kv_heads / ulysses * d * tokens / ring  # K and V elements of one ring position's shard
    ring_fwd = (ring - 1) * kv_ring * b
    ring_bwd = (ring - 1) * kv_ring * b + (ring * kv_ring * 4 if ring > 1 else 0)
    share = (ulysses - 1) / ulysses * tokens / cp * d  # elements per head that leave this rank
    a2a_fwd = share * (2 * m.heads + 2 * kv_heads) * b  # q, k, v in; the output back
    return {
        "ring_forward": ring_fwd,
        "ring_backward": ring_bwd,
        "all_to_all_forward": a2a_fwd,
        "all_to_all_backward": a2a_fwd,  # the same tensors' gradients, the other way
        "total": ring_fwd + ring_bwd + 2 * a2a_fwd,
    }
