"""Gradients under autocast against float64, on a model that predicts its targets confidently.

Under bf16 autocast with float32 weights, a path that computes some of its backward in another
precision than its forward (a recompute outside autocast) gives gradients that disagree with its own
forward; with confidently predicted targets (``p_t`` near 1, late in fine-tuning) that shows up as
gradients several times further from float64 than those of the plain path, while random targets hide
it. ``confident_model`` trains a tiny model on one batch until it predicts the batch's next tokens
with median probability above ``confidence``; ``grad_errors`` gives the relative error of every
parameter gradient of one step against the same step in float64 without autocast.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hf_ring
from hf_ring.transformers.loss import CHUNKED
from testkit.models import tiny_model
from testkit.oracle import rel_err


def confident_model(
    vocab: int = 512, n: int = 96, batch: int = 2, confidence: float = 0.9, seed: int = 3, max_steps: int = 400
) -> tuple[torch.nn.Module, dict, float]:
    """A tiny float32 Llama (``attn_implementation="ring"``) trained with Adam on one batch of random
    tokens until the median probability of its next-token targets exceeds ``confidence``.
    Returns ``(model, batch, median target probability)``; raises if ``max_steps`` do not get there."""
    model = tiny_model("llama", "ring", vocab_size=vocab)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, n), generator=g)
    data = {"input_ids": ids, "labels": ids.clone()}
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(max_steps):
        out = model(**hf_ring.shard_batch(data, full_logits=True))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            median = float(target_probability(out.logits, ids).median())
        if median > confidence:
            model.zero_grad(set_to_none=True)
            return model, data, median
    raise RuntimeError(f"confident_model: median target probability {median:.2f} after {max_steps} steps")


def target_probability(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, N - 1]`` probability of each next token under ``logits [B, >= N, V]``."""
    logp = F.log_softmax(logits[:, : ids.shape[1] - 1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1).exp()


def step_gradients(
    model: torch.nn.Module, batch: dict, setup: Callable | None = None, autocast: torch.dtype | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and float64 gradients (by name) of one step of a copy of ``model`` on ``batch`` through
    ``shard_batch`` (one process), after ``setup(copy)`` (e.g. ``hf_ring.enable_chunked_loss``),
    under CPU autocast to ``autocast`` when given."""
    m = copy.deepcopy(model)
    if setup is not None:
        setup(m)
    m.train()
    chunked = m in CHUNKED
    with torch.autocast("cpu", autocast or torch.bfloat16, enabled=autocast is not None):
        out = m(**hf_ring.shard_batch(batch, full_logits=not chunked))
    out.loss.backward()
    return out.loss.detach().double(), {n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None}


def grad_errors(
    model: torch.nn.Module, batch: dict, setup: Callable | None = None, autocast: torch.dtype = torch.bfloat16
) -> dict[str, float]:
    """Relative error against float64 (the plain path, no autocast) of the loss (key ``"loss"``) and
    of every parameter gradient (by name) of one step under ``autocast`` after ``setup``."""
    ref_loss, ref = step_gradients(copy.deepcopy(model).double(), batch)
    loss, grads = step_gradients(model, batch, setup, autocast)
    assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
    return {"loss": rel_err(loss, ref_loss), **{n: rel_err(grads[n], ref[n]) for n in ref}}


class GemmDtypes(TorchDispatchMode):
    """Records the dtypes of the operands of every matrix product (``mm``, ``addmm``, ``bmm``, ...)
    run while it is active: ``gemms`` is a list of ``(op name, operand dtypes)``."""

    OPS = {"mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "_addmm_activation"}

    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func.overloadpacket.__name__
        if name in self.OPS:
            self.gemms.append((name, tuple(a.dtype for a in args if torch.is_tensor(a))))
        return func(*args, **(kwargs or {}))
