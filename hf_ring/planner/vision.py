"""The vision tower of a multimodal model: its sizes, and what it adds to a rank's memory and time.

A vision-language model turns each image or video frame into patches, runs a ViT over them, and
merges every ``patches_per_token`` patches into one visual token of the language model's sequence.
Under context parallelism hf_ring runs the tower before the merged sequence is cut into shards, its
frames spread over the CP group (``hf_ring.transformers.multimodal``: each rank encodes ``1/P`` of the
images and of each video's temporal patches) and the visual features ``[V, out_hidden]`` all-gathered
on every rank. With the tower frozen nothing in it is kept for backward; trained, its blocks are
checkpointed like the decoder's, and the gathered features' gradient comes back.

``VisionShape.from_config(config)`` reads transformers' multimodal configs: Qwen2.5-VL / Qwen3-VL /
Qwen3.5 (``depth``, ``num_heads``, ``spatial_merge_size``, ``out_hidden_size``), Llama 4
(``pixel_shuffle_ratio``), Gemma 3 (SigLIP with ``mm_tokens_per_image`` on the outer config) and
other ViTs with ``num_hidden_layers`` / ``num_attention_heads``. Imports neither torch nor
transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models import ModelShape
    from .settings import PlanSettings

__all__ = ["FRAME_PATCHES", "VisionShape", "encoded_tokens", "priced_tower", "vision_terms"]

# Patches of one image or frame that attend to each other in the tower (448 x 448 pixels of 16 x 16
# patches is 784; priced as 1024): the tower's attention FLOPs grow with it, its memory does not.
FRAME_PATCHES = 1024


@dataclass(frozen=True)
class VisionShape:
    """A ViT: ``layers`` blocks of width ``hidden`` (MLP ``intermediate``, ``heads`` heads) over patches
    of ``in_channels x temporal_patch x patch x patch`` pixels; ``patches_per_token`` patches make one
    visual token of width ``out_hidden`` (the language model's) through ``mergers`` merger MLPs
    (Qwen3-VL: one, plus one per deepstack layer), each taking ``merge_in`` features per token (the
    merger MLP of Qwen and Llama 4, a projection after pooling in Gemma 3)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    patch: int
    patches_per_token: int
    out_hidden: int
    temporal_patch: int = 1
    in_channels: int = 3
    mergers: int = 1
    merge_in: int = 0  # width a merger takes: hidden x patches per token (Qwen, Llama 4), hidden when pooled (Gemma 3)
    positions: int = 0  # learned position embeddings
    pooling_head: bool = False  # SigLIP's attention-pooling head (loaded, unused by Gemma 3): about one block
    merger_size: int = 0  # parameters of one merger where its layers are not the Qwen MLP (Llama 4's adapter)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionShape | None:
        """The tower of a multimodal config (``config["vision_config"]``); ``None`` without one."""
        v = config.get("vision_config")
        if not isinstance(v, dict):
            return None
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        hidden = v["hidden_size"]
        out = v.get("out_hidden_size") or v.get("projector_output_dim") or text.get("hidden_size") or hidden
        grid = (v["image_size"] // v["patch_size"]) ** 2 if "image_size" in v else 0
        pooled = False
        if "spatial_merge_size" in v:  # Qwen: 2 x 2 patches per token
            per_token = v["spatial_merge_size"] ** 2
        elif "pixel_shuffle_ratio" in v:  # Llama 4: pixel shuffle by 0.5 -> 4 patches per token
            per_token = round(1 / v["pixel_shuffle_ratio"] ** 2)
        elif "mm_tokens_per_image" in config and grid:  # Gemma 3: (896 / 14)^2 patches pooled to 256 tokens
            per_token, pooled = max(1, grid // config["mm_tokens_per_image"]), True
        else:
            per_token = 1
        return cls(
            layers=v.get("depth") or v["num_hidden_layers"],
            hidden=hidden,
            intermediate=v["intermediate_size"],
            heads=v.get("num_heads") or v["num_attention_heads"],
            patch=v["patch_size"],
            patches_per_token=per_token,
            out_hidden=out,
            temporal_patch=v.get("temporal_patch_size", 1),
            in_channels=v.get("in_channels") or v.get("num_channels") or 3,
            mergers=1 + len(v.get("deepstack_visual_indexes") or ()),
            merge_in=hidden * (1 if pooled else per_token),
            positions=v.get("num_position_embeddings") or grid,
            pooling_head=bool(v.get("vision_use_head", False)),
            merger_size=_llama4_adapter(v, text.get("hidden_size") or out) if "pixel_shuffle_ratio" in v else 0,
        )

    @property
    def merger_params(self) -> int:
        """One merger: a norm, ``[m, m]`` and ``[m, out]`` with biases (``m = merge_in``); after pooling, a norm
        and ``[hidden, out]``."""
        if self.merger_size:
            return self.merger_size
        m = self.merge_in or self.hidden * self.patches_per_token
        if m == self.hidden and self.patches_per_token > 1:  # pooled (Gemma 3)
            return m + m * self.out_hidden
        return 2 * m + m * m + m + m * self.out_hidden + self.out_hidden

    @property
    def embed_params(self) -> int:
        """The patch embedding: one ``[channels x temporal_patch x patch x patch, hidden]`` product."""
        return self.in_channels * self.temporal_patch * self.patch**2 * self.hidden

    @property
    def linear_params(self) -> int:
        """Weights of the matrix products every patch goes through: the blocks and the patch embedding."""
        h, i = self.hidden, self.intermediate
        return self.layers * (4 * h * h + 2 * h * i) + self.embed_params

    @property
    def params(self) -> int:
        """Parameters of the tower: blocks (attention, MLP, two norms, biases), patch embedding, mergers."""
        h, i = self.hidden, self.intermediate
        block = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
        rest = self.embed_params + self.positions * h + self.mergers * self.merger_params
        return (self.layers + self.pooling_head) * block + rest

    def patches(self, visual_tokens: float) -> float:
        return visual_tokens * self.patches_per_token

    def block_saved(self, b: int) -> float:
        """Bytes one block saves for backward per patch: norms' inputs, q/k/v, attention output and its
        log-sum-exp, the projection's input, the MLP's input, hidden and activation."""
        return b * (8 * self.hidden + 2 * self.intermediate) + 4 * self.heads

    def flops(self, patches: float, trained: bool, checkpointing: bool) -> float:
        """FLOPs of the tower over ``patches``: matrix products and attention within each frame, forward,
        recompute and backward when ``trained`` (frozen: forward only, nothing needs its gradient)."""
        per_pass = 2 * self.linear_params * patches + 4 * self.layers * self.hidden * patches * FRAME_PATCHES
        per_pass += 2 * self.mergers * (self.merger_params * patches / self.patches_per_token)
        if not trained:
            return per_pass
        return per_pass * (1 + (1 if checkpointing else 0) + 2)


def _llama4_adapter(v: dict[str, Any], text_hidden: int) -> int:
    """Llama 4's pixel-shuffle MLP (``[intermediate, projector_input]``, ``[projector_output]^2``) and its
    projector ``[vision_output, text hidden]`` (transformers ``modeling_llama4.py``, no biases)."""
    mlp = v["intermediate_size"] * v["projector_input_dim"] + v["projector_output_dim"] ** 2
    return mlp + v["vision_output_dim"] * text_hidden


def encoded_tokens(visual_tokens: float, cp: int) -> float:
    """Visual tokens whose patches one rank of a CP group of ``cp`` encodes: its ``1/cp`` share of the
    frames (at least ``cp`` frames: a long video has thousands)."""
    return visual_tokens / cp


def vision_terms(
    v: VisionShape, visual_tokens: float, cp: int, b: int, trained: bool, checkpointing: bool
) -> dict[str, float]:
    """Bytes the tower adds on one rank of a CP group of ``cp`` for ``visual_tokens`` visual tokens in
    the micro-batch (``b`` bytes per element): ``kept`` through the decoder's whole step (trained: each
    block's input over the rank's share of the patches, or everything each block saves without
    checkpointing), ``forward`` (one block's working set while it encodes, on top of what it keeps),
    ``backward`` (one block's recompute and gradients when trained, and the gathered features'
    gradient), ``features`` (all visual tokens' features, gathered on every rank)."""
    p = v.patches(encoded_tokens(visual_tokens, cp))
    per_block = v.block_saved(b)
    kept = 0.0
    if trained:
        kept = p * v.layers * (v.hidden * b if checkpointing else per_block)
    features = visual_tokens * v.out_hidden * b * v.mergers
    forward = p * (per_block + 2 * v.hidden * b)
    backward = (p * (per_block + 2 * v.hidden * b) + features) if trained else 0.0
    return {"kept": kept, "forward": forward, "backward": backward, "features": features}


def priced_tower(m: ModelShape, s: PlanSettings) -> VisionShape | None:
    """The vision tower the plan prices: the model's when the data has visual tokens."""
    if s.visual_fraction > 0 and m.vision is None:
        raise ValueError(f"visual_fraction={s.visual_fraction}: {m.name} has no vision tower (its config has no "
                         "vision_config); give a multimodal config or visual_fraction=0")  # fmt: skip
    if s.train_vision and (s.visual_fraction <= 0 or s.mode != "full"):
        raise ValueError("train_vision prices AdamW on the vision tower's weights: it needs mode='full' and "
                         "visual_fraction > 0")  # fmt: skip
    return m.vision if s.visual_fraction > 0 else None
