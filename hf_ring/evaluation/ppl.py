"""Loss by position: does the model predict late tokens of a long document better than early ones?

Each document of at least ``seq_len`` tokens is cut to its first ``seq_len`` and read once with
context-parallel prefill. Every rank computes the negative log-likelihood of the next token at the
positions it holds, from the LM head's input and the LM head *in chunks* (no ``[tokens, vocab]``
logits: at 1M tokens and a 128K vocabulary they would take 512 GB in float32), with what the model
does between its head and its logits (a soft-cap, a scale: ``hf_ring.transformers.logits``), and
adds them into position buckets; a ``[2, buckets]`` tensor of sums and counts is summed over the
CP group, then over the documents and the DP replicas (which split the documents).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import RingNotSupported
from ..ledger import LEDGER
from ..ops.cross_entropy import default_chunk_size
from ..transformers.batch import shard_batch
from ..transformers.context import CONTEXT_KEY
from ..transformers.logits import logits_transform
from ..transformers.patches import causal_lm, decoder
from .runtime import EvalError, Runtime, check_ring, progress, read_jsonl

__all__ = ["bucket_table", "documents", "evaluate_ppl", "position_nll"]


def documents(
    path: str, seq_len: int, tokenizer: Any = None, field: str = "text", limit: int | None = None
) -> tuple[Iterator[Tensor], dict[str, int]]:
    """The first ``seq_len`` tokens ``[seq_len]`` of every document in the JSON-lines file ``path``
    that has that many (``input_ids`` per line, or text under ``field`` with a ``tokenizer``), at
    most ``limit`` of them; and the counts ``{"documents", "skipped_short", "longest"}``.

    The file is read twice: once here to count (so that an empty selection fails before the model
    is loaded), and once by the iterator."""

    def ids_of(i: int, record: dict[str, Any]) -> list[int]:
        if "input_ids" in record:
            return record["input_ids"]
        if field in record:
            if tokenizer is None:
                raise EvalError(f"{path}: line {i} has text ({field!r}) but no tokenizer was found (give --tokenizer)")
            return tokenizer(record[field])["input_ids"]
        raise EvalError(f"{path}: line {i} has neither input_ids nor {field!r}")

    counts = {"documents": 0, "skipped_short": 0, "longest": 0}
    for i, record in enumerate(read_jsonl(path), 1):
        n = len(ids_of(i, record))
        counts["longest"] = max(counts["longest"], n)
        if n < seq_len:
            counts["skipped_short"] += 1
        elif limit is None or counts["documents"] < limit:
            counts["documents"] += 1
    if counts["documents"] == 0:
        raise EvalError(f"{path}: no document has --seq-len {seq_len} tokens (the longest has {counts['longest']})")

    def it() -> Iterator[Tensor]:
        taken = 0
        for i, record in enumerate(read_jsonl(path), 1):
            ids = ids_of(i, record)
            if len(ids) >= seq_len and taken < counts["documents"]:
                taken += 1
                yield torch.tensor(ids[:seq_len], dtype=torch.long)

    return it(), counts


def check_head(model: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """What ``model`` does between its LM head and its logits, as a function of a chunk of the head's
    output (``None``: nothing); ``EvalError`` for a model whose logits cannot be computed in chunks."""
    lm = causal_lm(model, "hf-ring eval ppl")
    try:
        return logits_transform(lm, decoder(lm, "hf-ring eval ppl"), "hf-ring eval ppl")
    except RingNotSupported as e:
        raise EvalError(f"{e} eval ppl computes the logits in chunks and cannot evaluate this model.") from None


class _HeadInput:
    """LM head forward pre-hook: keeps its input ``[B, S_local, H]`` and hands the head zero positions."""

    def __init__(self) -> None:
        self.hidden: Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        self.hidden = args[0]
        return (args[0][..., :0, :], *args[1:])


_PROBE: Any = object()  # position_nll probes the model itself


def position_nll(
    model: nn.Module,
    ids: Tensor,
    bucket_size: int,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    transform: Callable[[Tensor], Tensor] | None = _PROBE,
) -> Tensor:
    """Next-token NLL of the document ``ids [N]`` summed by position bucket, after one prefill.

    The target at position ``t`` (``1 <= t < N``) goes to bucket ``t // bucket_size``. Every rank of
    ``group`` (the CP group; ``None``: the default one) passes the same ``ids``; each computes the
    NLL at the positions it holds, ``chunk_size`` rows of logits at a time, with ``transform`` (the
    model's logits from its head's output, ``check_head``; probed here when not given). Returns on every rank
    ``[2, ceil(N / bucket_size)]`` float64: the summed NLL and the number of targets per bucket."""
    lm = causal_lm(model, "hf-ring eval ppl")
    if transform is _PROBE:
        transform = check_head(model)
    head = lm.get_output_embeddings()
    n = ids.shape[0]
    device = next(model.parameters()).device
    kwargs = shard_batch({"input_ids": ids[None].to(device)}, group=group)
    ctx = kwargs[CONTEXT_KEY]
    pos = kwargs["position_ids"][0]  # global positions [S_local]; padding rows are >= N
    keep = (pos + 1 < n).nonzero().squeeze(1)
    target = ids.to(device)[pos[keep] + 1]
    hook = _HeadInput()
    with torch.no_grad(), LEDGER.scoped() as scope:  # the head's hook for this call only
        scope.hook(head, head.register_forward_pre_hook(hook), why="hf-ring eval ppl: the LM head's input")
        model(**kwargs)
    if ctx.cross_rank_calls.total == 0 or hook.hidden is None:
        raise EvalError(
            "the model never ran ring attention or a context-parallel token mixer (it computes attention "
            "itself); load a model that uses transformers' attention registry with attn_implementation='ring'"
        )
    hidden = hook.hidden[0].index_select(0, keep)  # [K, H]
    chunk = int(chunk_size or default_chunk_size(int(lm.config.vocab_size)))
    nll = torch.empty(len(keep), dtype=torch.float64, device=device)
    with torch.no_grad():
        for s in range(0, len(keep), chunk):
            logits = head(hidden[s : s + chunk])  # [chunk, V]
            logits = (transform(logits) if transform is not None else logits).float()
            picked = logits.gather(1, target[s : s + chunk, None]).squeeze(1)
            nll[s : s + chunk] = (logits.logsumexp(-1) - picked).double()
            del logits
    out = torch.zeros(2, -(-n // bucket_size), dtype=torch.float64, device=device)
    bucket = (pos[keep] + 1) // bucket_size
    out[0].index_add_(0, bucket, nll)
    out[1].index_add_(0, bucket, torch.ones_like(nll))
    if ctx.size > 1:
        dist.all_reduce(out, group=ctx.group)
    return out.cpu()


def evaluate_ppl(
    model: nn.Module,
    docs: Iterator[Tensor],
    n_docs: int,
    seq_len: int,
    buckets: int,
    rt: Runtime,
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """``{"bucket_size", "buckets": [{"start", "end", "tokens", "loss", "ppl"}], "loss", "ppl"}``
    over ``n_docs`` documents of ``seq_len`` tokens, split over the DP replicas; on every rank."""
    check_ring(model, "hf-ring eval ppl")
    transform = check_head(model)
    if not 1 <= buckets <= seq_len:
        raise EvalError(f"--buckets {buckets} must be between 1 and --seq-len {seq_len}")
    bucket_size = -(-seq_len // buckets)
    total = torch.zeros(2, -(-seq_len // bucket_size), dtype=torch.float64)
    mine = set(rt.mine(range(n_docs)))
    local = (d for i, d in enumerate(docs) if i in mine)
    for ids in progress(local, rt, "ppl", unit="doc", count=len(mine)):
        total += position_nll(model, ids, bucket_size, rt.cp_group, chunk_size, transform)
    total = rt.reduce_dp(total.to(rt.device)).cpu()
    return bucket_table(total, bucket_size, seq_len)


def bucket_table(total: Tensor, bucket_size: int, seq_len: int) -> dict[str, Any]:
    """The JSON rows of ``total [2, buckets]`` (summed NLL, target counts)."""
    import math

    rows = []
    for b in range(total.shape[1]):
        count = int(total[1, b])
        loss = float(total[0, b] / count) if count else None
        rows.append(
            {
                "start": b * bucket_size,
                "end": min(seq_len, (b + 1) * bucket_size),
                "tokens": count,
                "loss": loss,
                "ppl": math.exp(loss) if loss is not None else None,
            }
        )
    loss = float(total[0].sum() / total[1].sum())
    return {"bucket_size": bucket_size, "buckets": rows, "loss": loss, "ppl": math.exp(loss)}
