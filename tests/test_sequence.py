"""Per-sequence and per-document sums over the CP group (``hf_ring.transformers.sequence``): values
and gradients equal to one process in float64, at P = 2 and 3, on lengths not divisible by 2P, with
right padding and with packed documents; and the per-token log-probabilities of a ring model's
labels, summed per sequence, against full logits of the same model with sdpa on one process (loss
and every parameter gradient)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testkit.post import EPS32, ROUNDINGS
from testkit.spawn import run_ranks

B, N = 2, 29  # 29 tokens: not a multiple of 2P for P = 2 or 3


def _batch(packed: bool, vocab: int = 97) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (B, N), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt
    labels[1, 12:15] = -100
    out = {"input_ids": ids, "labels": labels}
    if packed:  # three documents in row 0, two in row 1
        pos = [list(range(11)) + list(range(9)) + list(range(9)), list(range(17)) + list(range(12))]
        out["position_ids"] = torch.tensor(pos)
    else:  # row 1 right-padded
        mask = torch.ones(B, N, dtype=torch.long)
        mask[1, 23:] = 0
        out["attention_mask"] = mask
    return out


def _doc_index(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, N]: the document of every token (counting from 0 in each row)."""
    pos = batch.get("position_ids")
    if pos is None:
        return torch.zeros(B, N, dtype=torch.long)
    return (pos == 0).long().cumsum(1) - 1


# --- sequence_sums of given values ---------------------------------------------------------------


def sums_rank(packed: bool, per_document: bool) -> dict:
    import hf_ring
    from hf_ring.transformers.sequence import sequence_sums

    batch = _batch(packed)
    kwargs = hf_ring.shard_batch(batch)
    ctx = kwargs["ring_context"]
    g = torch.Generator().manual_seed(5)
    values = torch.randn(B, N, 3, generator=g, dtype=torch.float64)
    if "attention_mask" in batch:
        values = values * batch["attention_mask"][..., None]
    pad = ctx.layout.n + 1 - N  # rows N..: padding that shard_batch added, and the padding rows' slot
    full = torch.cat((values, values.new_zeros(B, pad, 3)), 1).requires_grad_()
    index = ctx.layout.index(B)[ctx.rank]
    local = full.gather(1, index[..., None].expand(B, -1, 3))
    sums = sequence_sums(ctx, local, per_document=per_document)
    loss = (sums.square() * torch.arange(1, sums.numel() + 1, dtype=torch.float64).view(sums.shape)).sum()
    loss.backward()
    return {"sums": sums.detach().numpy(), "grad": full.grad[:, :N].numpy()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("packed,per_document", [(False, False), (True, False), (True, True)])
def test_sequence_sums_match_one_process(world: int, packed: bool, per_document: bool) -> None:
    batch = _batch(packed)
    g = torch.Generator().manual_seed(5)
    values = torch.randn(B, N, 3, generator=g, dtype=torch.float64)
    if "attention_mask" in batch:
        values = values * batch["attention_mask"][..., None]
    values.requires_grad_()
    docs = _doc_index(batch) if per_document else torch.zeros(B, N, dtype=torch.long)
    n_docs = int(docs.max()) + 1
    ref = torch.zeros(B, n_docs, 3, dtype=torch.float64)
    ref = ref.index_put((torch.arange(B)[:, None].expand(B, N), docs), values, accumulate=True)
    if not per_document:
        ref = ref[:, 0]
    (ref.square() * torch.arange(1, ref.numel() + 1, dtype=torch.float64).view(ref.shape)).sum().backward()
    out = run_ranks(world, sums_rank, packed, per_document, timeout=60)
    grad = sum(o["grad"] for o in out)  # each rank's share of the gradient, on the rows it holds
    for o in out:
        np.testing.assert_allclose(o["sums"], ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    real = batch.get("attention_mask", torch.ones(B, N))[..., None]  # padding rows count in no sum
    np.testing.assert_allclose(grad, (values.grad * real).numpy(), rtol=1e-12, atol=1e-12)


# --- log-probabilities of a ring model, summed per sequence ----------------------------------------


def _objective(sums: torch.Tensor) -> torch.Tensor:
    """A nonlinear function of the per-sequence (per-document) sums, like a preference loss."""
    flat = sums.reshape(-1)
    return -torch.nn.functional.logsigmoid(0.1 * (flat[::2].sum() - flat[1::2].sum())) + 1e-3 * flat.square().sum()


def logprob_rank(packed: bool, kind: str) -> dict:
    import hf_ring
    from hf_ring.transformers.sequence import sequence_logprobs, sequence_sums
    from testkit.models import tiny_model

    batch = _batch(packed)
    per_document = packed
    if kind == "ring":
        model = tiny_model("llama", "ring", dtype=torch.float64)
        kwargs = hf_ring.shard_batch(batch)
        ctx = kwargs["ring_context"]
        tok = sequence_logprobs(model, kwargs, stats=("entropy",))
        sums = sequence_sums(ctx, tok["log_probs"].double(), per_document=per_document)
        entropy = sequence_sums(ctx, tok["entropy"].double(), per_document=per_document)
    else:
        from hf_ring.transformers.batch import next_token_targets

        model = tiny_model("llama", "sdpa", dtype=torch.float64)
        if packed:  # each document on its own (the oracle of document masking)
            starts = [[0, *((row == 0).nonzero().flatten()[1:].tolist()), N] for row in batch["position_ids"]]
            logits = torch.cat([
                torch.cat([model(input_ids=batch["input_ids"][i : i + 1, a:z]).logits for a, z in zip(st, st[1:])], 1)
                for i, st in enumerate(starts)
            ]).float()  # fmt: skip
        else:
            call = {k: v for k, v in batch.items() if k != "labels"}
            logits = model(**call).logits.float()
        targets = next_token_targets(batch["labels"], batch.get("attention_mask"), batch.get("position_ids"))
        logp = torch.log_softmax(logits, -1)
        tok_logp = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != -100)
        tok_ent = -(logp.exp() * logp).sum(-1) * (targets != -100)
        docs = _doc_index(batch) if per_document else torch.zeros(B, N, dtype=torch.long)
        rows = torch.arange(B)[:, None].expand(B, N)
        n_docs = int(docs.max()) + 1
        sums = torch.zeros(B, n_docs, dtype=torch.float64).index_put((rows, docs), tok_logp.double(), accumulate=True)
        entropy = torch.zeros(B, n_docs, dtype=torch.float64).index_put((rows, docs), tok_ent.double().detach(),
                                                                         accumulate=True)  # fmt: skip
        if not per_document:
            sums, entropy = sums[:, 0], entropy[:, 0]
    loss = _objective(sums)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    return {"sums": sums.detach().numpy(), "entropy": entropy.numpy(), "loss": float(loss), "grads": grads}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sequence_logprobs_match_full_logits(world: int, packed: bool) -> None:
    """Float64 model; the log-probabilities are float32 (as transformers' loss computes them), so
    the tolerance is float32's."""
    ref = run_ranks(1, logprob_rank, packed, "ref", timeout=120)[0]
    out = run_ranks(world, logprob_rank, packed, "ring", timeout=180)
    for o in out:
        np.testing.assert_allclose(o["sums"], ref["sums"], rtol=1e-6)
        np.testing.assert_allclose(o["entropy"], ref["entropy"], rtol=1e-6)
        # the objective moves by (0.1 + 2e-3 |s|) per unit of each sum s, whose float32 error is K eps |s|
        # (testkit.post): its difference of sums is judged by the sums' size, not by its own value
        s = np.abs(ref["sums"])
        tol = ROUNDINGS * EPS32 * (float(np.sum(0.1 * s + 2e-3 * s**2)) + abs(ref["loss"]))
        assert abs(o["loss"] - ref["loss"]) <= tol, (o["loss"], ref["loss"], tol)
    for name, g in ref["grads"].items():
        got = sum(o["grads"][name] for o in out)
        scale = np.abs(g).max()
        assert np.abs(got - g).max() <= 1e-5 * scale, f"{name}: {np.abs(got - g).max()} vs max {scale}"
