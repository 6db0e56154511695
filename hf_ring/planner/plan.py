"""Per-rank memory of long-context fine-tuning: ``plan(model, settings) -> Plan``, a pure function.

A plan is the memory of one rank of a context-parallel (CP) group: model states (weights,
gradients, optimizer state, after FSDP/ZeRO sharding), the activations kept through the step
(checkpointed layer inputs, possibly offloaded to host memory), the working sets of the backward
pass (the recompute of one layer, the ring's buffers, the chunked loss), and whether the ring's
transfers hide behind attention compute. ``smallest_cp`` and ``max_seq_len`` search over plans.
``hf-ring plan`` prints the same (``hf_ring.cli``).

    from hf_ring.planner import PlanSettings, model_shape, plan
    p = plan(model_shape("Llama-3.1-8B"), PlanSettings(seq_len=2**20, gpus=8, offload=True))
    print(p.table())

Everything is per token of the rank's shard (``T = micro_batch * seq_len / cp``, ``terms.py``)
except the chunked loss's per-chunk buffers and the model states. Imports neither torch nor
transformers (the chunked loss's default chunk size is ``hf_ring.ops.cross_entropy``'s rule, restated).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .grids import GridCost, choose_ulysses_size, compare_grids, recommend, ring_overlap
from .models import ModelShape
from .settings import PlanSettings
from .table import grid_lines, plan_table
from .terms import (
    DTYPE_BYTES,
    activation_terms,
    attention_comm,
    mixer_comm_bytes,
    mixer_terms,
    window_border,
    window_buffer_bytes,
)
from .tiled import check_head_groups, check_tiled_layers, ring_group_bytes, tiled_fixed_bytes, tiled_layer_terms
from .timing import StepTime, rates_for, step_time
from .vision import priced_tower, vision_terms

__all__ = ["GiB", "Plan", "max_seq_len", "plan", "smallest_cp"]

GiB = 2**30

# the settings a plan's table and JSON name next to its model and sizes
SHOWN_SETTINGS = ("mode", "dtype", "checkpointing", "offload", "sharding", "chunked_loss", "tiled_mlp", "tiled_layers",
                  "head_groups", "offload_every")  # fmt: skip


@dataclass
class Plan:
    """Memory of one rank (bytes). ``rows``: model states and activation components; ``phases``:
    the activation bytes live at each candidate peak of a step; ``peak``: the largest total.
    ``settings``: those planned for, with ``cp`` and ``ulysses_size`` resolved. ``grids``: every
    ring / Ulysses grid of the CP group priced per layer (``hf_ring.planner.grids``), the
    recommended one first among equals (``recommended``). ``comm``: the attention bytes one rank
    sends per step, full-attention and windowed layers apart (``attention_comm``). ``time``: one micro-step of one
    rank on ``settings.gpu`` with ``settings.attention_backend`` (``timing.step_time``), an estimate until kernel
    rates measured on that GPU exist (``time.rates.measured``)."""

    model: ModelShape
    settings: PlanSettings
    tokens_per_rank: int
    rows: dict[str, float]
    phases: dict[str, float]
    host: dict[str, float]
    overlap: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    grids: list[GridCost] = field(default_factory=list)
    comm: dict[str, Any] = field(default_factory=dict)
    time: StepTime | None = None

    @property
    def ulysses(self) -> int:
        u = self.settings.ulysses_size
        assert isinstance(u, int)
        return u

    @property
    def recommended(self) -> GridCost | None:
        return recommend(self.grids) if self.grids else None

    @property
    def seq_len(self) -> int:
        return self.settings.seq_len

    @property
    def gpus(self) -> int:
        return self.settings.gpus

    @property
    def cp(self) -> int:
        assert self.settings.cp is not None
        return self.settings.cp

    @property
    def gpu_bytes(self) -> float:
        return self.settings.gpu_gib * GiB

    @property
    def model_states(self) -> float:
        return self.rows["weights"] + self.rows["gradients"] + self.rows["optimizer state"]

    @property
    def activation_peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)  # type: ignore[arg-type]

    @property
    def peak(self) -> float:
        return self.model_states + self.activation_peak + self.rows["runtime reserve"]

    @property
    def host_per_rank(self) -> float:
        """Bytes of host memory one rank's offloaded activations take."""
        return sum(self.host.values())

    @property
    def host_per_node(self) -> float:
        """Bytes of host memory the offloaded activations of one node's ranks take
        (``settings.gpus_per_node`` of them, or all GPUs when fewer)."""
        return self.host_per_rank * min(self.gpus, self.settings.gpus_per_node)

    @property
    def fits(self) -> bool:
        """The peak fits in the GPU's memory (and, with ``settings.host_gib``, the offload in the node's)."""
        host = self.settings.host_gib
        return self.peak <= self.gpu_bytes and (host is None or self.host_per_node <= host * GiB)

    def shown_settings(self) -> dict[str, Any]:
        """The settings that the table's and JSON's headline names (mode, dtype, memory tools)."""
        return {k: getattr(self.settings, k) for k in SHOWN_SETTINGS}

    def summary_gib(self) -> dict[str, float]:
        """The figures a recipe states (GiB): model states, activation peak, total."""
        return {
            "model_states": round(self.model_states / GiB, 3),
            "activations": round(self.activation_peak / GiB, 3),
            "total": round((self.model_states + self.activation_peak) / GiB, 3),
        }

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready values (``hf-ring plan --json``), sizes in GiB."""
        return {
            "model": asdict(self.model),
            "seq_len": self.seq_len,
            "gpus": self.gpus,
            "cp": self.cp,
            "tokens_per_rank": self.tokens_per_rank,
            "settings": self.shown_settings(),
            "rows_gib": {k: v / GiB for k, v in self.rows.items()},
            "phases_gib": {k: v / GiB for k, v in self.phases.items()},
            "host_gib": {k: v / GiB for k, v in self.host.items()},
            "host_gib_per_rank": self.host_per_rank / GiB,
            "host_gib_per_node": self.host_per_node / GiB,
            "peak_gib": self.peak / GiB,
            "gpu_gib": self.gpu_bytes / GiB,
            "fits": self.fits,
            "overlap": self.overlap,
            "ulysses_size": self.ulysses,
            "grids": [c.as_dict() for c in self.grids],
            "recommended_ulysses_size": self.recommended.ulysses if self.recommended else None,
            "attention_comm": self.comm,
            "time": self.time.as_dict() if self.time is not None else None,
        }

    def table(self) -> str:
        """The per-rank memory table that ``hf-ring plan`` prints, with the step's time estimate."""
        return plan_table(self)

    def grid_lines(self) -> list[str]:
        """The table of ring / Ulysses grids (per layer and rank: fwd + bwd, + recompute)."""
        return grid_lines(self)


# ``hf_ring.ops.cross_entropy.default_chunk_size`` (float32 logits of about 256 MiB per chunk, 64 to
# 16384 tokens), restated here because that module imports torch and hf-ring plan must not; a test
# holds the two equal (tests/test_startup.py)
LOGITS_CHUNK_BYTES = 256 * 2**20


def _default_chunk_size(vocab: int) -> int:
    return int(min(16384, max(64, LOGITS_CHUNK_BYTES // (4 * max(1, vocab)))))


def plan(model: ModelShape, settings: PlanSettings) -> Plan:
    """Per-rank memory of fine-tuning ``model`` with ``settings`` (``PlanSettings``: sequence length,
    GPUs, CP size, LoRA or full, dtype, checkpointing, offload, sharding, chunked loss, tiled MLP,
    reserve, and the FLOP/s and link bandwidths of the overlap check).

    ``settings.cp=None`` plans the smallest CP size that fits (``smallest_cp``), or all GPUs if none
    does. Raises ``ValueError`` for a CP size that does not divide the GPUs, an unknown sharding or
    mode, or offload without checkpointing.
    """
    s = settings
    m = model
    cp = s.cp
    if cp is None:
        cp = smallest_cp(m, s) or s.gpus
    gpus = s.gpus
    if gpus % cp:
        raise ValueError(f"cp={cp} must divide the number of GPUs ({gpus})")
    levels = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
    if s.sharding not in levels:
        raise ValueError(f"sharding must be none, zero1, zero2, zero3 or fsdp, not {s.sharding!r}")
    level = levels[s.sharding]
    if s.mode not in ("lora", "full"):
        raise ValueError(f"mode must be 'lora' or 'full', not {s.mode!r}")
    if not 0 <= s.visual_fraction <= 1:
        raise ValueError(f"visual_fraction must be between 0 and 1, not {s.visual_fraction}")
    u = s.ulysses_size
    if u == "auto":
        u = choose_ulysses_size(m.heads, m.kv_heads, cp, s.gpus_per_node)
    if not isinstance(u, int) or isinstance(u, bool) or u < 1 or cp % u or m.heads % u:
        raise ValueError(
            f"ulysses_size={u!r} must be 'auto' or a positive int dividing cp={cp} and the {m.heads} query heads"
        )
    b = DTYPE_BYTES[s.dtype]
    f32 = b == 4
    t = s.micro_batch * -(-s.seq_len // (2 * cp)) * 2  # tokens per rank after padding to a multiple of 2P
    shard_opt, shard_grad, shard_w = (gpus if level >= k else 1 for k in (1, 2, 3))
    notes: list[str] = []

    # model states
    n_all = m.params
    if s.mode == "full":
        weights = n_all * b / shard_w
        grads = n_all * b / shard_grad
        optim = n_all * (12 if not f32 else 8) / shard_opt
        head_trainable = True
    else:
        n_lora = m.lora_params(s.lora_rank, s.lora_targets)
        weights = n_all * b / shard_w + n_lora * 4
        grads = n_lora * 4
        optim = n_lora * 8
        head_trainable = False
    if level == 3:
        # gathered while in use: two decoder layers, and the root unit (embedding, head)
        weights += 2 * m.layer_params * b + (1 if m.tied else 2) * m.vocab * m.hidden * b
    vis = priced_tower(m, s)
    if vis is not None:  # the tower's weights; AdamW on them when it is trained
        weights += vis.params * b / shard_w
        if s.train_vision:
            grads += vis.params * b / shard_grad
            optim += vis.params * (12 if not f32 else 8) / shard_opt
    rows: dict[str, float] = {"weights": weights, "gradients": grads, "optimizer state": optim}

    # activations kept through the step
    layer_tile = min(s.tiled_layers, t) if s.tiled_layers else 0
    if layer_tile:
        check_tiled_layers(m, checkpointing=s.checkpointing)
    tile = min(s.tiled_mlp or s.tiled_layers or 0, t)  # tiled layers run the MLP over their tiles too
    groups = s.head_groups
    check_head_groups(m, groups, u)
    lora = (s.lora_rank, tuple(s.lora_targets)) if s.mode == "lora" else None
    a = activation_terms(m, b, tiled_mlp=bool(tile), lora=lora, lora_fp32=s.lora_fp32, ulysses=u)
    checkpointing = s.checkpointing
    # each layer is a sequence of parts, each after its RMSNorm (a plain transformer: attention, MLP)
    mix = mixer_terms(m, b, cp, s.mixer_kernels, lora, s.lora_fp32)
    part_saved = {"attention": a["layer_saved_attn"] - a["norm1"], "mlp": 0 if tile else a["mlp_saved"],
                  "gated_deltanet": mix["saved"], "mamba2": mix["saved"]}  # fmt: skip

    def saved_through(parts: tuple[str, ...], i: int) -> float:
        """What a layer of ``parts`` saves for backward in its parts ``0..i``, norms included."""
        return a["norm1"] + part_saved[parts[0]] + sum(a["norm_io"] + part_saved[q] for q in parts[1 : i + 1])

    kinds = list(dict.fromkeys(m.layer_blocks))
    count = {k: m.layer_blocks.count(k) for k in kinds}
    if checkpointing:
        layers_kept = m.layers * a["layer_input"]
    else:
        own = a["layer_input"] if f32 else 0
        layers_kept = sum(count[k] * (own + saved_through(k, len(k) - 1)) for k in kinds)
    # the final norm: its input once tiled; without the chunked loss's head also its output
    final_norm = a["layer_input"] if layer_tile else a["final_norm"] - (m.hidden * b if s.chunked_loss else 0)
    decoder_kept = t * (layers_kept + a["rope"] + final_norm)
    vocab_row = m.vocab  # the loss's per-token bytes are per vocabulary entry
    if s.chunked_loss:
        chunk = min(t, s.loss_chunk or _default_chunk_size(m.vocab))
        loss_kept = t * (m.hidden * b + 20)  # rows with a target, their targets, index, float32 LSE
        loss_bwd = t * 2 * m.hidden * b + chunk * vocab_row * (4 + (0 if f32 else b))
        if head_trainable:
            loss_bwd += m.vocab * m.hidden * 4  # float32 sum of the head's gradient over the chunks
    else:
        loss_kept = t * vocab_row * (b + 4)  # returned logits, float32 log-softmax
        loss_bwd = t * vocab_row * 8  # float32 gradients of the log-softmax and of the logits
    offload = s.offload
    if offload and not checkpointing:
        raise ValueError("offload moves checkpointed activations to host memory: it needs checkpointing=True")
    # offloaded: the layer inputs and the final norm's tensors (RoPE's cos/sin stay, held by the layers' calls)
    if s.offload_every > 1 and not (offload and layer_tile):
        raise ValueError("offload_every > 1 needs offload and tiled_layers (the tiled layers make the inputs again)")
    offloaded = recomputed = 0.0
    if offload:  # offload_every = k: the inputs of layers 0, k, 2k, ..., and the final norm's when k divides L
        k, n_layers = s.offload_every, m.layers
        stored = (n_layers - 1) // k + 1
        final_stored = n_layers % k == 0
        per_layer = layers_kept / n_layers
        offloaded = t * (per_layer * stored + (final_norm if final_stored else 0.0))
        recomputed = t * (per_layer * (n_layers - stored) + (0.0 if final_stored else final_norm))
    host = {"checkpointed activations": offloaded}
    # LoRA with checkpointing: transformers makes the (frozen) embedding's output require grad
    # (enable_input_require_grads), a leaf that autograd holds on the device until the step's backward is done
    leaf = t * m.hidden * b if s.mode == "lora" and checkpointing else 0.0
    kept = decoder_kept - offloaded - recomputed + loss_kept + leaf
    rows["checkpointed activations" if checkpointing else "saved activations"] = decoder_kept - offloaded - recomputed
    rows["loss (kept for backward)"] = loss_kept
    if leaf:
        rows["embedding output (LoRA: an autograd leaf)"] = leaf
    vt: dict[str, float] = {}
    if vis is not None:
        visual = s.visual_fraction * s.seq_len * s.micro_batch  # visual tokens of the CP group's micro-batch
        vt = vision_terms(vis, visual, cp, b, s.train_vision, checkpointing)
        vt["merged"] = t * cp * m.hidden * b  # the whole merged sequence's embeddings, before the cut
        kept += vt["kept"]
        if s.train_vision:
            rows["vision tower (kept for backward)"] = vt["kept"]
        notes.append(
            f"vision tower: {vis.params / 1e6:,.0f}M parameters ({'trained' if s.train_vision else 'frozen'}), "
            f"{visual:,.0f} visual tokens per sequence ({vis.patches(visual):,.0f} patches), each rank encoding "
            f"1/{cp} of the frames; the features of all of them ({vt['features'] / GiB:.2f} GiB) gathered on "
            "every rank before the merged sequence is cut into shards"
        )

    # working sets, each at its own time in the backward pass
    # the input of the layer being recomputed, back; and the previous layer's, fetched while it runs (prefetch)
    unpacked = t * a["layer_input"] * min(2, m.layers) if offload else 0.0
    ring = ring_group_bytes(m, b, cp, u, groups)
    n_tokens = t * cp // s.micro_batch
    if m.windowed_layers == m.layers and window_border(m, n_tokens, cp, u):
        # every layer windowed within a chunk: the border's keys and values instead of the ring's buffers
        ring = window_buffer_bytes(m, b, n_tokens, cp, u) * s.micro_batch / t
    dx = t * m.hidden * b
    # decoder state once the loss's backward is done (and the full logits, which the output holds)
    base = t * a["rope"] + (unpacked if offload else t * layers_kept) + vt.get("kept", 0.0) + leaf
    if not s.chunked_loss:
        base += t * vocab_row * b
    # one MLP tile recomputed in backward: what it saves, two gradients; the tile's weight gradients
    # and their float32 sums
    tile_ws = tile * (a["mlp_saved"] + 2 * m.intermediate * b)
    if tile and s.mode == "full":
        tile_ws += 3 * m.hidden * m.intermediate * (4 + b)
    # each part's backward, last part first: what the layer saved up to it (recomputed under
    # checkpointing), its transients, the gradient flowing in; the mixers' state message per sequence
    transient = {"attention": ring, "mlp": a["mlp_backward"], "gated_deltanet": mix["backward"],
                 "mamba2": mix["backward"]}  # fmt: skip
    names = {"mlp": "layer backward, MLP", "attention": "layer backward, attention + ring",
             "gated_deltanet": "layer backward, Gated DeltaNet", "mamba2": "layer backward, Mamba2"}  # fmt: skip
    work: dict[str, float] = {}
    for k in kinds:
        for i, part in enumerate(k):
            ws = t * ((saved_through(k, i) if checkpointing else 0) + transient[part]) + dx
            ws += tile_ws if part == "mlp" else 0
            ws += s.micro_batch * mix["fixed"] if part in ("gated_deltanet", "mamba2") else 0
            work[part] = max(work.get(part, 0.0), ws)
    mlp_ws = work.get("mlp", 0.0)
    rows["recompute working set (one layer)" if checkpointing else "backward working set (one layer)"] = mlp_ws
    rows["ring buffers (attention backward)"] = t * ring
    for part in ("gated_deltanet", "mamba2"):
        if part in work:
            rows[f"{names[part].split(', ')[1]} working set (one layer)"] = work[part]
    rows["loss working set (backward)"] = loss_bwd
    rows["runtime reserve"] = s.reserve_gib * GiB
    phases = {"loss backward": kept + loss_bwd}
    if layer_tile:  # every layer tiled: its halves' backward and the recompute of its attention half
        tl = tiled_layer_terms(m, b, cp, u, groups, lora, s.lora_fp32)
        fixed = tiled_fixed_bytes(m, b, s.mode == "full", groups)
        work = {
            "mlp": t * (tl["saved"] + tl["mlp_input"] + tl["grads"]) + layer_tile * tl["mlp_tile"] + fixed["mlp"],
            # the ring's backward of one group, or the tiles' backward that follows it
            "attention": t * (tl["saved"] + tl["grads"])
            + fixed["attn"]
            + max(t * tl["group"], t * tl["group_grads"] + layer_tile * tl["attn_tile"]),
            "forward": t * (tl["saved"] + tl["group_forward"]) + layer_tile * tl["attn_tile"],
        }
        for k in ("recompute working set (one layer)", "ring buffers (attention backward)"):
            rows.pop(k, None)
        rows["tiled layer: attention output, log-sum-exp"] = t * tl["saved"]
        rows[f"tiled layer: one head group of {groups} (q, k, v, ring)"] = t * tl["group"]
        plural = "s" if groups > 1 else ""
        names = {"mlp": "layer backward, MLP (tiled)", "attention": f"layer backward, attention (tiled, {groups} "
                 f"head group{plural})", "forward": "layer recompute, attention (tiled)"}  # fmt: skip
    phases.update({names[part]: base + ws for part, ws in sorted(work.items(), key=lambda kv: kv[0] != "mlp")})
    if vt:
        # the step's start: the tower encodes one block at a time, then the features merge into the whole sequence
        phases["vision tower forward, merge"] = vt["kept"] + vt["forward"] + vt["features"] + vt["merged"]
        if s.train_vision:  # the step's end: the whole sequence's embedding gradient flows into the tower
            phases["vision tower backward"] = vt["kept"] + vt["backward"] + vt["merged"]

    overlap = ring_overlap(m, s, cp, u, b, t // s.micro_batch)
    if s.mode == "lora" and level in (1, 2):
        notes.append("ZeRO-1/2 shard only trainable state; with LoRA that is the adapters")
    rep = u // math.gcd(m.kv_heads, u)
    if rep > 1:
        notes.append(f"ulysses_size={u} does not divide the {m.kv_heads} K/V heads: each is repeated {rep}x "
                     "(saved K/V, ring messages and all-to-all grow by that)")  # fmt: skip
    if m.mixer is not None:
        sent = mixer_comm_bytes(m, b, cp)["total"]
        mixing = sum(m.mixer.kind in parts for parts in m.layer_blocks)
        notes.append(f"{mixing} of {m.layers} layers mix tokens by "
                     f"{m.mixer.kind} (state passing over the CP group: {sent / 2**20:.1f} MiB sent per layer and "
                     f"rank, whatever the length; kernels: {s.mixer_kernels})")  # fmt: skip
    if m.moe:
        notes.append(f"MoE: {m.experts} experts, {m.active_experts} active per token; the router's "
                     "load-balancing loss is summed over the CP group (one all-reduce of 2E + 1 numbers)")  # fmt: skip
    if m.sinks:
        notes.append("attention sinks: one logit per head and layer, merged after the ring; "
                     "their gradient is summed over the CP group")  # fmt: skip
    resolved = replace(s, cp=cp, ulysses_size=u)
    comm = attention_comm(m, b, t * cp, cp, u, checkpointing)
    time = step_time(m, resolved, cp, u, rates_for(s.gpu, s.attention_backend, m.head_dim))
    return Plan(m, resolved, t, rows, phases, host, overlap, notes, compare_grids(m, resolved, cp), comm, time)


def smallest_cp(model: ModelShape, settings: PlanSettings) -> int | None:
    """The smallest CP size (a divisor of ``settings.gpus``) whose plan fits; ``None`` if none does.
    ``settings.cp`` is ignored; with an int ``settings.ulysses_size``, only its multiples are tried."""
    u = settings.ulysses_size
    for cp in range(1, settings.gpus + 1):
        if settings.gpus % cp or (isinstance(u, int) and cp % u):
            continue
        if plan(model, replace(settings, cp=cp)).fits:
            return cp
    return None


def max_seq_len(model: ModelShape, settings: PlanSettings) -> int:
    """The longest sequence (a multiple of 1024 tokens) whose plan fits on ``settings.gpus`` GPUs with
    CP size ``settings.cp`` (``None``: all GPUs in one CP group); 0 if not even 1024 tokens fit.
    ``settings.seq_len`` is ignored."""
    s = replace(settings, cp=settings.cp or settings.gpus)

    def fits(k: int) -> bool:
        return plan(model, replace(s, seq_len=k * 1024)).fits

    lo, hi = 0, 1024
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**20:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * 1024
