"""The context-parallel gated delta rule (``ops.mixers.delta``) against a float64 oracle that runs each
document of the unsharded batch alone: outputs and the gradients of q, k, v, the decay and beta,
P = 1..4, Ulysses pieces, grouped value heads (Hv = 2 Hk), odd head dims, the per-channel decay of
KDA, packed documents of 1, 2 and more tokens crossing chunk and rank boundaries, rows not a
multiple of 2P; with the float64 reference rule (1e-10), transformers' own torch rules (float32
inside: 1e-5) and bf16 (within 2x of one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_ring.ops.mixers.delta import delta_plan, delta_rule
from testkit.mixers import KINDS, delta_rule_reference, documents, local_rows, make_layout, real_rows
from testkit.spawn import run_ranks

HK, HV, DK, DV = 2, 4, 5, 3


def _rule(name: str):
    if name == "reference":
        return delta_rule_reference
    import importlib

    from hf_ring.transformers.install import original

    module, fn = {
        "gdn": ("transformers.models.qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule"),
        "kda": ("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention"),
    }[name]
    return original(importlib.import_module(module), fn)


def inputs(batch: int, n: int, per_channel: bool, hk: int = HK) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, n, hk, DK, generator=g, dtype=torch.float64)
    k = torch.randn(batch, n, hk, DK, generator=g, dtype=torch.float64)
    v = torch.randn(batch, n, HV, DV, generator=g, dtype=torch.float64)
    decay = -torch.rand(batch, n, HV, *((DK,) if per_channel else ()), generator=g, dtype=torch.float64)
    beta = torch.rand(batch, n, HV, generator=g, dtype=torch.float64)
    w = torch.randn(batch, n, HV, DV, generator=g, dtype=torch.float64)
    return [q, k, v, decay, beta, w]


def oracle(full: list[torch.Tensor], layout, dtype: torch.dtype, rule) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each document alone through ``rule`` in ``dtype``; the output and the gradients of ``sum(out * w)``."""
    *xs, w = full
    leaves = [x.detach().to(dtype).clone().requires_grad_() for x in xs]
    out = torch.zeros_like(w)
    for b in range(w.shape[0]):
        for lo, hi in documents(layout, b):
            part = [x[b : b + 1, lo:hi] for x in leaves]
            o, _ = rule(*part, use_qk_l2norm_in_kernel=True, chunk_size=4)
            out[b, lo:hi] = o[0].double()
    (out * w).sum().backward()
    return out.detach(), [x.grad.double() for x in leaves]


def delta_errors(kind: str, ulysses: int, per_channel: bool, rule_name: str, dtype: str) -> dict[str, float]:
    size, rank = dist.get_world_size(), dist.get_rank()
    layout, batch = make_layout(kind, size, ulysses)
    full = inputs(batch, layout.n, per_channel, HV if rule_name == "kda" else HK)  # KDA: no grouped heads
    rule = _rule(rule_name)
    want, grads = oracle(full, layout, torch.float64, delta_rule_reference)
    dt = getattr(torch, dtype)
    *xs, w = (local_rows(x, layout, rank) for x in full)
    leaves = [x.detach().to(dt).clone().requires_grad_() for x in xs]
    plan = delta_plan(layout, batch, rank)
    out = delta_rule(rule, *leaves, plan, None, use_qk_l2norm_in_kernel=True, chunk_size=4)
    real = real_rows(layout, rank, batch)
    mask = real.view(batch, -1, 1, 1)
    (out.double() * w * mask).sum().backward()
    err = {"out": float(((out.double() - local_rows(want, layout, rank)) * mask).abs().max())}
    scale = {"out": float(want.abs().max())}
    for name, leaf, ref in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves, grads):
        mine = leaf.grad.double()
        m = real.view(batch, -1, *([1] * (mine.dim() - 2)))
        err[name] = float(((mine - local_rows(ref, layout, rank)) * m).abs().max())
        scale[name] = float(ref.abs().max())
    if dtype != "float64":  # one process in the same dtype, each document alone: the error to be within 2x of
        _, base_grads = oracle(full, layout, dt, rule)
        base_out, _ = oracle(full, layout, dt, rule)
        err["one_process_out"] = float((base_out - want).abs().max())
        for name, g1, ref in zip(("dq", "dk", "dv", "dg", "dbeta"), base_grads, grads):
            err[f"one_process_{name}"] = float((g1 - ref).abs().max())
    return {"err": err, "scale": scale}


CASES = [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)]


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("world", "ulysses"), CASES)
def test_delta_rule_matches_each_document_alone(world: int, ulysses: int, kind: str, per_channel: bool) -> None:
    for r in run_ranks(world, delta_errors, kind, ulysses, per_channel, "reference", "float64"):
        assert max(r["err"].values()) < 1e-10, r


@pytest.mark.parametrize(("rule", "per_channel"), [("gdn", False), ("kda", True)])
@pytest.mark.parametrize(("world", "kind"), [(3, "sequence"), (4, "short_ones"), (2, "odd")])
def test_transformers_rules_under_state_passing(world: int, kind: str, rule: str, per_channel: bool) -> None:
    """transformers' chunked rules compute in float32 inside: relative 1e-5 of each tensor's scale."""
    for r in run_ranks(world, delta_errors, kind, 1, per_channel, rule, "float64"):
        for name, e in r["err"].items():
            assert e <= 1e-5 * max(r["scale"][name], 1.0), (name, r)


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_within_twice_one_process(world: int) -> None:
    for r in run_ranks(world, delta_errors, "long_and_short", 1, False, "gdn", "bfloat16"):
        for name in ("out", "dq", "dk", "dv", "dg", "dbeta"):
            assert r["err"][name] <= 2 * r["err"][f"one_process_{name}"] + 1e-3 * r["scale"][name], (name, r)
