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
from testkit.mixers import KINDS, delta_rule_reference, each_document_alone, local_rows, make_layout, mixer_errors
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

    def one(parts: list[torch.Tensor], _: list[torch.Tensor]) -> torch.Tensor:
        return rule(*parts, use_qk_l2norm_in_kernel=True, chunk_size=4)[0]

    out, grads, _ = each_document_alone(one, xs, w, layout, dtype)
    return out, grads


def delta_errors(kind: str, ulysses: int, per_channel: bool, rule_name: str, dtype: str) -> dict[str, float]:
    size, rank = dist.get_world_size(), dist.get_rank()
    layout, batch = make_layout(kind, size, ulysses)
    full = inputs(batch, layout.n, per_channel, HV if rule_name == "kda" else HK)  # KDA: no grouped heads
    rule = _rule(rule_name)
    want, grads = oracle(full, layout, torch.float64, delta_rule_reference)
    dt = getattr(torch, dtype)
    leaves = [local_rows(x, layout, rank).to(dt).requires_grad_() for x in full[:-1]]
    out = delta_rule(rule, *leaves, delta_plan(layout, batch, rank), None, use_qk_l2norm_in_kernel=True, chunk_size=4)
    # one process in the same dtype, each document alone: the error to be within 2x of
    base = oracle(full, layout, dt, rule) if dtype != "float64" else None
    names = ("dq", "dk", "dv", "dg", "dbeta")
    return mixer_errors(out, want, full[-1], layout, rank, batch, list(zip(names, leaves, grads)), one_process=base)


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
