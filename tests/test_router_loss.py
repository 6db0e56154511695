"""The MoE router load-balancing loss over the CP group (hf_ring/ops/router_loss.py and
hf_ring/transformers/router.py), against one process in float64.

Op level: at one rank the op is transformers' ``load_balancing_loss_func`` (Mixtral's; the sweep's
families share it), with and without an attention mask; at P = 2, 3, 4 ranks holding uneven,
interleaved rows with padding, every rank gets the one-process loss and the rows' gradients
(averaged over the ranks, as DDP does) are the one-process ones. Model level: Mixtral, Qwen3-MoE
and OLMoE with ``output_router_logits`` and coefficient 0.1 at CP = 2, 3, 4 against one process
with sdpa -- the loss and ``aux_loss`` on every rank, every gradient (router weights included) --
with right padding in an ``attention_mask``, and a packed row (against each document run alone,
the router loss from all their router logits together); without shard_batch, as one process.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.ops.router_loss import load_balancing_loss
from testkit.families import causal_lm_class, tiny_config
from testkit.models import cp_grad_error, documents_alone_loss, tiny_batch
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

E, TOP_K, LAYERS, B, N = 6, 2, 3, 2, 23


def _reference():
    from transformers.models.mixtral import modeling_mixtral

    from hf_ring.transformers.router import FUNCTION

    fn = getattr(modeling_mixtral, FUNCTION)
    return getattr(fn, "hf_ring_original", fn)


def _inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = [(torch.randn(B * N, E, generator=g, dtype=torch.float64) * 2).requires_grad_() for _ in range(LAYERS)]
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, 15:] = 0
    return logits, mask


@pytest.mark.parametrize("masked", [False, True])
def test_one_rank_is_transformers_loss(masked: bool) -> None:
    logits, mask = _inputs()
    want = _reference()(tuple(logits), E, TOP_K, mask if masked else None)
    want.backward()
    ref_grads = [x.grad.clone() for x in logits]
    for x in logits:
        x.grad = None
    got = load_balancing_loss(logits, E, TOP_K, mask.reshape(-1) if masked else None)
    got.backward()
    assert rel_err(got, want) <= 1e-7
    for x, ref in zip(logits, ref_grads):
        assert rel_err(x.grad, ref) <= 1e-6


def _rows(rank: int, world: int) -> torch.Tensor:
    """An uneven, interleaved share of the ``B * N`` rows (rank 0 gets the most)."""
    order = torch.randperm(B * N, generator=torch.Generator().manual_seed(1))
    cuts = torch.linspace(0, B * N, world + 1).round().long().tolist()
    cuts[1] += 2
    return order[cuts[rank] : cuts[rank + 1]].sort().values


def group_errors() -> dict[str, float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    logits, mask = _inputs()
    want = _reference()(tuple(logits), E, TOP_K, mask)
    want.backward()
    rows = _rows(rank, world)
    mine = [x.detach()[rows].clone().requires_grad_() for x in logits]
    got = load_balancing_loss(mine, E, TOP_K, mask.reshape(-1)[rows], None, world, float(world))
    got.backward()
    worst = 0.0
    for x, ref in zip(mine, logits):
        full = torch.zeros_like(ref)
        full[rows] = x.grad / world  # DDP's average over the ranks
        dist.all_reduce(full)
        worst = max(worst, rel_err(full, ref.grad))
    return {"loss": rel_err(got, want), "grads": worst}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_group_loss_is_one_process_loss(world: int) -> None:
    for r in run_ranks(world, group_errors):
        assert r["loss"] <= 1e-6 and r["grads"] <= 1e-6, r  # float32 sums, as transformers


FAMILIES = ("mixtral", "qwen3_moe", "olmoe")


def build(family: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(family, router_aux=True, router_aux_loss_coef=0.1)
    model = causal_lm_class(family)._from_config(config, attn_implementation=attn, experts_implementation="eager")
    return model.to(torch.float64)


def _batch(kind: str) -> dict[str, torch.Tensor]:
    batch = tiny_batch(2, 37)
    if kind == "padded":
        mask = torch.ones(2, 37, dtype=torch.long)
        mask[1, 26:] = 0
        batch["attention_mask"] = mask
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    elif kind == "packed":
        batch = {k: v[:1] for k, v in batch.items()}
        batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCS])[None]
    return batch


DOCS = (5, 19, 2, 11)


def documents_alone(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, aux_loss)`` of a packed row as one process sees it with each document run alone:
    the language-model loss over all targets, the router loss of all documents' router logits."""
    model.config.output_router_logits = False  # each document's own loss without its own router loss
    try:
        lm = documents_alone_loss(model, batch["input_ids"], batch["labels"], list(DOCS))
    finally:
        model.config.output_router_logits = True
    logits, start = [], 0
    for n in DOCS:
        out = model(input_ids=batch["input_ids"][:, start : start + n], output_router_logits=True)
        logits.append(out.router_logits)
        start += n
    config = model.config
    layers = tuple(torch.cat(per_layer) for per_layer in zip(*logits))
    aux = _reference()(layers, config.num_experts, config.num_experts_per_tok, None)
    return lm + config.router_aux_loss_coef * aux, aux


def model_errors(family: str, kind: str, ulysses: int = 1) -> dict[str, float]:
    if ulysses > 1:
        import torch.distributed as dist

        hf_ring.setup_context_parallel(dist.get_world_size(), ulysses_size=ulysses)
    batch = _batch(kind)
    ring, ref = build(family, "ring"), build(family, "sdpa")
    out = ring(**hf_ring.shard_batch(batch))
    out.loss.backward()
    if kind == "packed":
        loss, aux = documents_alone(ref, batch)
    else:
        want = ref(**batch)
        loss, aux = want.loss, want.aux_loss
    loss.backward()
    return {
        "loss": rel_err(out.loss, loss),
        "aux": rel_err(out.aux_loss, aux),
        "aux_share": float(0.1 * aux.detach() / loss.detach()),
        "grads": cp_grad_error(ring, ref),
    }


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_model_with_padding_is_exact(family: str, world: int) -> None:
    for r in run_ranks(world, model_errors, family, "padded"):
        assert r["aux_share"] > 0.01, r  # the router loss is a visible part of the loss
        assert r["loss"] <= 1e-6 and r["aux"] <= 1e-6 and r["grads"] <= 1e-5, r


def test_model_with_ulysses_is_exact() -> None:
    """CP 4 as Ulysses 2 x ring 2, with padding."""
    for r in run_ranks(4, model_errors, "qwen3_moe", "padded", 2):
        assert r["loss"] <= 1e-6 and r["aux"] <= 1e-6 and r["grads"] <= 1e-5, r


@pytest.mark.parametrize("world", [1, 3])
def test_packed_row_is_exact(world: int) -> None:
    for r in run_ranks(world, model_errors, "qwen3_moe", "packed"):
        assert r["loss"] <= 1e-6 and r["aux"] <= 1e-6 and r["grads"] <= 1e-5, r


def unsharded_errors() -> dict[str, float]:
    """Without ``shard_batch`` every rank holds the whole batch: the router loss from all its router logits,
    as one process computes it."""
    hf_ring.setup_context_parallel(cp_size=torch.distributed.get_world_size())
    batch = tiny_batch(2, 37)
    out = build("mixtral", "ring")(**batch, output_router_logits=True)
    want = build("mixtral", "sdpa")(**batch, output_router_logits=True)
    return {"loss": abs(out.loss.item() - want.loss.item()), "aux": abs(out.aux_loss.item() - want.aux_loss.item()),
            "logits": (out.logits - want.logits).abs().max().item()}  # fmt: skip


def test_without_ring_context_runs_as_one_process() -> None:
    for r in run_ranks(2, unsharded_errors):
        assert max(r.values()) <= 1e-12, r


def unrouted() -> str:
    """A model whose load-balancing loss hf_ring does not route (here: its route taken away)."""
    from hf_ring.transformers import router

    name = "transformers.models.mixtral.modeling_mixtral"
    model = build("mixtral", "ring")
    router._ROUTED[name] = False
    try:
        model(**hf_ring.shard_batch(tiny_batch(2, 37)))
    except hf_ring.RingNotSupported as e:
        return f"RingNotSupported: {e}"
    finally:
        router._ROUTED[name] = True
    return "no error"


def test_unrouted_router_loss_is_refused() -> None:
    for msg in run_ranks(2, unrouted):
        assert msg.startswith("RingNotSupported") and "no context-parallel form" in msg, msg


def test_router_loss_is_recognised_while_the_default_device_is_meta(monkeypatch) -> None:
    """A model built under ``torch.device("meta")`` (how FSDP loads large models) is checked while that
    device is the default: the check of the modeling module's loss runs on the CPU all the same, so its
    router loss is routed, not refused."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    from hf_ring.transformers import router

    monkeypatch.setattr(router, "_ROUTED", {})
    monkeypatch.setattr(router, "_CHECKED", {})
    with torch.device("meta"):
        assert router.routed(modeling_gpt_oss.__name__)
