"""Vision-language models under CP: a training step with images through ``shard_batch`` (the batch
enters whole, the text decoder gets this rank's rows) against the same step on one process with sdpa,
float64: the loss on every rank and every gradient, the vision encoder's included (and with it frozen),
unpacked and packed, Ulysses x ring; and what is refused."""

from __future__ import annotations

import pytest
import torch

from testkit.oracle import rel_err
from testkit.spawn import run_ranks

ROWS = [  # two rows, three images of 4x4 and 6x6 patches, right padding; lengths not divisible by 2P
    [("text", 7), ("image", 4), ("text", 9), ("image", 6), ("text", 5)],
    [("text", 5), ("image", 4), ("text", 12)],
]
TOL = 1e-6  # float64 models; transformers computes the cross-entropy in float32 (loss_utils.py: logits.float())


def _batch(packed: str | None, model) -> dict:
    """``packed``: None (two rows, right padding), "text" (one packed row, text positions), "rope" (one
    packed row, text positions and each document's M-RoPE rows, ``[4, 1, N]``)."""
    from testkit.vlm import packed_batch, qwen_batch

    if packed is None:
        return qwen_batch(ROWS)
    return packed_batch(ROWS, model if packed == "rope" else None)


def vlm_errors(cases: list[dict]) -> list[dict]:
    """On every rank: per case, the loss's and the worst gradient's relative error of the CP step
    against one process (``frozen``: the vision encoder without gradients)."""
    import hf_ring
    from testkit.vlm import documents, documents_step, step, tiny_model

    out = []
    for c in cases:
        group = None
        if c.get("ulysses", 1) > 1:
            group = hf_ring.setup_context_parallel(torch.distributed.get_world_size(), ulysses_size=c["ulysses"])
        models = [tiny_model(c["family"], attn) for attn in ("sdpa", "ring")]
        batch = _batch(c.get("packed"), models[0])
        if c.get("frozen"):
            for m in models:
                m.model.visual.requires_grad_(False)
        if c.get("packed"):  # each document alone (transformers' sdpa attends across packed documents)
            ref_loss, ref_grads = documents_step(models[0], documents(ROWS, text_positions=c["packed"] == "text"))
        else:
            ref_loss, ref_grads = step(models[0], batch, cp=False)
        loss, grads = step(models[1], batch, cp=True, group=group)
        assert grads.keys() == ref_grads.keys() and any("visual" in k for k in grads) != bool(c.get("frozen"))
        errors = {k: rel_err(grads[k], ref_grads[k]) for k in ref_grads}
        worst = max(errors, key=errors.get)
        out.append({**c, "loss": rel_err(loss, ref_loss), "grad": errors[worst], "worst": worst,
                    "abs_loss": float((loss - ref_loss).abs())})  # fmt: skip
    return out


def check(per_rank: list[list[dict]]) -> None:
    for rank, results in enumerate(per_rank):
        for r in results:
            label = f"rank {rank} {r}"
            assert r["loss"] <= TOL and r["grad"] <= TOL, label


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4, 3])
def test_qwen3_vl_step_matches_one_process(world: int) -> None:
    cases = [dict(family="qwen3_vl"), dict(family="qwen3_vl", frozen=True)]
    check(run_ranks(world, vlm_errors, cases, timeout=280))


@pytest.mark.timeout(300)
def test_qwen3_vl_packed_and_ulysses_match_one_process() -> None:
    cases = [dict(family="qwen3_vl", packed="text"), dict(family="qwen3_vl", packed="rope"),
             dict(family="qwen3_vl", ulysses=2), dict(family="qwen3_vl", packed="rope", ulysses=2)]  # fmt: skip
    check(run_ranks(4, vlm_errors, cases, timeout=280))
