"""The vision encoder of a vision-language model in a plan: its weights, what it keeps for backward, its
FLOPs, and the visual features every rank gathers.

Under context parallelism (docs/multimodal.md) the batch enters the model whole; Qwen's encoder is
spread over the CP group (each rank encodes ``1/P`` of the images) and the features ``[V, H]`` of all
``V`` visual tokens are gathered on every rank, with their gradient in backward. A visual token is
``merge^2`` patches after the encoder's spatial merge. Imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["VisionShape", "vision_cost", "vision_rows"]


@dataclass(frozen=True)
class VisionShape:
    """A ViT encoder (Qwen3-VL / Qwen3.5's ``vision_config``): ``depth`` blocks of width ``hidden``
    (MLP ``intermediate``), ``merge x merge`` patches to one visual token of width ``out_hidden``."""

    depth: int
    hidden: int
    intermediate: int
    merge: int
    out_hidden: int
    embed: int = 0  # the patch embedding's and the learned position embedding's weights

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> VisionShape | None:
        """The encoder of a ``vision_config`` dict with Qwen's fields (``None`` without them)."""
        if not all(k in c for k in ("depth", "hidden_size", "intermediate_size")):
            return None
        merge, h = int(c.get("spatial_merge_size", 2)), c["hidden_size"]
        patch = c.get("in_channels", 3) * c.get("temporal_patch_size", 2) * c.get("patch_size", 16) ** 2
        embed = patch * h + c.get("num_position_embeddings", 2304) * h
        return cls(c["depth"], h, c["intermediate_size"], merge, c.get("out_hidden_size", 0), embed)

    @property
    def patches(self) -> int:
        """Patches per visual token."""
        return self.merge**2

    @property
    def params(self) -> int:
        """Weights: each block's attention (qkv, output) and MLP, the merger's two linear layers, the
        embeddings (norms and biases left out)."""
        h, merged = self.hidden, self.hidden * self.patches
        blocks = self.depth * (4 * h * h + 2 * h * self.intermediate)
        return blocks + merged * merged + merged * self.out_hidden + self.embed


def vision_cost(v: VisionShape, visual_tokens: float, cp: int, b: int, trained: bool, checkpointing: bool) -> dict:
    """One rank's share of the encoder for ``visual_tokens`` visual tokens in the micro-batch (``b``
    bytes per element): ``flops`` (forward, and backward when ``trained``; a frozen encoder needs no
    backward), ``kept`` bytes saved for backward (a block's input per patch under checkpointing, else
    its activations: about ``10 h + 2 i`` elements per patch), ``features`` (the gathered ``[V, H]``
    features and, when trained, their gradient), ``weights``."""
    tokens = visual_tokens / cp
    patches = tokens * v.patches
    merger = v.hidden * v.patches * (v.hidden * v.patches + v.out_hidden)
    forward = 2 * (v.params - merger - v.embed) * patches + 2 * merger * tokens
    per_patch = v.hidden if checkpointing else 10 * v.hidden + 2 * v.intermediate
    return {
        "flops": forward * ((4 if checkpointing else 3) if trained else 1),
        "kept": patches * v.depth * per_patch * b if trained else 0.0,
        "features": visual_tokens * v.out_hidden * b * (2 if trained else 1),
        "weights": v.params * b,
    }


def vision_rows(
    v: VisionShape, visual_tokens: float, cp: int, b: int, full: bool, checkpointing: bool, shards: tuple[int, ...]
) -> dict:
    """The plan's rows of the encoder (bytes per rank): its states (weights; with ``full`` training also
    gradients and AdamW state: ``b + 12`` more bytes per parameter, ``8`` in float32; each divided by
    ``shards``: the GPUs that weights, gradients and optimizer state are sharded over), what it keeps for
    backward, the gathered visual features."""
    cost = vision_cost(v, visual_tokens, cp, b, full, checkpointing)
    weights, grads, optim = shards
    states = cost["weights"] / weights
    if full:
        states += v.params * (b / grads + (8 if b == 4 else 12) / optim)
    return {"vision encoder states": states, "vision encoder activations": cost["kept"],
            "visual features (gathered)": cost["features"]}  # fmt: skip
