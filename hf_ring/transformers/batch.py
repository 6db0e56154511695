"""Turn a full batch into this rank's model inputs: pad, shift labels, shard, count targets.

Every rank of a CP group passes the same full batch; each gets back the keyword arguments for its
zigzag shard, with one ``RingContext`` (keyword ``ring_context``) that carries what the attention
function and the loss need for this batch. This module imports only torch (it follows
transformers' batch conventions, which is why it lives with the glue).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.comm import check_same_across_ranks, fingerprint, group_size_rank
from ..ops.cross_entropy import IGNORE_INDEX
from ..ops.layout import ShardLayout, sequence_layout, with_spans
from ..ops.placement import balanced_placement
from ..ops.zigzag import hybrid, hybrid_multiple
from ..parallel import ContextParallel, context_parallel_state
from .context import KEY, RingContext

__all__ = ["check_same_batch", "next_token_targets", "shard_batch"]
_SEQ_KEYS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "attention_mask", "position_ids")
_PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # consumed here
_PASS_KEYS = ("num_items_in_batch", "use_cache", "return_dict", "output_hidden_states", "output_attentions")
# image and video inputs: passed to the model whole, with the full input_ids (see multimodal.py); the
# token types only with them
_IMAGE_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes",
               "pixel_attention_mask")  # fmt: skip
MULTIMODAL_KEYS = (*_IMAGE_KEYS, "mm_token_type_ids", "token_type_ids")
_SAMPLE = 2**20  # elements of a pixel tensor that its fingerprint reads at most (long video: billions)


def _resolve(
    group: ContextParallel | dist.ProcessGroup | None,
) -> tuple[dist.ProcessGroup | None, ContextParallel | None]:
    """The CP group to shard over, and the ``ContextParallel`` grid when it has Ulysses (``U > 1``).

    ``group``: a ``ContextParallel`` (its CP group in its Ulysses x ring layout), a process group
    (the plain ring over it), or ``None``: the state of the last ``setup_context_parallel``, else
    the world group."""
    if group is None:
        group = context_parallel_state() if dist.is_available() and dist.is_initialized() else None
    if isinstance(group, ContextParallel):
        return group.cp_group, group if group.ulysses_size > 1 else None
    return group, None


_FIX = (
    "every rank of a CP group must pass the same full batch (shard_batch cuts it). Split the data over "
    "the DP replicas only: hf_ring.dp_sampler / hf_ring.prepare_dataloader, or for a streaming dataset "
    "datasets.distributed.split_dataset_by_node(ds, rank=cp.dp_rank, world_size=cp.dp_size) with "
    "cp = hf_ring.setup_context_parallel(...), not by global rank."
)
_FINGERPRINTED = ("input_ids", "inputs_embeds", "labels", "shift_labels", "attention_mask", "position_ids",
                  "cu_seq_lens_q", "cu_seq_lens_k", "num_items_in_batch", *MULTIMODAL_KEYS)  # fmt: skip


def check_same_batch(batch: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all pass the same batch: its shape and a
    fingerprint of every tensor that ``shard_batch`` reads (one all-gather of 16 integers), naming
    the first field that differs."""
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    names, values = ["batch size B", "sequence length N"], list(batch[key].shape[:2])
    for k in _FINGERPRINTED:
        v = batch.get(k)
        if v is not None:
            names.append(k)
            if isinstance(v, Tensor) and k in _IMAGE_KEYS and v.numel() > _SAMPLE:  # pixels: a strided sample
                v = v.reshape(-1)[:: v.numel() // _SAMPLE]
            values.append(fingerprint(v) if isinstance(v, Tensor) else int(v))
    check_same_across_ranks(values, group, "the batch", names=names, fix=_FIX)


def _check_right_padding(mask: Tensor) -> None:
    m = mask.bool()
    if (m[:, 1:] & ~m[:, :-1]).any():
        raise ValueError(
            "shard_batch: attention_mask has a 0 before a 1 (left padding, or holes inside a "
            "sequence). hf_ring handles right padding exactly (padding after the last token of each "
            "sequence); re-tokenize with tokenizer.padding_side='right', or drop the padding by "
            "packing sequences to equal length."
        )
    if not m[:, 0].all():
        raise ValueError("shard_batch: a sequence of the batch is empty (its attention_mask is all 0)")


def next_token_targets(
    labels: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
) -> Tensor:
    """``[B, N]`` Hugging Face labels (unshifted, ``-100`` where there is no target) -> the target
    of each position, ``[B, N]``: ``labels[:, t + 1]``, ``-100`` at the end, wherever the
    right-padding ``attention_mask`` is 0, and before each packed document's first token (where
    ``position_ids`` restart at 0: the next token belongs to another document)."""
    if attention_mask is not None:
        labels = labels.masked_fill(~attention_mask.bool(), IGNORE_INDEX)
    if position_ids is not None:
        text = position_ids[0] if position_ids.dim() == 3 else position_ids  # [4, B, N]: the text row first
        labels = labels.masked_fill((text == 0).expand_as(labels), IGNORE_INDEX)  # labels[:, 0] go unused
    return torch.cat((labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)), dim=1)


def document_starts(position_ids: Tensor) -> list[list[int]] | None:
    """Start offsets of the packed documents of each row of ``position_ids [B, N]`` (documents begin
    where positions restart at 0), or ``None`` when no row restarts (one sequence per row).

    Raises ``ValueError`` for positions that jump anywhere but back to 0 (they would give RoPE
    positions no document has)."""
    step = position_ids[:, 1:] - position_ids[:, :-1]
    restart = position_ids[:, 1:] == 0
    if not bool(((step == 1) | restart).all()):
        raise ValueError(
            "shard_batch: position_ids must count up by 1 within a document and restart at 0 where a "
            "packed document begins (transformers' DataCollatorWithFlattening convention); these jump "
            "elsewhere. Pass positions 0, 1, 2, ... per document, or no position_ids."
        )
    if not bool(restart.any()):
        return None
    return [[0, *(restart[i].nonzero().flatten() + 1).tolist()] for i in range(position_ids.shape[0])]


def _positions_from_cu_seq_lens(batch: dict[str, Any], n: int, device: torch.device) -> Tensor:
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    cu = cu_q if cu_q is not None else cu_k
    if cu_k is not None and not torch.equal(cu, cu_k):
        raise ValueError("shard_batch: cu_seq_lens_q and cu_seq_lens_k differ; packed causal LM training uses one")
    cu = cu.flatten().long().tolist()
    if cu[0] != 0 or cu[-1] != n or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"shard_batch: cu_seq_lens {cu} must rise from 0 to the sequence length {n}")
    return torch.cat([torch.arange(b - a, device=device) for a, b in zip(cu, cu[1:])])[None]


def shard_batch(
    batch: dict[str, Any],
    *,
    group: ContextParallel | dist.ProcessGroup | None = None,
    pad_token_id: int = 0,
    dp_size: int = 1,
    full_logits: bool = False,
) -> dict[str, Any]:
    """This rank's keyword arguments for ``model(**...)`` from a full batch.

    Args:
        batch: ``input_ids [B, N]`` (or ``inputs_embeds [B, N, H]``); optional ``labels [B, N]``
            (Hugging Face convention: unshifted, ``-100`` where there is no target) or
            ``shift_labels [B, N]`` (already shifted: the target of each position, as
            ``next_token_targets`` makes them; they win over ``labels``, as in transformers' loss),
            ``attention_mask [B, N]`` (right padding only),
            ``position_ids [B, N]`` (restarting at 0 where a packed document begins, or
            ``cu_seq_lens_q/k [D + 1]`` for ``B = 1``), ``num_items_in_batch`` (valid targets of the
            whole step, e.g. over gradient accumulation and DP replicas; counted here otherwise).
            Image or video inputs (``MULTIMODAL_KEYS``: ``pixel_values``, ``image_grid_thw``,
            ``mm_token_type_ids``, ...) go to the model whole, with the full ``input_ids`` and the
            given ``position_ids`` (``[B, N]``, or ``[4, B, N]`` with the text row first); the labels
            are sharded as below and the model's text decoder cuts its inputs at its entry
            (``multimodal.py``, docs/multimodal.md).
        group: the CP group: a ``ContextParallel`` (from ``setup_context_parallel``; with
            ``ulysses_size=U`` the batch is sharded in its Ulysses x ring layout: the zigzag over
            the ``R = P / U`` ring positions, each ring position's shard cut into ``U`` contiguous
            pieces, ``hf_ring.ops.zigzag.hybrid``), a process group (plain ring attention over it),
            or ``None``: the last ``setup_context_parallel``'s, else the world group.
        pad_token_id: id used to pad the sequence to a multiple of ``2P`` (of ``R * lcm(2, U)`` with
            Ulysses; its targets are masked).
        dp_size: number of data-parallel replicas that ``num_items_in_batch`` spans (it then
            counts the targets of all of them): every rank reports ``dp_size`` times its CP group's
            share of the step's loss (the mean over the replicas is the step's loss) and gradients
            averaged over the DP x CP world are those of one device (``RingContext.reduce_loss``).
        full_logits: return full logits even from a model with ``enable_chunked_loss`` (whose
            labelled batches otherwise return ``[B, 0, V]`` logits).

    Every rank of the group must pass the same batch: its shape and a fingerprint of every tensor
    above are compared across the group first (one all-gather of 16 integers), and a difference
    raises ``ValueError`` on every rank, naming the first field that differs.

    Returns:
        ``input_ids`` (or ``inputs_embeds``) and ``position_ids`` of shape ``[B, N_pad / P]``
        (global positions, zigzag order); when labels are given, ``labels`` and ``shift_labels``
        ``[B, N_pad / P]`` (shifted on the full sequence before sharding, so no target is lost at
        chunk boundaries) and ``num_items_in_batch``; ``use_cache=False``; and ``ring_context``
        (a ``RingContext``: the CP group, the batch's layout and loss policy, read by the ring
        attention function, the token mixers and the model's loss, which it sums over the CP
        group). ``N_pad`` is ``N`` rounded up to a multiple of ``2P``
        (``hf_ring.ops.zigzag.hybrid_multiple(P, U)`` with Ulysses). Right padding is handled
        exactly: causal attention never lets a real token see the padding after it, and padded
        positions have no targets. Packed documents are exact: every token attends only to
        earlier tokens of its own document (the context carries the ring schedule cut along
        document boundaries, computed once per batch), RoPE sees each document's own positions, and
        no target crosses a document boundary (with Ulysses, the schedule is the ring's over its
        ``R`` positions).
    """
    images = any(batch.get(k) is not None for k in _IMAGE_KEYS)
    known = (*_SEQ_KEYS, *_PASS_KEYS, *_PACKED_KEYS, *(MULTIMODAL_KEYS if images else ()))
    unknown = [k for k, v in batch.items() if isinstance(v, Tensor) and k not in known]
    if unknown:
        raise ValueError(
            f"shard_batch: does not know how to shard {unknown}; it handles {list(_SEQ_KEYS)}. Remove "
            "these keys or shard them yourself with hf_ring.shard."
        )
    group, cp = _resolve(group)
    size, rank = group_size_rank(group)
    ulysses_size = cp.ulysses_size if cp is not None else 1
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    if key not in batch:
        raise ValueError("shard_batch: the batch needs input_ids [B, N] or inputs_embeds [B, N, H]")
    x: Tensor = batch[key]
    b, n = x.shape[:2]
    whole = [k for k in MULTIMODAL_KEYS if batch.get(k) is not None] if images else []  # enters the model whole
    if whole and key != "input_ids":
        raise ValueError(f"shard_batch: a batch with {whole} needs input_ids (the model merges the images there)")
    check_same_batch(batch, group)
    rope = batch.get("position_ids")  # multimodal RoPE positions [4, B, N] (text row first) go to the model whole
    rope = rope if whole and rope is not None and rope.dim() == 3 and rope.shape[0] == 4 else None
    for k in ("labels", "shift_labels", "attention_mask", "position_ids"):
        v = batch.get(k) if k != "position_ids" or rope is None else rope[0]
        if v is not None and (v.dim() != 2 or v.shape[1] != n or v.shape[0] not in (1, b)):
            raise ValueError(f"shard_batch: {k} has shape {tuple(v.shape)}, expected [{b}, {n}]")
    multiple = hybrid_multiple(size, ulysses_size)
    if n < multiple:
        pieces = f"2 * P = {multiple} zigzag chunks" if ulysses_size == 1 else f"the {multiple} pieces of its layout"
        raise ValueError(
            f"shard_batch: a sequence of {n} tokens is shorter than {pieces}; "
            "context parallelism is for long sequences: use a smaller cp_size or longer sequences."
        )
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_right_padding(mask)
    positions = batch.get("position_ids") if rope is None else rope[0]
    positions_given = positions is not None or any(batch.get(k) is not None for k in _PACKED_KEYS[:2])
    if positions is None and any(batch.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k")):
        if b != 1:
            raise ValueError("shard_batch: cu_seq_lens describe one packed row; pass position_ids for B > 1")
        positions = _positions_from_cu_seq_lens(batch, n, x.device)
    if positions is None:
        positions = torch.arange(n, device=x.device).expand(b, n)
    positions = positions.expand(b, n)
    if mask is not None and batch.get("position_ids") is not None:
        # whatever positions the right padding carries, it continues the last document
        idx = torch.arange(n, device=x.device)
        real = mask.bool().sum(1, keepdim=True)
        last = positions.gather(1, real - 1)
        positions = torch.where(idx >= real, last + idx - real + 1, positions)
    starts = document_starts(positions)
    targets = _targets(batch, b, n, mask, positions if starts is not None else None)
    real = (mask.bool() if mask is not None else torch.ones(b, n, dtype=torch.bool, device=x.device)).expand(b, n)
    if starts is not None:
        layout, index = _packed_layout(starts, n, size, ulysses_size)
        mine = index[rank].to(x.device)

        def take(t: Tensor, fill: float) -> Tensor:
            full = torch.cat((t, t.new_full((t.shape[0], 1, *t.shape[2:]), fill)), dim=1)  # the pad slot at n
            idx = mine.view(b, layout.local, *([1] * (t.dim() - 2))).expand(b, layout.local, *t.shape[2:])
            return full.gather(1, idx)

        schedule = layout.schedule(rank // ulysses_size)
    else:
        n_pad = -(-n // multiple) * multiple
        pad = n_pad - n
        if pad:
            step = torch.arange(1, pad + 1, device=x.device)
            positions = torch.cat((positions, positions[:, -1:] + step), dim=1)
        layout, schedule = sequence_layout(n_pad, size // ulysses_size, ulysses_size), None

        def take(t: Tensor, fill: float) -> Tensor:
            if t.shape[1] < n_pad:  # positions come padded (counting on), the rest gets ``fill``
                t = torch.cat((t, t.new_full((t.shape[0], pad, *t.shape[2:]), fill)), dim=1)
            return hybrid(t, 1, size, rank, ulysses_size).contiguous()  # the batch shape was checked once, above

    spans = image_spans(batch.get("token_type_ids"), b, n) if whole else []
    if any(spans):  # Gemma 3's image tokens see each other both ways: the schedule is cut at the spans
        layout = with_spans(layout, spans)
        schedule = layout.schedule(rank // ulysses_size)
    out: dict[str, Any] = {k: batch[k] for k in _PASS_KEYS if k in batch}
    entry = None
    if whole:  # the decoder's entry cuts the merged sequence and the model's positions (multimodal.py)
        out |= {k: batch[k] for k in whole}
        out[key] = x.expand(b, n)
        if positions_given:
            out["position_ids"] = positions[:, :n] if rope is None else rope
        entry = take(torch.arange(n, device=x.device).expand(b, n), n)
    else:
        out[key] = take(x.expand(b, *x.shape[1:]), pad_token_id if key == "input_ids" else 0.0)
        out["position_ids"] = take(positions, 0)
    out.setdefault("use_cache", False)
    if targets is not None:
        if "num_items_in_batch" not in out:
            out["num_items_in_batch"] = (targets != IGNORE_INDEX).sum()
        # ``labels`` only switches the model's loss on; ``shift_labels`` are the targets it uses.
        out["labels"] = out["shift_labels"] = take(targets, IGNORE_INDEX)
    out[KEY] = RingContext(
        group, size, rank, layout, dp_size=dp_size, labelled=targets is not None, full_logits=full_logits,
        positions_given=positions_given, real=take(real, False), schedule=schedule, ulysses_size=ulysses_size,
        ulysses_group=None if cp is None else cp.ulysses_group, ring_group=None if cp is None else cp.ring_group,
        entry=entry,
    )  # fmt: skip
    return out


def image_spans(token_type_ids: Tensor | None, b: int, n: int) -> list[list[tuple[int, int]]]:
    """Per batch row, the runs of ``token_type_ids [B or 1, N] == 1`` (global ``[s, e)``): the image
    blocks whose tokens attend to each other both ways (transformers ``get_block_sequence_ids_for_mask``
    of Gemma 3: a block is a maximal run of image tokens). ``[]`` without ``token_type_ids``."""
    if token_type_ids is None:
        return []
    if token_type_ids.dim() != 2 or token_type_ids.shape[1] != n or token_type_ids.shape[0] not in (1, b):
        raise ValueError(f"shard_batch: token_type_ids has shape {tuple(token_type_ids.shape)}, expected [{b}, {n}]")
    image = (token_type_ids.expand(b, n) == 1).to(torch.int8)
    edges = torch.diff(torch.nn.functional.pad(image, (1, 1)), dim=1)  # +1 where a run starts, -1 after it
    rows: list[list[tuple[int, int]]] = [[] for _ in range(b)]
    # once per batch: only the runs' ends come to the host (row-major, so starts and stops pair up)
    for (r, a), (_, z) in zip((edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()):
        rows[r].append((a, z))
    return rows


def _targets(
    batch: dict[str, Any], b: int, n: int, mask: Tensor | None, packed_positions: Tensor | None
) -> Tensor | None:
    """``[B, N]`` next-token targets: ``batch["shift_labels"]`` as given (masked where the right
    padding is), or shifted from ``batch["labels"]`` here; ``None`` without either."""
    shifted = batch.get("shift_labels")
    if shifted is not None:
        shifted = shifted.expand(b, n)
        if mask is not None:
            shifted = shifted.masked_fill(~mask.bool(), IGNORE_INDEX)
        if packed_positions is not None:  # the last token of a document has no target in the next one
            last = torch.ones_like(packed_positions[:, :1], dtype=torch.bool)
            ends = torch.cat((packed_positions[:, 1:] == 0, last), dim=1)
            shifted = shifted.masked_fill(ends, IGNORE_INDEX)
        return shifted
    labels = batch.get("labels")
    if labels is None:
        return None
    return next_token_targets(labels.expand(b, n), mask, packed_positions)


def _packed_layout(starts: list[list[int]], n: int, size: int, u_size: int) -> tuple[ShardLayout, Tensor]:
    """The per-document layout of packed rows (``balanced_placement``: each ring position holds ``1/R``
    of every long document's work, no padding but at most ``R - 1`` rows) over the ``R = P / U``
    ring positions, each position's rows (padded to a multiple of ``U``) cut into ``U`` contiguous
    pieces, one per rank of its Ulysses group; and ``[P, B, S_local]``, the global position of every
    local row (``n`` for padding rows)."""
    ring = size // u_size
    placements = [balanced_placement(s, n, ring) for s in starts]
    local = -(-max(length for _, length in placements) // u_size) * u_size
    shared = len({tuple(s) for s in starts}) == 1
    rows = tuple(placement for placement, _ in (placements[:1] if shared else placements))
    tops = tuple(tuple(s) for s in (starts[:1] if shared else starts))
    layout = ShardLayout(n, ring, u_size, local // u_size, rows, tops, packed=True)
    return layout, layout.index(len(starts))


