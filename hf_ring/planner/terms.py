"""What one decoder layer keeps per token: the activation terms the planner adds up.

Per token of a rank's shard (``T = micro_batch * seq_len / cp``), in bytes: what transformers'
Llama/Qwen/Mistral layers save for backward (RMSNorm in float32, the ring attention Function, a
gated MLP or the active experts of an MoE layer, LoRA adapters) and the ring's working set in
attention backward; and the bytes attention sends per layer, ring and Ulysses all-to-all
(``attention_comm_bytes``; a windowed layer: ``window_comm_bytes``). Checked with
``testkit.live_tensors.LiveTensorBytes`` on small models (``tests/test_planner.py``,
``benchmarks/bench_memory.py``).

Imports neither torch nor transformers.
"""

from __future__ import annotations

import math
from typing import Any

from .models import ModelShape

__all__ = [
    "DTYPE_BYTES",
    "activation_terms",
    "attention_comm",
    "attention_comm_bytes",
    "mixer_comm_bytes",
    "mixer_terms",
    "ring_buffer_bytes",
    "state_slots",
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
    if m.attn_gate:  # output * sigmoid(gate): the sigmoid's output and the product (o_proj's input)
        attn += 2 * b * m.heads * d
    mlp = (4 if m.mlp_gated else 2) * i * b  # gate, silu(gate), up, product; ungated: up, act(up)
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
        # (untiled: measured at the peak, dL/d(gate) and dL/d(up) in flight, dL/dx not yet made)
        "mlp_backward": h * b + h * b + 24 if tiled_mlp else mlp_grads,
        "norm1": norm1,
        "norm_io": norm_io,
    }


def mixer_terms(
    m: ModelShape,
    b: int,
    cp: int,
    kernels: str = "cuda",
    lora: tuple[int, tuple[str, ...]] | None = None,
    lora_fp32: bool = True,
) -> dict[str, float]:
    """Per token of the rank's shard, bytes of a hybrid's linear token mixer (``m.mixer``) besides
    its RMSNorm: ``saved`` for backward (the layer's projections, the short convolution's input and
    pre-activation, the gates, the gated norm, and the chunked kernel's saved tensors), ``backward``
    (its backward's transients beyond them); and ``fixed`` bytes per sequence, whatever its length:
    the state passing's all-gathered message (``ops.state_passing``: per rank two runs, each a map
    and a state in float32) and its gradient.

    ``kernels="torch"``: transformers' torch chunked gated delta rule (fitted to measured
    ``LiveTensorBytes`` of Qwen3.5's Gated DeltaNet layer, 4 shapes within 1.2%: per value head and
    token, 5 chunk-by-chunk float32 matrices, the per-chunk states, about 20 float32 head-wide
    vectors; backward 3 more chunk matrices). ``kernels="cuda"`` (fla, mamba-ssm): the kernels save
    their inputs, one chunk matrix and recompute the chunk states in backward (estimated from what
    they save, not measured). Under CP (``cp > 1``) the delta rule runs a second time on every
    run that continues a document (the identity call of ``ops.mixers.delta``: the map of the state),
    and its output ``[Dk]`` per value head is kept. Mamba2's terms are estimated the same way.
    Packed documents add runs, hence slots: ``fixed`` is for one sequence per row."""
    x = m.mixer
    if x is None:
        return {"saved": 0.0, "backward": 0.0, "fixed": 0.0}
    hk, hv, dk, dv, ch = x.k_heads, x.v_heads, x.k_dim, x.v_dim, x.chunk
    c = x.conv_channels
    conv = 2 * b * c  # the convolution's input (in_proj's output) and its pre-activation
    adapters = 0.0
    if lora:
        rank, targets = lora
        for t, (fan_in, _) in x.linear_shapes(m.hidden).items():
            if t in targets:
                adapters += 4 * (fan_in + rank) if lora_fp32 and b != 4 else rank * b
    if x.kind == "gated_deltanet":
        if kernels == "torch":
            kernel = 4 * (hv * (5 * ch + dk * dv / ch + 10 + 10 * (dk + dv)) + 2 * hk * dk)
            bwd = 4 * 3 * hv * ch
            identity = 4 * hv * (5 * ch + dk * dk / ch + 6 + 16 * dk) + 4 * hv * dk
        else:
            # conv output (q, k, v), float32 g and beta, one chunk matrix; gated norm (float32 input,
            # gate, normalised value), out_proj's input
            kernel = b * c + 4 * hv * (2 + ch) + 4 * 3 * hv * dv + b * hv * dv
            bwd = 2 * 4 * hv * dk * dv / ch + 4 * (c + 2 * hv) + 4 * hv * (dk + dv + ch)
            identity = b * hv * dk + 4 * hv * ch + 4 * hv * dk
    else:  # mamba2: x, B, C after the convolution, dt, the gated norm, out_proj's input
        chunk_mats = 4 * hv * ch * (3 if kernels == "torch" else 1)
        kernel = b * c + 4 * 3 * hv + chunk_mats + 4 * 3 * hv * dv + b * hv * dv
        bwd = 2 * 4 * hv * dk * dv / ch + 4 * (c + 2 * hv) + chunk_mats
        identity = 0.0  # SSD's map is a decay per head: no second call
    saved = conv + kernel + adapters + (identity if cp > 1 else 0.0)
    fixed = 2 * 4 * cp * state_slots(cp) * (x.map_elems + x.state_elems)  # the message and its gradient
    return {"saved": saved, "backward": bwd, "fixed": fixed}


def state_slots(cp: int) -> int:
    """Runs per rank whose state the state passing sends, one sequence in the zigzag layout: rank
    ``r`` holds chunks ``r`` and ``2 cp - 1 - r``; the last chunk's state is not needed and rank
    ``cp - 1``'s two chunks are one run, so ranks send two (``cp >= 3``), one (``cp = 2``), none."""
    return 0 if cp == 1 else 1 if cp == 2 else 2


def mixer_comm_bytes(m: ModelShape, b: int, cp: int) -> dict[str, float]:
    """Bytes one rank sends per linear-mixer layer for one forward and one backward, by kind; none
    grows with the sequence. ``state``: the all-gather of the state passing (``state_slots(cp)``
    runs per rank, each a map and a state in float32, to the other ``cp - 1`` ranks) and
    the all-reduce of its gradient (``2 (cp - 1) / cp`` of the gathered message); ``halo``: the
    short convolution's ``K - 1`` rows before each of the two runs, and their gradients back."""
    x = m.mixer
    if x is None or cp == 1:
        return {"state": 0.0, "halo": 0.0, "total": 0.0}
    slot = 4 * (x.map_elems + x.state_elems) * state_slots(cp)
    state = (cp - 1) * slot + 2 * (cp - 1) / cp * cp * slot
    halo = 2 * 2 * (x.conv - 1) * x.conv_channels * b
    return {"state": state, "halo": halo, "total": state + halo}


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


def attention_comm(m: ModelShape, b: int, tokens: int, cp: int, ulysses: int, recompute: bool) -> dict[str, Any]:
    """Bytes one rank sends for attention in one step (``tokens``: of the whole sequence, times the
    micro-batch): the full-attention layers' ring and all-to-alls, the windowed layers' (``border``:
    only the window's border, ``terms.window_comm_bytes``); with checkpointing the forward twice.
    Layers without attention (a hybrid's mixers) are not counted here."""

    def per_layer(c: dict[str, float]) -> float:
        return c["total"] + (c["ring_forward"] + c["all_to_all_forward"] if recompute else 0.0)

    attention_layers = sum("attention" in parts for parts in m.layer_blocks)
    full_layers = attention_layers - m.windowed_layers
    full = per_layer(attention_comm_bytes(m, b, tokens, cp, ulysses))
    windowed = per_layer(window_comm_bytes(m, b, tokens, cp, ulysses)) if m.windowed_layers else 0.0
    return {
        "full_layers": full_layers,
        "windowed_layers": m.windowed_layers,
        "full_layer_bytes": full,
        "windowed_layer_bytes": windowed,
        "border": window_border(m, tokens, cp, ulysses) if m.windowed_layers else False,
        "total": full_layers * full + m.windowed_layers * windowed,
    }
