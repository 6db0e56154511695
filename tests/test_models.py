"""Model level: one training step with attn_implementation="ring" and CP in {2, 4} against the
same step on one process with sdpa attention in float64 (loss on every rank, every gradient)."""

from __future__ import annotations

import pytest
import torch

from testkit.models import FAMILIES, tiny_batch, train_step
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
N = 37  # not a multiple of 2P for P in {2, 3, 4}


def model_errors(cases: list[dict]) -> list[dict]:
    """On every rank: per case, the loss error on this rank and the worst per-tensor gradient error
    of ring (CP = world) and of single-process sdpa in the same dtype, against float64 sdpa."""
    results = []
    for c in cases:
        batch = tiny_batch(2, c.get("N", N))
        kw = dict(lora=c["lora"], ckpt=c["ckpt"])
        ref_loss, ref_grads = train_step(c["family"], "sdpa", torch.float64, batch, cp=False, **kw)
        dtype = DTYPES[c["dtype"]]
        sdpa_loss, sdpa_grads = train_step(c["family"], "sdpa", dtype, batch, cp=False, **kw)
        ring_loss, ring_grads = train_step(c["family"], "ring", dtype, batch, cp=True, **kw)
        assert ring_grads.keys() == ref_grads.keys() and ref_grads
        results.append(
            {
                **c,
                "ring_loss": rel_err(ring_loss, ref_loss),
                "sdpa_loss": rel_err(sdpa_loss, ref_loss),
                "ring_grads": {k: rel_err(ring_grads[k], ref_grads[k]) for k in ref_grads},
                "sdpa_grads": {k: rel_err(sdpa_grads[k], ref_grads[k]) for k in ref_grads},
            }
        )
    return results


def check(per_rank: list[list[dict]]) -> None:
    for rank, results in enumerate(per_rank):
        for r in results:
            label = f"rank {rank} {r['family']} {r['dtype']} lora={r['lora']} ckpt={r['ckpt']}"
            if r["dtype"] == "fp32":
                assert r["ring_loss"] <= 1e-5, f"{label}: loss rel err {r['ring_loss']:.2e}"
                for k, e in r["ring_grads"].items():
                    assert e <= 1e-5, f"{label}: grad {k} rel err {e:.2e}"
            else:
                # the loss of a tiny model is a few bf16 ulps from float64 either way: floor 1e-4
                assert r["ring_loss"] <= max(2 * r["sdpa_loss"], 1e-4), (
                    f"{label}: loss rel err {r['ring_loss']:.2e} vs sdpa {r['sdpa_loss']:.2e}"
                )
                for k, e in r["ring_grads"].items():
                    s = r["sdpa_grads"][k]
                    assert e <= 2 * s, f"{label}: grad {k} rel err {e:.2e} > 2x bf16 sdpa {s:.2e}"


def _cases(dtype: str, **flags) -> list[dict]:
    return [dict(family=f, dtype=dtype, lora=False, ckpt=False) | flags for f in FAMILIES]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_training_step_matches_single_process(world: int, dtype: str) -> None:
    check(run_ranks(world, model_errors, _cases(dtype)))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_step_matches_single_process(dtype: str) -> None:
    check(run_ranks(2, model_errors, _cases(dtype, lora=True)))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradient_checkpointing_step_matches_single_process(dtype: str) -> None:
    cases = _cases(dtype, ckpt=True) + [dict(family="llama", dtype=dtype, lora=True, ckpt=True)]
    check(run_ranks(4, model_errors, cases))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_layers_that_drop_the_keyword_arguments_match_single_process(dtype: str) -> None:
    """StableLM and Nemotron call their attention without the batch's keyword arguments; the ring takes
    the layer's ``ring_context`` from ``carry.ACTIVE`` (``install.ATTENTION_CALLERS``), also when
    activation checkpointing recomputes the layer in backward: CP = 3 equals one process."""
    cases = [dict(family=f, dtype=dtype, lora=False, ckpt=ckpt) for f in ("stablelm", "nemotron") for ckpt in (0, 1)]
    check(run_ranks(3, model_errors, cases))
