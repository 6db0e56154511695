"""The CUDA kernels of hybrid mixers under context parallelism, through CPU stand-ins with their call
contracts (``testkit.mixer_standins``: fla's ``chunk_gated_delta_rule`` / ``chunk_kda``,
causal-conv1d's ``causal_conv1d_fn``, mamba-ssm's ``mamba_chunk_scan_combined`` /
``selective_scan_fn`` / ``mamba_split_conv1d_scan_combined``), wrapped as transformers wraps them when the packages are
installed: a bf16 ring step at CP = 2 matches one process with the same kernels, and the kernels
see what they accept (bf16 q/k/v, float32 contiguous initial states, kernel widths 2..4)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.transformers import mixers
from testkit import mixer_standins
from testkit.families import causal_lm_class, tiny_config
from testkit.models import tiny_batch
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

KERNELS = {  # transformers' name -> (fla / causal-conv1d name, package)
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
    "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla"),
    "chunk_kimi_delta_attention": ("chunk_kda", "fla"),
    "mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm"),
    "mamba2_split_conv1d_scan_combined": ("mamba_split_conv1d_scan_combined", "mamba_ssm"),
    "mamba_selective_scan": ("selective_scan_fn", "mamba_ssm"),
}


def with_standins(model_type: str) -> list[tuple]:
    """Rebind the family's kernels to the stand-ins, as on a machine with fla and causal-conv1d."""
    module = sys.modules[causal_lm_class(model_type).__module__]
    family = mixers.FAMILIES[module.__name__.removeprefix("transformers.models.")]
    saved = []
    for name, route in family.functions.items():
        if name not in KERNELS:  # mamba-ssm's mamba_inner_fn: no stand-in (test_attention_free covers its route)
            continue
        torch_fn = mixers.original(module, name).__wrapped__  # transformers' undecorated torch fallback
        kernel = mixer_standins.kernel_like_transformers(torch_fn, *KERNELS[name])
        dispatcher = mixers.ROUTES[route](kernel)
        dispatcher.hf_ring_original = kernel
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, dispatcher)
    return saved


def standin_step(model_type: str) -> dict:
    saved = with_standins(model_type)
    mixer_standins.CALLS.clear()
    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        ring = causal_lm_class(model_type)._from_config(config, attn_implementation="ring").to(torch.bfloat16)
        ref = causal_lm_class(model_type)._from_config(tiny_config(model_type), attn_implementation="sdpa")
        ref = ref.to(torch.bfloat16)
        ring.train(), ref.train()  # Mamba2 mixers take the fused kernel in training
        ref.load_state_dict(ring.state_dict())
        batch = tiny_batch(2, 45, vocab=config.get_text_config().vocab_size)
        want = ref(**batch, use_cache=False)  # as shard_batch passes it (and Mamba2 then fuses in training)
        want.loss.backward()
        calls_ref = len(mixer_standins.CALLS)
        ref_kernels = sorted({name for name, _ in mixer_standins.CALLS})
        out = ring(**hf_ring.shard_batch(batch))
        out.loss.backward()
        worst = 0.0
        for p, q in zip(ring.parameters(), ref.parameters()):
            if p.grad is None or q.grad is None or q.grad.float().norm() < 1e-3:
                continue
            g = p.grad.float().clone()
            dist.all_reduce(g)
            worst = max(worst, rel_err(g / dist.get_world_size(), q.grad.float()))
        ring_calls = mixer_standins.CALLS[calls_ref:]
        return {
            "loss": abs(out.loss.item() - want.loss.item()) / want.loss.item(),
            "grads": worst,
            "identity_calls": sum(1 for name, info in ring_calls if info.get("h0")),
            "conv_pieces": sum(1 for name, info in ring_calls if name == "causal_conv1d_fn" and info["shape"][0] > 2),
            "kernels": sorted({name for name, _ in ring_calls}),
            "ref_kernels": ref_kernels,
        }
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


@pytest.mark.parametrize(
    ("model_type", "kernels", "ref_kernels"),
    [
        ("qwen3_5_text", ["causal_conv1d_fn", "chunk_gated_delta_rule"], None),
        ("kimi_linear", ["causal_conv1d_fn", "chunk_kda"], None),
        # one process: mamba-ssm's fused mixer; under the ring: the convolution and the scan, each routed
        ("nemotron_h", ["causal_conv1d_fn", "mamba_chunk_scan_combined"],
         ["causal_conv1d_fn", "mamba_split_conv1d_scan_combined"]),
        ("jamba", ["causal_conv1d_fn", "selective_scan_fn"], None),
    ],
)  # fmt: skip
def test_cuda_kernels_under_context_parallelism(model_type: str, kernels: list[str], ref_kernels: list | None) -> None:
    for r in run_ranks(2, standin_step, model_type):
        assert r["kernels"] == kernels, r
        assert r["ref_kernels"] == (ref_kernels or kernels), r
        if "delta" in " ".join(kernels) or "kda" in " ".join(kernels):
            assert r["identity_calls"] > 0, r  # the maps of the state came from the kernel itself
        assert r["loss"] < 1e-2 and r["grads"] < 5e-2, r
