"""Greedy generation with context-parallel prefill and the KV cache sharded across the CP group.

``greedy_generate(model, input_ids, max_new_tokens)`` returns what one process's
``model.generate(input_ids, do_sample=False, max_new_tokens=...)`` returns after the prompt, with
every rank of the CP group holding ``1/P`` of the prompt's keys and values:

1. the prompt's first ``N0`` tokens (the largest multiple of ``shard_batch``'s ``2P`` -- ``R * lcm(2, U)``
   with Ulysses -- below ``N``) are prefilled with ``shard_batch``, as in training (ring or Ulysses x
   ring attention; Gated DeltaNet states and short-convolution rows handed along the ring); their
   ``RingContext`` carries a ``decode.DecodeStep`` whose ``ShardedCache`` keeps this rank's keys and
   values, and the state every recurrent layer has after token ``N0 - 1``; no logits are computed;
2. the rest of the prompt (1 to ``2P`` tokens), then each generated token, runs on every rank
   (replicated, ``use_cache=False``, global ``position_ids``); its attention reads every rank's shard
   through one all-gather of partial results per layer (``ops.decode.decode_attention``);
3. the next token is the argmax of the last logits, taken on CP rank 0 and broadcast to the group, so
   the ranks never disagree.

One prompt per batch row, all of one length: padding (an ``attention_mask`` with zeros) and packed
prompts (``position_ids`` that restart at 0) are refused. Rows that end with ``eos_token_id`` get
``pad_token_id`` after it, as ``generate`` does; generation stops when every row has ended.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..ops.comm import group_size_rank
from ..ops.layout import sequence_layout
from ..ops.zigzag import hybrid_multiple
from ..parallel import ContextParallel, context_parallel_state
from ..transformers import decode
from ..transformers.batch import shard_batch
from ..transformers.context import CONTEXT_KEY, RingContext
from .runtime import EvalError, check_ring

__all__ = ["greedy_generate"]


def _grid(group: ContextParallel | dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int, int]:
    """(process group, size, rank, Ulysses size) of ``group`` (``None``: the last
    ``setup_context_parallel``'s, else the world)."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = context_parallel_state()
    pg, ulysses = (group.cp_group, group.ulysses_size) if isinstance(group, ContextParallel) else (group, 1)
    size, rank = group_size_rank(pg)
    return pg, size, rank, ulysses


def _check_prompts(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise EvalError(f"greedy_generate takes input_ids [B, N] with N >= 1, got {tuple(input_ids.shape)}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise EvalError(
            "greedy_generate: attention_mask has zeros (padding); decoding under context parallelism takes one "
            "prompt per row, all of one length: generate rows of other lengths one at a time"
        )
    if position_ids is not None:
        want = torch.arange(input_ids.shape[1], device=position_ids.device).expand_as(input_ids)
        if position_ids.shape[-1] != input_ids.shape[1] or not bool((position_ids == want).all()):
            raise EvalError(
                "greedy_generate: position_ids other than 0, 1, 2, ... per row (packed prompts restart at 0) are "
                "not decoded: a generated token would continue only the last document. Pass each prompt as its "
                "own row, or one at a time."
            )


def greedy_generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    group: ContextParallel | dist.ProcessGroup | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    scores: list[Tensor] | None = None,
) -> Tensor:
    """The greedy continuation ``[B, T]`` (``T <= max_new_tokens``) of ``input_ids [B, N]``.

    Every rank of ``group`` (a ``ContextParallel``, a process group, or ``None``: the last
    ``setup_context_parallel``'s, else the world) passes the same prompts and gets the same tokens.
    ``model``: loaded with ``attn_implementation="ring"``, in eval mode. ``attention_mask`` and
    ``position_ids`` are accepted only when they say nothing else (no padding, no packing). ``scores``: a
    list that gets each step's last logits ``[B, V]`` (float32), as ``generate(output_scores=True)``'s.
    Raises ``EvalError`` / ``RingNotSupported`` for what is not computed exactly."""
    check_ring(model, "greedy_generate")
    decode.check_model(model)
    _check_prompts(input_ids, attention_mask, position_ids)
    if max_new_tokens < 1:
        raise EvalError(f"greedy_generate: max_new_tokens {max_new_tokens}: give at least 1")
    pg, size, rank, ulysses = _grid(group)
    multiple = hybrid_multiple(size, ulysses)
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    b, n = ids.shape
    n0 = (n - 1) // multiple * multiple
    cache = decode.ShardedCache(prompt=n0)
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []), device=device)
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    layout = sequence_layout(multiple, size // ulysses, ulysses)  # decoding forwards shard nothing
    new: list[Tensor] = []
    with torch.no_grad():
        if n0:
            kwargs = shard_batch({"input_ids": ids[:, :n0]}, group=pg if ulysses == 1 else group)
            prefill = kwargs[CONTEXT_KEY]
            prefill.decode = decode.DecodeStep(cache)
            model(**kwargs, logits_to_keep=torch.empty(0, dtype=torch.long, device=device))
            prefill.decode.check_calls()
        done = torch.zeros(b, dtype=torch.bool, device=device)
        tokens, pos = ids[:, n0:], torch.arange(n0, n, device=device)
        for t in range(max_new_tokens):
            prev = cache.tail_positions
            cache.tail_positions = pos if prev is None else torch.cat((prev, pos))
            step = decode.DecodeStep(cache, decoding=True, positions=pos)
            ctx = RingContext(pg, size, rank, layout, positions_given=True, decode=step)
            logits = model(input_ids=tokens, position_ids=pos.expand(b, -1), use_cache=False, ring_context=ctx,
                           logits_to_keep=1).logits[:, -1]  # fmt: skip
            step.check_calls()
            if scores is not None:
                scores.append(logits.float().cpu())
            nxt = logits.argmax(-1)
            if size > 1:  # CP rank 0's choice for every rank
                dist.broadcast(nxt, group=pg, group_src=0)
            if len(eos):
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                done |= torch.isin(nxt, eos)
            new.append(nxt)
            if bool(done.all()):
                break
            tokens, pos = nxt[:, None], torch.tensor([n + t], device=device)
    return torch.stack(new, dim=1).cpu()
