"""Vision-language models under context parallelism: the batch enters whole, the decoder gets its shard.

``shard_batch`` passes a multimodal batch (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``,
...) and its full ``input_ids`` to the model unsharded, with the labels shifted on the full sequence and
sharded as for text, and a ``RingContext`` whose ``entry [B, S_local]`` names the global token of every
local row. Every rank then runs the model's own code up to its text decoder: the vision encoder on its
share of the group's images (``_spread``, ``_spread_tiles``: the features gathered from the group), the
merge of image and video features into the embeddings where the model merges them, and the model's
own positions over the full sequence (Qwen's M-RoPE
``get_rope_index``: ``[3, B, N]`` positions of time, height and width). A forward pre-hook on the
decoder (``language_model``) then cuts what enters it -- ``inputs_embeds``, ``position_ids`` (2-D or
``[R, B, N]``), Qwen3-VL's DeepStack ``visual_pos_masks`` and ``deepstack_visual_embeds`` -- to this
rank's rows, in the layout of the labels (zigzag, packed documents, Ulysses x ring alike).

Gradients: each rank back-propagates through its own rows of the merged sequence only, so its
encoder and embedding gradients are its share; ``RingContext.reduce_loss`` scales the backward by the
group size, and the DP x CP gradient average gives the one-device gradient (frozen encoders too).

Gemma 3's image blocks (``token_type_ids`` 1: the tokens of one image attend to each other both ways)
are cut into the batch's layout by ``shard_batch`` (``ShardLayout.spans``), so every ring schedule lets
them see each other; windowed layers keep their window (transformers' ``create_masks_for_vision_model``).

Refused (``RingNotSupported``): a multimodal batch given to a model whose decoder entry is not in
``FAMILIES``; a tensor entering the decoder along the sequence that this module does not know; a padding
mask; ``token_type_ids`` with image tokens for a family other than Gemma 3, or that ``shard_batch`` did
not see.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import RingNotSupported
from ..ops.gather import gather_rows
from .attention import ring_mask
from .carry import ACTIVE, carry_context
from .context import KEY, RingContext

__all__ = ["FAMILIES", "VISION_TOWERS", "attach", "check_entry", "detach", "vision_attention"]

# the model (class name) that merges the encoder's features and calls its text decoder ``language_model``
FAMILIES = {
    "Qwen3VLModel": "Qwen3-VL", "Qwen3VLMoeModel": "Qwen3-VL-MoE", "Qwen3_5Model": "Qwen3.5",
    "Qwen3_5MoeModel": "Qwen3.5-MoE", "Llama4ForConditionalGeneration": "Llama 4", "Gemma3Model": "Gemma 3",
}  # fmt: skip
# their vision encoders: built with "sdpa" where "ring" is asked (they attend within each image)
VISION_TOWERS = frozenset({"Qwen3VLVisionModel", "Qwen3VLMoeVisionModel", "Qwen3_5VisionModel", "Qwen3_5MoeVisionModel",
                           "Llama4VisionModel", "SiglipVisionModel"})  # fmt: skip
# where the images are spread over the CP group's ranks (``get_image_features`` of Qwen's signature)
SPREAD = frozenset({"Qwen3VLModel", "Qwen3VLMoeModel", "Qwen3_5Model", "Qwen3_5MoeModel"})
# where whole images (tiles) are spread: ``get_image_features(pixel_values [K, C, H, W])``, called without the
# batch's keyword arguments (the context comes from ``carry.ACTIVE``, set by the model's forward)
TILES = frozenset({"Gemma3Model", "Llama4ForConditionalGeneration"})
_ENCODERS = ("visual", "vision_model", "vision_tower")
_CUT = frozenset({"inputs_embeds", "position_ids", "attention_mask", "visual_pos_masks", "deepstack_visual_embeds",
                  "labels", "shift_labels"})  # the last two: this rank's already
_ATTACHED: weakref.WeakSet = weakref.WeakSet()
_HOLDS: weakref.WeakSet = weakref.WeakSet()  # models that ``check_entry`` found holding one of ``_ATTACHED``


def vision_attention(model: nn.Module, implementation: Any) -> Any:
    """The attention a model being built gets: ``"sdpa"`` for the vision encoders of ``VISION_TOWERS``
    asked for ``"ring"`` (they attend within each image, on every rank), else ``implementation``."""
    if implementation == "ring" and type(model).__name__ in VISION_TOWERS:
        return "sdpa"
    return implementation


def attach(model: nn.Module) -> None:
    """Hooks of a model of ``FAMILIES`` (idempotent): its checks before each forward, and, on its first
    forward, the decoder-entry cut on ``model.language_model`` and the encoders' context removal."""
    name = type(model).__name__
    if name in FAMILIES and "_hf_ring_mm" not in model.__dict__:  # its class's name, kept (FSDP2 renames it)
        model._hf_ring_family = name
        model._hf_ring_mm = [model.register_forward_pre_hook(_enter, with_kwargs=True, prepend=True)]
        if name in TILES:
            model.forward = types.MethodType(carry_context(type(model).forward), model)
        _ATTACHED.add(model)


def detach() -> None:
    """Undo ``attach`` on every model."""
    for model in list(_ATTACHED):
        model.__dict__.pop("_hf_ring_family", None)
        for handle in model.__dict__.pop("_hf_ring_mm", []):
            handle.remove()
        model.__dict__.pop("get_image_features", None)
        model.__dict__.pop("forward", None)
        for sub in model.modules():
            sub.__dict__.pop("_hf_ring_entry", None)
            sub.__dict__.pop("_hf_ring_encoder", None)
    _ATTACHED.clear()
    for model in list(_HOLDS):
        model.__dict__.pop("_hf_ring_holds", None)
    _HOLDS.clear()


def check_entry(model: nn.Module, ctx: RingContext) -> None:
    """Refuse a multimodal batch (``ctx.entry``) given to ``model`` unless it holds a model of ``FAMILIES``."""
    if ctx.entry is None or "_hf_ring_entry" in model.__dict__ or "_hf_ring_holds" in model.__dict__:
        return
    if any("_hf_ring_family" in m.__dict__ for m in model.modules()):
        model._hf_ring_holds = True  # walked once per model, not per forward
        _HOLDS.add(model)
        return
    raise RingNotSupported(
        f"{type(model).__name__} got a multimodal batch from hf_ring.shard_batch (image or video inputs), which "
        "enters the model whole and is cut at the entry of its text decoder; hf_ring knows that entry for "
        f"{', '.join(sorted(set(FAMILIES.values())))} only. Run this model without context parallelism "
        "(cp_size=1), or without its image inputs."
    )


def _enter(module: nn.Module, args: Any, kwargs: dict) -> tuple[Any, dict] | None:
    ctx = kwargs.get(KEY)
    entry = isinstance(ctx, RingContext) and ctx.entry is not None
    family = module._hf_ring_family
    name = FAMILIES[family]
    if name == "Gemma 3" and isinstance(ctx, RingContext) and not ctx.layout.spans:  # without one: one process
        _refuse_unseen_blocks(module, kwargs.get("token_type_ids"))
    if not entry:
        return None
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        raise RingNotSupported(f"{name} under context parallelism runs without a KV cache (use_cache=False)")
    if ctx.layout.spans and name != "Gemma 3":
        raise RingNotSupported(
            f"{name} got token_type_ids with image tokens: shard_batch lets the tokens of each image attend to "
            "each other both ways (Gemma 3's image blocks), which this model does not do. Drop token_type_ids "
            "from the batch."
        )
    decoder = getattr(module, "language_model", None)
    if not isinstance(decoder, nn.Module):
        raise RingNotSupported(f"{name}: hf_ring cuts a multimodal batch at its language_model, which it lacks")
    if "_hf_ring_entry" not in decoder.__dict__:
        decoder._hf_ring_entry = decoder.register_forward_pre_hook(_cut_entry, with_kwargs=True, prepend=True)
        module._hf_ring_mm.append(decoder._hf_ring_entry)
        if family in SPREAD:
            module.get_image_features = types.MethodType(_spread(type(module).get_image_features), module)
        elif family in TILES:
            module.get_image_features = types.MethodType(_spread_tiles(type(module).get_image_features), module)
        for sub in decoder.modules():  # the models inside it (Llama 4's causal LM -> its text model) are cut too
            sub.__dict__.setdefault("_hf_ring_entry", decoder._hf_ring_entry)
        for attr in _ENCODERS:
            encoder = getattr(module, attr, None)
            if isinstance(encoder, nn.Module):
                encoder._hf_ring_encoder = encoder.register_forward_pre_hook(_drop_context, with_kwargs=True,
                                                                             prepend=True)  # fmt: skip
                module._hf_ring_mm.append(encoder._hf_ring_encoder)
    if ctx.layout.spans and kwargs.get("attention_mask") is None:
        return args, {**kwargs, "attention_mask": _gemma3_masks(module)}
    return None


def _refuse_unseen_blocks(model: nn.Module, type_ids: Any) -> None:
    """Gemma 3 on the ring with image blocks (``token_type_ids`` 1) that no ``shard_batch`` layout holds:
    its full layers' mask ORs the blocks in (``block_sequence_ids``), which the ring's mask function cannot
    see, so the ring would attend causally there. Refused (one host read, only on this path)."""
    text = model.config.get_text_config()
    if getattr(text, "_attn_implementation", None) != "ring" or not isinstance(type_ids, Tensor):
        return
    if bool((type_ids == 1).any()):
        raise RingNotSupported(
            "Gemma 3 got token_type_ids with image tokens that hf_ring.shard_batch did not see (each image's "
            'tokens attend to each other both ways) under attn_implementation="ring": the ring computes those '
            "blocks from the batch's layout. Put token_type_ids in the batch given to hf_ring.shard_batch, or run "
            'without context parallelism with attn_implementation="sdpa".'
        )


def _gemma3_masks(model: nn.Module) -> dict[str, Any]:
    """Gemma 3's mask per layer type with image blocks, as the ring takes it: the full layers causal, the
    sliding ones with the text config's window (``create_masks_for_vision_model``: AND(window, OR(causal,
    blocks))); the blocks themselves are in the batch's layout. Given to the model as its
    ``attention_mask`` mapping, which it uses as is."""
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    return {
        "full_attention": ring_mask(),
        "sliding_attention": ring_mask(local_size=window, config=text) if window else ring_mask(),
    }


def _split(patches: list[int], parts: int) -> list[int]:
    """Bounds of ``parts`` contiguous runs of images (each at least one) of about equal patch counts."""
    total, bounds, run, i = sum(patches), [0], 0, 0
    for r in range(1, parts):
        while i < len(patches) - (parts - r) and (i < bounds[-1] + 1 or run + patches[i] / 2 <= total * r / parts):
            run, i = run + patches[i], i + 1
        bounds.append(i)
    return [*bounds, len(patches)]


def _frames(grid_thw: Tensor) -> Tensor:
    """``[K, 3]`` grids of images and videos -> one ``(1, h, w)`` row per temporal patch. Qwen's encoders
    encode a video ``(t, h, w)`` as the ``t`` frames ``(1, h, w)`` one after the other: attention runs
    within each frame (transformers ``vision_utils.get_vision_cu_seqlens``, ``merge_temporal=False``), and
    the rotary positions and learned position embeddings of a frame depend on ``(h, w)`` only, repeated
    over ``t``; the patches of a video come frame after frame. So one long video spreads over the group
    too (``tests/test_multimodal.py`` holds each family's encodings of the two equal)."""
    ones = torch.ones_like(grid_thw[:, :1])
    return torch.repeat_interleave(torch.cat((ones, grid_thw[:, 1:]), 1), grid_thw[:, 0], dim=0)


def _spread(original: Any) -> Any:
    """Qwen's ``get_image_features`` (images and videos): at CP = P over at least P frames (an image is
    one, a video one per temporal patch: ``_frames``), rank ``r`` encodes its run of them (``_split``:
    balanced by patches) and the features are gathered from the group (``ops.gather.gather_rows``:
    backward sums each feature's gradient over the group and hands it to the rank that encoded it);
    else every rank encodes every frame."""

    def get_image_features(self: Any, pixel_values: Tensor, image_grid_thw: Tensor | None = None, **kwargs: Any):
        ctx = kwargs.pop(KEY, None)
        if not isinstance(ctx, RingContext) or ctx.size == 1 or image_grid_thw is None:
            return original(self, pixel_values, image_grid_thw, **kwargs)
        frames = _frames(image_grid_thw)
        if len(frames) < ctx.size:
            return original(self, pixel_values, image_grid_thw, **kwargs)
        merge = self.visual.spatial_merge_size**2
        patches = frames.prod(-1).tolist()
        bounds = _split(patches, ctx.size)
        a, b = bounds[ctx.rank], bounds[ctx.rank + 1]
        out = original(self, pixel_values[sum(patches[:a]) : sum(patches[:b])], frames[a:b], **kwargs)
        deep = list(getattr(out, "deepstack_features", None) or [])
        parts = [torch.cat(out.pooler_output), *(torch.cat(d) for d in deep)]
        counts = [sum(patches[bounds[r] : bounds[r + 1]]) // merge for r in range(ctx.size)]
        full = gather_rows(torch.cat(parts, -1), counts, ctx.group).split([p.shape[-1] for p in parts], -1)
        tokens = (image_grid_thw.prod(-1) // merge).tolist()  # per image or video, as the model splits them
        out.pooler_output = full[0].split(tokens)
        if deep:
            out.deepstack_features = [f.split(tokens) for f in full[1:]]
        out.last_hidden_state = None  # this rank's images only: not the group's
        return out

    return get_image_features


def _spread_tiles(original: Any) -> Any:
    """Gemma 3's and Llama 4's ``get_image_features``: at CP = P over at least P images (tiles), rank ``r``
    encodes its run of them and the features (the same number per image) are gathered from the group,
    as ``_spread`` does; else every rank encodes every image."""

    def get_image_features(self: Any, pixel_values: Tensor, *args: Any, **kwargs: Any):
        ctx = kwargs.pop(KEY, None) or ACTIVE.get()
        if not isinstance(ctx, RingContext) or ctx.size == 1 or len(pixel_values) < ctx.size:
            return original(self, pixel_values, *args, **kwargs)
        bounds = _split([1] * len(pixel_values), ctx.size)
        out = original(self, pixel_values[bounds[ctx.rank] : bounds[ctx.rank + 1]], *args, **kwargs)
        mine = out.pooler_output  # [k, tokens, H]: the same tokens per image
        counts = [(bounds[r + 1] - bounds[r]) * mine[0].numel() // mine.shape[-1] for r in range(ctx.size)]
        full = gather_rows(mine.reshape(-1, mine.shape[-1]), counts, ctx.group)
        out.pooler_output = full.view(len(pixel_values), *mine.shape[1:])
        out.last_hidden_state = None  # this rank's images only: not the group's
        return out

    return get_image_features


def _drop_context(module: nn.Module, args: Any, kwargs: dict) -> tuple[Any, dict]:
    """The encoder runs on whole images: no ``ring_context`` (nor the loss's keyword arguments)."""
    return args, {k: v for k, v in kwargs.items() if k not in (KEY, "shift_labels", "num_items_in_batch")}


def _take(t: Tensor, entry: Tensor, counting: bool = False) -> Tensor:
    """This rank's rows of ``t [B or 1, N, ...]``: ``[B, S_local, ...]`` (``entry [B, S_local]``). Rows
    past the sequence (``entry >= N``: padding that ``shard_batch`` added) are zero, or, ``counting``
    (positions), count on from the last row: ``t[N - 1] + entry - (N - 1)``. No copy of ``t``, no host
    sync."""
    b, s = entry.shape
    n, tail = t.shape[1], [1] * (t.dim() - 2)
    entry = entry if entry.device == t.device else entry.to(t.device)  # made on the batch's device
    idx = entry.clamp(max=n - 1)
    rows = t.expand(b, *t.shape[1:]).gather(1, idx.view(b, s, *tail).expand(b, s, *t.shape[2:]))
    past = (entry - idx).view(b, s, *tail)
    if counting:
        return rows + past.to(rows.dtype)
    return rows.masked_fill(past > 0, 0)


def _cut_entry(module: nn.Module, args: Any, kwargs: dict) -> tuple[Any, dict] | None:
    """The text decoder's inputs over the full merged sequence -> this rank's rows."""
    ctx = kwargs.get(KEY)
    if not isinstance(ctx, RingContext) or ctx.entry is None:
        return None
    embeds = kwargs.get("inputs_embeds")
    if args or not isinstance(embeds, Tensor):
        raise RingNotSupported(
            f"{type(module).__name__} was called without inputs_embeds (or with positional arguments): hf_ring "
            "cuts the merged embeddings of a multimodal batch at the decoder's entry."
        )
    entry, n = ctx.entry, embeds.shape[1]
    b = entry.shape[0]
    out = dict(kwargs)
    out["inputs_embeds"] = _take(embeds, entry)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(n, device=embeds.device).expand(b, n)
    if positions.dim() == 2:
        out["position_ids"] = _take(positions, entry, counting=True)
    else:  # [R, B, N]: multimodal RoPE rows (Qwen: time, height, width; or text first)
        rows = _take(positions.permute(1, 2, 0), entry, counting=True)
        out["position_ids"] = rows.permute(2, 0, 1)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor):
        if not bool(mask.all()):
            raise RingNotSupported(
                "the decoder got an attention_mask with padding; pass the batch through hf_ring.shard_batch, "
                "which handles right padding and gives the model no mask"
            )
        out["attention_mask"] = None
    visual = kwargs.get("visual_pos_masks")
    if isinstance(visual, Tensor):  # Qwen3-VL's DeepStack: features added at the visual rows of early layers
        order = (visual.reshape(-1).long().cumsum(0) - 1).view(visual.shape)
        local = _take(visual, entry)
        picked = _take(order, entry)[local]
        out["visual_pos_masks"] = local
        embeds_list = kwargs.get("deepstack_visual_embeds")
        if embeds_list is not None:
            out["deepstack_visual_embeds"] = [e[picked] for e in embeds_list]
    for k, v in kwargs.items():
        if k not in _CUT and isinstance(v, Tensor) and v.dim() >= 2 and n in v.shape[:3]:
            raise RingNotSupported(
                f"{type(module).__name__} got {k} of shape {tuple(v.shape)} along the sequence at its entry; "
                "hf_ring does not know how to cut it into this rank's shard. Run without context parallelism."
            )
    return (), out
