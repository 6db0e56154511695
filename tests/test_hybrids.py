"""Hybrid models (Gated DeltaNet, KDA, Mamba2, Mamba, lightning attention, RG-LRU, short convolutions)
under context parallelism, model level: one training step against one process in float64 (the
gated delta rules and the SSD scan in float64 too, ``testkit.mixers.float64_kernels``; transformers'
own compute in float32 inside): Qwen3.5 dense and MoE and Nemotron-H at CP = 4 with LoRA on the
mixer projections and activation checkpointing; packed documents of 1, 2 and more tokens against
each document alone (also at CP = 1, where the dispatchers restart the state at each document);
chunked loss; Ulysses x ring."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_ring
from testkit.families import causal_lm_class, tiny_config
from testkit.mixers import float64_kernels
from testkit.models import cp_grad_error, documents_alone_loss, packed_batch, tiny_batch
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

# LoRA targets: the attention and every projection of the mixers (Qwen3.5's GDN, Kimi's KDA, LFM2's conv)
LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
        "in_proj", "b_proj", "g_a_proj", "g_b_proj"]  # fmt: skip
NOT_LORA = {"nemotron_h": {"out_proj"}}  # PEFT refuses LoRA on a Mamba mixer's out_proj
MIXER_MODULES = ("linear_attn", "conv", "mixer.in_proj", "mixer.out_proj")  # GDN / KDA, LFM2, Mamba2
DOCS = [1, 2, 9, 1, 14, 2, 1, 7, 3]  # 40 tokens: at CP = 4 (chunks of 5) documents cross chunks and ranks


def build(model_type: str, attn: str, lora: bool, ckpt: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = causal_lm_class(model_type)._from_config(
        tiny_config(model_type), attn_implementation=attn, experts_implementation="eager"
    ).to(torch.float64)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        targets = names & set(LORA) - NOT_LORA.get(model_type, set())
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=sorted(targets), init_lora_weights=False)
        model = get_peft_model(model, cfg)
    if ckpt:
        model.gradient_checkpointing_enable()
        if lora:
            model.enable_input_require_grads()
    return model.train()


def step_errors(model_type: str, lora: bool = False, ckpt: bool = False, packed: bool = False,
                chunked: bool = False, ulysses: int = 1) -> dict:  # fmt: skip
    """On every rank: the ring step's loss and CP-averaged gradients against one process."""
    world = dist.get_world_size()
    if ulysses > 1:
        hf_ring.setup_context_parallel(world, ulysses_size=ulysses)
    vocab = tiny_config(model_type).get_text_config().vocab_size
    with float64_kernels():
        ring, ref = build(model_type, "ring", lora, ckpt), build(model_type, "sdpa", lora, ckpt)
        if chunked:
            hf_ring.enable_chunked_loss(ring)
        if packed:
            batch = packed_batch(DOCS, vocab)
            want = documents_alone_loss(ref, batch["input_ids"], batch["labels"], DOCS)
        else:
            batch = tiny_batch(2, 45, vocab=vocab)
            want = ref(**batch).loss
        kwargs = hf_ring.shard_batch(batch)
        assert kwargs["ring_context"].ulysses_size == ulysses
        out = ring(**kwargs)
        out.loss.backward()
        want.backward()
    trained = [n for n, p in ring.named_parameters() if p.requires_grad]
    return {
        "loss": rel_err(out.loss, want),
        "grads": cp_grad_error(ring, ref),
        "trained": len(trained),
        "mixer_lora": sum("lora" in n and any(m in n for m in MIXER_MODULES) for n in trained),
    }


def check(results: list[dict], tol: float = 1e-5) -> None:
    for r in results:
        assert r["loss"] <= tol and r["grads"] <= tol, r


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "nemotron_h"])
def test_lora_checkpointing_step_at_cp4(model_type: str) -> None:
    results = run_ranks(4, step_errors, model_type, lora=True, ckpt=True)
    check(results)
    assert results[0]["mixer_lora"] > 0, results[0]  # LoRA on the Gated DeltaNet / Mamba2 projections too


@pytest.mark.parametrize(("world", "model_type", "chunked"), [
    (4, "qwen3_5_text", False), (1, "qwen3_5_text", False), (3, "kimi_linear", False), (3, "lfm2", True),
    (4, "nemotron_h", False), (1, "nemotron_h", True), (3, "jamba", False), (4, "minimax", False),
    (3, "recurrent_gemma", False), (1, "recurrent_gemma", False), (2, "zamba2", True),
])  # fmt: skip
def test_packed_documents_equal_each_document_alone(world: int, model_type: str, chunked: bool) -> None:
    check(run_ranks(world, step_errors, model_type, packed=True, chunked=chunked))


def test_ulysses_times_ring() -> None:
    """CP = 4 as Ulysses 2 x ring 2: attention over Ulysses and ring groups, the mixers over the whole
    CP group in the hybrid layout (their runs follow the layout's pieces)."""
    check(run_ranks(4, step_errors, "qwen3_5_text", ulysses=2))
    check(run_ranks(4, step_errors, "qwen3_5_text", packed=True, ulysses=2))
    check(run_ranks(4, step_errors, "nemotron_h", packed=True, ulysses=2))
