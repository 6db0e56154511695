"""TRL's fused LM head over the CP group: what ``RingDPOTrainer`` and ``RingGRPOTrainer`` build on.

TRL's preference and policy trainers compute every loss and metric from one call,
``model(input_ids=..., attention_mask=..., labels=..., fused_lm_head=True)``, whose output holds
per-token tensors ``[B, N - 1]`` (``log_probs``, and ``entropy``, ``mean_logits``, ``is_top1``,
``log_sum_sq_probs`` as asked), computed by ``trl.trainer.utils.add_fused_lm_head`` from the last
hidden states in chunks. ``fused_forward(lm, state, ...)`` is that forward, during the trainer's own model
calls (``RingTrainerForTRL.model_calls``, scoped ledger entries): with a CP group of
``P > 1`` each rank shards the full batch (``shard_batch``: zigzag, right padding, packed documents;
left padding, as GRPO's prompts have, is moved to the right first: the rows' RoPE positions shift
by a constant, which changes no attention score; image inputs enter whole, per-token ``mm_token_type_ids``
move with their rows), runs the ring model on its shard, computes its
tokens' log-probabilities from the LM head's input in chunks (``sequence_logprobs``) and either
gathers the per-token values of the CP group into the full ``[B, N - 1]`` (``gather_tokens``: one
float per token and field; GRPO) or, where TRL reads them only through per-row sums (DPO without
``ld_alpha``), sums them per row over the group (``sequence_sums``) and plants the sums in the rows
(``hf_ring.trainer.rows``); never hidden states or logits. TRL's own loss code then runs unchanged
on every rank, and the backward hands each rank the gradient of its own tokens, times ``P`` (DDP and FSDP
average gradients over the ``P`` ranks that hold one sequence's shards).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..ledger import LEDGER
from ..ops.cross_entropy import IGNORE_INDEX
from ..parallel import ContextParallel, context_parallel_state, setup_context_parallel
from ..transformers.batch import MULTIMODAL_KEYS, shard_batch
from ..transformers.context import CONTEXT_KEY
from ..transformers.sequence import gather_tokens, sequence_logprobs, sequence_sums
from .mesh import adopt_parallelism_config, parallelism_sizes
from .rows import pack_image_rows, pack_rows, plant_row_sums
from .trainer import RingTrainer, resolve_ulysses_size

__all__ = ["HeadOptions", "RingTrainerForTRL", "fused_forward", "refuse_unshiftable_images"]

_PASSED = ("input_ids", "attention_mask", "position_ids", "labels")
_PER_TOKEN = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")  # [B, N]
_DROPPED = ("use_cache", "return_dict", "logits_to_keep")


def _shift_left(x: Tensor, shift: Tensor) -> Tensor:
    """Each row ``b`` of ``x [B, N, ...]`` moved ``shift[b]`` places to the left (cyclically)."""
    n = x.shape[1]
    idx = (torch.arange(n, device=x.device)[None] + shift[:, None]) % n
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x))


def refuse_unshiftable_images(batch: dict[str, Tensor]) -> None:
    """Raise ``NotImplementedError`` for GRPO's image batches other than Qwen-style and Gemma 3 ones. Left-padded
    rows with images are moved to the right for the ring: exact where the model's positions come from the real
    tokens only, as Qwen's M-RoPE does (``get_rope_index`` reads ``input_ids``, ``mm_token_type_ids`` and
    ``image_grid_thw`` where ``attention_mask`` is 1; transformers 5.x ``modeling_qwen3_vl.py``), or where they
    enter only as differences, as Gemma 3's do (RoPE, sliding windows; its image blocks come from
    ``token_type_ids``, which move with the rows; ``modeling_gemma3.py``). Llama 4 (no grids, no
    ``token_type_ids``) scales queries by the absolute position in its NoPE layers: refused."""
    images = [k for k in MULTIMODAL_KEYS if k not in _PER_TOKEN and batch.get(k) is not None]
    known = ("image_grid_thw", "video_grid_thw", "token_type_ids")
    if images and all(batch.get(k) is None for k in known):
        raise NotImplementedError(
            f"hf_ring: GRPO's left-padded prompts with images ({', '.join(images)}) run under context parallelism "
            "for Qwen-style models (image_grid_thw, mm_token_type_ids: Qwen3-VL, Qwen3.5) and Gemma 3 "
            "(token_type_ids) only; Llama 4 is not exact there (its NoPE layers scale queries by the absolute "
            "position, which moving the left padding changes). Train this model's image prompts with cp_size=1."
        )


@dataclass(frozen=True)
class HeadOptions:
    """How ``ring_fused_head`` runs TRL's fused LM head over the CP group.

    ``stats``: the per-token fields TRL asked its head for besides ``log_probs``; ``temperature``:
    the one it divides the logits by; ``pad_token_id``: pads the rows to the zigzag's multiple;
    ``pack``: the batch's right-padded rows run as the documents of one row (``pack_rows``; with
    ``row_sums``, their sums are per document);
    ``row_sums``: TRL reads the outputs only through sums over each row's labelled tokens (DPO):
    each row's sums come from ``sequence_sums`` (a few floats per row over the CP group) and are
    planted in TRL's rows (``plant_row_sums``), no per-token value gathered; ``split``: from the
    label mask ``[R, N - 1]``, the positions whose log-probabilities TRL sums apart (DPO's
    ``ld_alpha`` tail), or ``None``."""

    stats: tuple[str, ...] = ()
    temperature: float = 1.0
    pad_token_id: int = 0
    pack: bool = False
    row_sums: bool = False
    split: Callable[[Tensor], Tensor] | None = None

    def __post_init__(self) -> None:
        if self.pack and not self.row_sums:
            raise ValueError("HeadOptions: pack=True needs row_sums=True (packed rows give per-document sums)")


def fused_forward(lm: nn.Module, state: ContextParallel, options: HeadOptions) -> Callable:
    """``lm.forward`` (TRL's, from ``add_fused_lm_head``) with its ``fused_lm_head=True`` calls run over the CP
    group of ``state``, as ``options`` say; every other call is TRL's. Bound to ``lm``, for the trainer to put
    in place for the duration of its model calls (``RingTrainerForTRL.model_calls``)."""
    inner = lm.forward

    @functools.wraps(inner)
    def forward(self: nn.Module, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return inner(*args, **kwargs)
        return _ring_forward(self, inner, state, args, kwargs, options)

    return types.MethodType(forward, lm)


def _ring_forward(
    lm: nn.Module, inner: Any, state: ContextParallel, args: tuple, kwargs: dict[str, Any], opt: HeadOptions
) -> Any:
    from trl.trainer.utils import FusedCausalLMOutput

    images = sorted(k for k in MULTIMODAL_KEYS if kwargs.get(k) is not None)
    allowed = (*_PASSED, *_DROPPED, *MULTIMODAL_KEYS)
    unknown = sorted(k for k in kwargs if k not in allowed and kwargs[k] is not None)
    if args or unknown or kwargs.get("labels") is None:
        raise NotImplementedError(
            "hf_ring: TRL's fused LM head under context parallelism takes input_ids, attention_mask, position_ids, "
            f"labels and image inputs only (this call passed {unknown or 'positional arguments or no labels'}); "
            "train this model with cp_size=1, or without the inputs it cannot shard (MoE router logits)."
        )
    batch = {k: kwargs[k] for k in (*_PASSED, *images) if kwargs.get(k) is not None}
    n = batch["input_ids"].shape[1]
    label_mask = kwargs["labels"][:, 1:] != IGNORE_INDEX
    if opt.row_sums:
        rows = batch["input_ids"].shape[0]
        tail = None if opt.split is None else opt.split(label_mask) & label_mask  # [R, N - 1]
        where = None if tail is None else torch.cat([tail, tail.new_zeros((rows, 1))], 1)  # [R, N]: by position
        if opt.pack:
            batch, keep = pack_image_rows(batch, lm) if images else pack_rows(batch)
            where = None if where is None else where[keep][None]
        sums = _sums(lm, inner, state, batch, opt, per_document=opt.pack, tail=where)
        full = plant_row_sums({k: v[:rows] for k, v in sums.items()}, label_mask, tail)
    else:
        mask = batch.get("attention_mask")
        shift = None
        if images:
            refuse_unshiftable_images(batch)
        if mask is not None and not bool(mask[:, 0].all()):  # left padding (GRPO's prompts): move it right
            if batch.get("position_ids") is not None:
                raise NotImplementedError("hf_ring: left padding together with position_ids is not supported")
            shift = (mask == 0).long().cumprod(1).sum(1)  # the leading zeros of each row
            # per-token tensors move with their rows; the images (pixel_values, grids) do not
            batch = {k: _shift_left(v, shift) if k in _PER_TOKEN else v for k, v in batch.items()}
        full = {k: v[:, :n] for k, v in _token_values(lm, inner, state, batch, opt).items()}
        if shift is not None:
            full = {k: _shift_left(v, -shift) for k, v in full.items()}
        full = {k: v[:, : n - 1] for k, v in full.items()}
    log_probs = full["log_probs"]
    loss = -log_probs.sum() / label_mask.sum().clamp(min=1)
    fields = {k: full.get(k) for k in ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")}
    if fields["is_top1"] is not None:
        fields["is_top1"] = fields["is_top1"].bool()
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, label_mask=label_mask, **fields)


def _local(
    lm: nn.Module, inner: Any, state: ContextParallel, batch: dict[str, Tensor], opt: HeadOptions
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The batch sharded over the CP group, and this rank's per-token values of its shard."""
    sharded = shard_batch(batch, group=state, pad_token_id=opt.pad_token_id)
    local = sequence_logprobs(lm, sharded, stats=opt.stats, temperature=opt.temperature, forward=inner)
    return sharded, local


def _token_values(
    lm: nn.Module, inner: Any, state: ContextParallel, batch: dict[str, Tensor], opt: HeadOptions
) -> dict[str, Tensor]:
    """Per-token values ``[B, N_layout]`` of the full ``batch``, gathered over the CP group (the
    backward: this rank's tokens' gradient, times ``P``)."""
    sharded, local = _local(lm, inner, state, batch, opt)
    ctx = sharded[CONTEXT_KEY]
    return {k: gather_tokens(ctx, v, grad_scale=float(ctx.size)) for k, v in local.items()}


def _sums(
    lm: nn.Module,
    inner: Any,
    state: ContextParallel,
    batch: dict[str, Tensor],
    opt: HeadOptions,
    per_document: bool,
    tail: Tensor | None = None,
) -> dict[str, Tensor]:
    """Sums of each field over each row's (or packed document's) labelled tokens, ``[R]`` per field,
    over the CP group (the backward: this rank's tokens' gradient, times ``P``). ``tail``: ``[B, N]``
    of ``batch``, the positions whose log-probabilities are summed apart (``log_probs_tail``)."""
    sharded, local = _local(lm, inner, state, batch, opt)
    ctx = sharded[CONTEXT_KEY]
    labelled = sharded["shift_labels"] != IGNORE_INDEX
    names = ["log_probs", *opt.stats]
    weights = {k: labelled.float() for k in names}
    if tail is not None:
        pos = ctx.layout.index(labelled.shape[0], labelled.device)[ctx.rank]  # [B, S_local]; >= N: padding
        local_tail = tail.gather(1, pos.clamp(max=tail.shape[1] - 1)) & (pos < tail.shape[1]) & labelled
        weights["log_probs"] = (labelled & ~local_tail).float()
        weights["log_probs_tail"] = local_tail.float()
        names.append("log_probs_tail")
    values = torch.stack([local[k.removesuffix("_tail")].float() * weights[k] for k in names], -1)  # [B, S, K]
    sums = sequence_sums(ctx, values, per_document=per_document, grad_scale=float(ctx.size))
    sums = sums[0] if per_document else sums  # one packed row: [D, K], its documents are the rows
    return dict(zip(names, sums.unbind(-1), strict=True))


class RingTrainerForTRL(RingTrainer):
    """What TRL's trainers on the fused LM head share under CP (``RingDPOTrainer``, ``RingGRPOTrainer``):
    the CP group set up before TRL's ``__init__`` (which may already run the model: precomputed
    reference log-probabilities); the trainer's own model calls (``model_calls``: its training and
    prediction steps) run TRL's fused heads over the CP group; TRL's ``compute_loss`` and
    ``prediction_step`` (not ``RingTrainer``'s causal-LM loss)."""

    _cp: ContextParallel | None
    _fused_pack = False  # RingDPOTrainer with padding_free=True
    _fused_row_sums = False  # RingDPOTrainer: per-row sums, no gathered tokens
    _fused_split: Callable[[Tensor], Tensor] | None = None  # RingDPOTrainer with ld_alpha

    def _ring_init(self, model: Any, args: Any, stats: tuple[str, ...], temperature: float = 1.0, **kw: Any) -> None:
        name = type(self).__name__
        if isinstance(model, str):
            raise TypeError(f'{name}: pass the model loaded with attn_implementation="ring" (after `import hf_ring`), '
                            "not its name.")  # fmt: skip
        self._fused_stats, self._fused_temperature = stats, temperature
        requested = kw.get("cp_size") or getattr(args, "cp_size", None)
        self._parallelism = parallelism_sizes(args)  # checked by RingTrainer.__init__ against the launch
        cp_size = adopt_parallelism_config(args, requested) or 1
        ulysses = kw.get("ulysses_size") or getattr(args, "ulysses_size", None) or 1
        self._cp = context_parallel_state()
        if cp_size > 1 and self._cp is None and model is not None:
            if ulysses == "auto":
                ulysses = resolve_ulysses_size(model, cp_size)
            self._cp = setup_context_parallel(cp_size, ulysses_size=ulysses, timeout=args.ddp_timeout_delta)
        RingTrainer.__init__(self, model, args, **kw)
        # TRL's trainer says whether its loss is scaled for gradient accumulation (a class attribute)
        self.__dict__.pop("loss_is_scaled_for_ga", None)
        # the CP ranks of a group report the same tokens: TRL divides gathered token counts by this
        self._tp_size = getattr(self, "_tp_size", 1) * self.cp_size

    @contextlib.contextmanager
    def model_calls(self) -> Iterator[None]:
        """For the duration of the block, the fused LM heads of the policy and the reference (TRL's
        ``add_fused_lm_head``) run over the CP group (``fused_forward``): scoped ledger entries, undone
        when the block ends, so that outside the trainer's steps the models are TRL's."""
        from accelerate.utils import is_peft_model

        cp = self._cp
        if cp is None or cp.cp_size == 1:
            yield
            return
        options = HeadOptions(self._fused_stats, self._fused_temperature, pack=self._fused_pack,
                              row_sums=self._fused_row_sums, split=self._fused_split)  # fmt: skip
        with LEDGER.scoped() as scope:
            for m in (getattr(self, "model", None), getattr(self, "ref_model", None)):
                if m is not None:
                    lm = self.accelerator.unwrap_model(m) if hasattr(self, "accelerator") else m
                    lm = lm.get_base_model() if is_peft_model(lm) else lm
                    scope.set_attr(lm, "forward", fused_forward(lm, cp, options), why=WHY)
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.model_calls():
            return super().training_step(*args, **kwargs)

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return super(RingTrainer, self).compute_loss(model, inputs, *args, **kwargs)

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.model_calls():
            return super(RingTrainer, self).prediction_step(*args, **kwargs)


WHY = ("`RingTrainerForTRL.model_calls`: during the trainer's steps, TRL's fused LM head runs over the CP group "
       "(`fused_forward`); TRL's own forward again after each")  # fmt: skip
