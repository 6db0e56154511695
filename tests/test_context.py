"""The per-batch RingContext: made by shard_batch, read by the attention function and the loss.

The "a sharded batch never reached ring attention (or a context-parallel mixer)" guard is per
forward: it holds after a forward without labels, under activation-checkpoint recompute, and when a
context is reused; the hidden states the chunked loss keeps belong to the model's chunked loss,
not to the context, and are freed by the loss.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.transformers.context import CONTEXT_KEY, RingContext
from hf_ring.transformers.loss import CHUNKED
from testkit.models import tiny_batch, tiny_model
from testkit.spawn import run_ranks

NEVER_RAN = "never ran ring attention"


def test_shard_batch_makes_one_context_per_batch() -> None:
    batch = tiny_batch(2, 12)
    a, b = hf_ring.shard_batch(batch), hf_ring.shard_batch({"input_ids": batch["input_ids"]})
    assert isinstance(a[CONTEXT_KEY], RingContext) and a[CONTEXT_KEY] is not b[CONTEXT_KEY]
    assert a[CONTEXT_KEY].labelled and not b[CONTEXT_KEY].labelled
    assert (a[CONTEXT_KEY].size, a[CONTEXT_KEY].rank, a[CONTEXT_KEY].grad_scale) == (1, 0, 1.0)
    assert hf_ring.shard_batch(batch, dp_size=3)[CONTEXT_KEY].grad_scale == 3.0


def _loss_or_error(model: torch.nn.Module, kwargs: dict) -> str:
    try:
        model(**kwargs).loss.backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def guard_cases() -> dict[str, str]:
    batch = tiny_batch(2, 20)
    ring, sdpa = tiny_model("llama", "ring"), tiny_model("llama", "sdpa")
    out: dict[str, str] = {}
    # a forward without labels through the ring model leaves nothing behind for the next batch
    with torch.no_grad():
        ring(**hf_ring.shard_batch({"input_ids": batch["input_ids"]}))
    out["after unlabelled forward"] = _loss_or_error(sdpa, hf_ring.shard_batch(batch))
    # the recompute of a checkpointed ring model counts on its own batch's context only
    ckpt = tiny_model("llama", "ring")
    hf_ring.enable_activation_checkpointing(ckpt)
    ckpt.train()
    kwargs = hf_ring.shard_batch(batch)
    out["checkpointed ring"] = _loss_or_error(ckpt, kwargs)
    out["calls after backward"] = str(kwargs[CONTEXT_KEY].cross_rank_calls.attention)
    out["after recompute"] = _loss_or_error(sdpa, hf_ring.shard_batch(batch))
    # a context that already saw ring attention does not vouch for another model
    reused = hf_ring.shard_batch(batch)
    ring(**reused)
    out["reused context"] = _loss_or_error(sdpa, reused)
    return out


def test_never_ran_guard_is_per_batch() -> None:
    for r in run_ranks(2, guard_cases):
        assert NEVER_RAN in r["after unlabelled forward"]
        assert r["checkpointed ring"] == "no error"
        assert r["calls after backward"] == "2"  # one per layer in forward; the recompute adds none
        assert NEVER_RAN in r["after recompute"]
        assert NEVER_RAN in r["reused context"]


def chunked_hidden_states_freed() -> list[bool]:
    model = tiny_model("qwen3", "ring")
    hf_ring.enable_chunked_loss(model)
    kwargs = hf_ring.shard_batch(tiny_batch(2, 20))
    out = model(**kwargs)
    return [out.logits.shape[1] == 0, len(CHUNKED[model].kept) == 0, not hasattr(kwargs[CONTEXT_KEY], "_chunked")]


def test_chunked_loss_takes_the_hidden_states_it_kept() -> None:
    for r in run_ranks(2, chunked_hidden_states_freed):
        assert r == [True, True, True]


def test_context_is_only_read_from_kwargs() -> None:
    """One process: the attention function counts its calls on the batch's context and nowhere else."""
    model = tiny_model("llama", "ring")
    ids = {"input_ids": tiny_batch(1, 9)["input_ids"]}  # no labels: no loss takes the count
    a, b = hf_ring.shard_batch(ids), hf_ring.shard_batch(ids)
    model(**a)
    assert a[CONTEXT_KEY].cross_rank_calls.attention == 2 and b[CONTEXT_KEY].cross_rank_calls.total == 0


@pytest.mark.parametrize("labelled", [True, False])
def test_model_without_context_still_runs(labelled: bool) -> None:
    """A model called without its ring_context runs as one process on what it is given."""
    batch = tiny_batch(1, 10)
    kwargs = {k: v for k, v in hf_ring.shard_batch(batch).items() if k != CONTEXT_KEY}
    if not labelled:
        kwargs = {"input_ids": kwargs["input_ids"], "position_ids": kwargs["position_ids"]}
    out = tiny_model("llama", "ring")(**kwargs)
    assert out.logits.shape[1] == 10
