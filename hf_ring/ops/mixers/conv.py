"""The context-parallel form of a depthwise causal convolution: the short convolutions of hybrid
token mixers (Gated DeltaNet, Mamba, Mamba2, LFM2's ShortConv, ...).

A causal convolution of kernel ``K`` reads the ``w = K - 1`` rows before each output row. On a shard
the local rows come in runs (``ShardLayout.runs``: consecutive global positions of one document), so
only the first ``min(len, w)`` outputs of each run need rows the rank does not hold -- or must not
see (the end of another chunk, another document). ``causal_conv1d``:

1. runs the convolution on the local rows as if they were one sequence (the installed kernel:
   causal-conv1d on CUDA, or transformers' torch fallback);
2. fetches the ``w`` rows before each run, within its document, from the ranks that hold them
   (``ops.exchange.halo_plan``: one ``all_to_all_single``; fewer rows near a document start, where
   the convolution restarts from zeros; a halo reaches over several runs and ranks when runs are
   shorter than the kernel);
3. recomputes each run's first ``min(len, w)`` outputs from ``[zeros, halo, first rows]`` (one
   batched call of the same kernel on ``[runs, C, 2w]``) and writes them over step 1's::

       run of rank r:        h h h | x0 x1 x2 x3 ...      (h: halo rows, K = 4)
       recomputed outputs:           y0 y1 y2             (y3 on: step 1's outputs are right)

Forward and backward are exact (the gradient of each fetched row goes back to its owner). This
module imports only torch; the group is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..exchange import RowPlan, check_device, fetch_rows, halo_plan, on_device, tie
from ..layout import ShardLayout

__all__ = ["ConvPlan", "causal_conv1d", "conv_plan", "torch_causal_conv1d"]

Conv = Callable[..., Tensor]  # (x [B, C, S], weight [C, K], bias [C] | None, activation=...) -> [B, C, S]


def torch_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """Depthwise causal convolution, as transformers' torch fallback of ``causal_conv1d_fn``:
    ``x [B, C, S]``, ``weight [C, K]``, ``bias [C]``; ``activation`` ``None``, ``"silu"`` or
    ``"swish"``. Computes in ``weight``'s dtype; returns ``[B, C, S]`` in ``x``'s dtype."""
    k = weight.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=k - 1, groups=x.shape[1])[..., : x.shape[-1]]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"torch_causal_conv1d: activation {activation!r} is not 'silu', 'swish' or None")
    return out.to(x.dtype)


@dataclass(frozen=True, eq=False)
class ConvPlan:
    """One rank's halo exchange and recompute for a convolution of reach ``width`` (``K - 1``) over a
    batch of ``batch`` rows (derived from the layout alone; made once per batch).

    ``keep``: flat local rows (``b * S_local + t``) that some rank's halo wants from this rank;
    ``fetch``: the halo exchange over those rows only (so nothing but them is copied);
    ``heads``: flat local rows of the first ``min(len, width)`` rows of each recomputed run;
    ``piece``: ``[R, 2 * width]`` indices into ``cat(fetched, heads rows, one zero row)``: each
    recomputed run's ``[zeros, halo, first rows, zeros]``;
    ``dst_b``, ``dst_t``, ``src_r``, ``src_t``: output ``[dst_b, :, dst_t]`` takes the recomputed
    ``[src_r, :, width + src_t]``. Every index tensor lives on ``device`` (``conv_plan(..., device=)``),
    so a layer copies nothing from the host.
    """

    width: int
    batch: int
    local: int
    keep: Tensor
    fetch: RowPlan
    heads: Tensor
    piece: Tensor
    dst_b: Tensor
    dst_t: Tensor
    src_r: Tensor
    src_t: Tensor
    device: torch.device


def conv_plan(
    layout: ShardLayout, batch: int, rank: int, width: int, device: torch.device | str | None = None
) -> ConvPlan:
    """The plan of ``causal_conv1d`` with kernel ``width + 1`` on CP rank ``rank``, its index tensors
    on ``device`` (default: the host; make it once per batch, e.g. ``RingContext.cached``)."""
    halo = halo_plan(layout, batch, rank, width)
    plan = halo.plan
    keep = torch.unique(torch.cat(plan.send)) if plan.send else torch.zeros(0, dtype=torch.long)
    where = {int(v): i for i, v in enumerate(keep.tolist())}
    send = tuple(torch.tensor([where[int(v)] for v in s.tolist()], dtype=torch.long) for s in plan.send)
    fetch = RowPlan(plan.rank, plan.size, send, plan.recv, plan.order, plan.count).to(device)
    heads: list[int] = []
    piece: list[list[int]] = []
    dst_b: list[int] = []
    dst_t: list[int] = []
    src_r: list[int] = []
    src_t: list[int] = []
    n_fetched = plan.count
    rows = []
    for i, run in enumerate(halo.runs):
        lo, hi = halo.offsets[i], halo.offsets[i + 1]
        if run.local == 0 and hi == lo:
            continue  # a document starts at local row 0: the local convolution is already right
        m = min(run.length, width)
        rows.append((run, lo, hi, m))
    zero = n_fetched + sum(m for *_, m in rows)
    for r, (run, lo, hi, m) in enumerate(rows):
        h = hi - lo
        first = n_fetched + len(heads)
        heads.extend(run.row * layout.local + run.local + j for j in range(m))
        piece.append([zero] * (width - h) + list(range(lo, hi)) + list(range(first, first + m)) + [zero] * (width - m))
        for j in range(m):
            dst_b.append(run.row)
            dst_t.append(run.local + j)
            src_r.append(r)
            src_t.append(width + j)

    def t(v: list | Tensor) -> Tensor:
        return on_device(torch.as_tensor(v, dtype=torch.long), device)

    return ConvPlan(
        width=width, batch=batch, local=layout.local, keep=t(keep), fetch=fetch, heads=t(heads),
        piece=t(piece).view(len(piece), 2 * width), dst_b=t(dst_b), dst_t=t(dst_t), src_r=t(src_r), src_t=t(src_t),
        device=torch.device(device or "cpu"),
    )  # fmt: skip


def _rows(x: Tensor, flat: Tensor, local: int) -> Tensor:
    """``x [B, C, S]`` at flat rows ``b * S + t`` -> ``[len(flat), C]``."""
    return x[flat // local, :, flat % local]


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None,
    plan: ConvPlan,
    group: dist.ProcessGroup | None,
    conv: Conv = torch_causal_conv1d,
) -> Tensor:
    """The causal convolution of the whole (sharded) sequence, this rank's rows.

    Args:
        x: ``[B, C, S_local]``, this rank's rows (``S_local = layout.local``).
        weight, bias, activation: ``[C, K]``, ``[C]`` or ``None``, ``None`` / ``"silu"`` / ``"swish"``.
        plan: ``conv_plan(layout, B, rank, K - 1)`` (the same on every call of one batch).
        group: the CP group of the layout.
        conv: the local kernel, called as ``conv(x, weight, bias, activation=activation)`` on
            ``[B, C, S_local]`` and on ``[runs, C, 2 (K - 1)]`` (causal-conv1d's
            ``causal_conv1d_fn``, transformers' fallback, ``torch_causal_conv1d``).

    Returns ``[B, C, S_local]``: each row's output as the convolution over its document in global
    order (zeros before the document's first token). Padding rows (in no run) get whatever the
    local convolution gives. Collective over ``group`` when ``K > 1`` (one all-to-all forward, one
    backward).
    """
    b, c, s = x.shape
    if weight.shape[-1] - 1 != plan.width or b != plan.batch or s != plan.local:
        raise ValueError(
            f"causal_conv1d: input [B={b}, S={s}] with kernel {weight.shape[-1]} does not match its plan "
            f"(B={plan.batch}, S_local={plan.local}, kernel {plan.width + 1})"
        )
    check_device(plan.device, x, "causal_conv1d", "conv_plan")
    out = conv(x, weight, bias, activation=activation)
    if plan.width == 0:
        return out
    sent = _rows(x, plan.keep, s) if len(plan.keep) else x[:, :, 0][:0]  # [U, C] (a view of x when empty)
    fetched = fetch_rows(sent.unsqueeze(0), plan.fetch, group)  # [M, C]
    if plan.fetch.size > 1:  # the exchange's backward is collective: every rank's output depends on it
        out = tie(out, fetched)
    if not len(plan.piece):
        return out
    src = torch.cat((fetched, _rows(x, plan.heads, s), x.new_zeros((1, c))))
    pieces = src[plan.piece].transpose(1, 2).contiguous()  # [R, C, 2w]
    fixed = conv(pieces, weight, bias, activation=activation)
    values = fixed[plan.src_r, :, plan.src_t]  # [F, C]
    if plan.fetch.size == 1:
        out = out.clone()
    out[plan.dst_b, :, plan.dst_t] = values.to(out.dtype)
    return out
