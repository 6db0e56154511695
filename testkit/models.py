"""Tiny random-initialised causal LMs built from configs (nothing is downloaded)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import hf_ring

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if family == "mistral":
        return MistralConfig(**{"sliding_window": None, **common})
    if family in ("stablelm", "nemotron"):  # decoder layers that call their attention without **kwargs
        from transformers import AutoConfig

        return AutoConfig.for_model(family, **common)
    raise ValueError(family)


def tiny_model(family: str, attn: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """The same weights for every ``attn`` and ``dtype`` given the same ``seed``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation=attn)
    return model.to(dtype)


def tiny_batch(b: int, n: int, vocab: int = 97, seed: int = 1) -> dict[str, torch.Tensor]:
    """``input_ids``/``labels [b, n]`` with ``-100`` spans in the labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, n), generator=g)
    labels = ids.clone()
    labels[:, : n // 5] = -100
    labels[0, n // 2 : n // 2 + 3] = -100
    return {"input_ids": ids, "labels": labels}


def prepare_step_model(model, case: dict, lora_rank: int):
    """``model`` with the options of ``case`` (LoRA on ``LORA_TARGETS``, checkpointing with or without
    offload, chunked loss and its ``loss_chunk``, tiled MLP; ``groups``: head groups, ``layers``: tiled
    layers' tile), in training mode, with zero gradients already allocated as in gradient accumulation.
    Returns the model (a PEFT wrapper with LoRA; ``peft`` is imported only then).
    Used by the memory tests and ``benchmarks.bench_memory``."""
    from hf_ring.planner import LORA_TARGETS

    if case["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules=list(LORA_TARGETS)))
        model.enable_input_require_grads()
    if case["ckpt"]:
        from testkit.offload import MeasuredOffload  # the offload, measurable on a CPU-only machine

        hf_ring.enable_activation_checkpointing(model, offload=MeasuredOffload if case["offload"] else False)
    if case["chunked"]:
        hf_ring.enable_chunked_loss(model, case.get("loss_chunk"))
    if case["tiled"]:
        hf_ring.enable_tiled_mlp(model, case["tiled"])
    if case.get("groups", 1) > 1:
        hf_ring.enable_head_groups(model, case["groups"])
    if case.get("layers"):
        hf_ring.enable_tiled_layers(model, case["layers"], offload_every=case.get("every", 1))
    model.train()
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return model


def lora_model(model):
    """``model`` with LoRA r4 on the attention projections, ``B != 0`` (real gradients everywhere)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)  # B != 0: real grads
    return get_peft_model(model, cfg)


def train_step(family: str, attn: str, dtype: torch.dtype, batch: dict, *, lora: bool, ckpt: bool, cp: bool):
    """Loss and gradients (by parameter name, float64) of one step; with ``cp``, the batch goes
    through shard_batch and gradients are averaged over the group, as DDP would."""
    model = tiny_model(family, attn, dtype)
    if lora:
        model = lora_model(model)
    if ckpt:
        model.gradient_checkpointing_enable()
        if lora:
            model.enable_input_require_grads()
    model.train()
    out = model(**(hf_ring.shard_batch(batch) if cp else batch))
    out.loss.backward()
    return out.loss.double(), named_grads(model, cp)


def named_grads(model, cp: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name (float64); with ``cp`` averaged over the world, as DDP would."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.double()
        if cp:
            dist.all_reduce(g)
            g /= dist.get_world_size()
        grads[name] = g
    return grads


def packed_batch(lengths: list[int], vocab: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """One packed row of documents of ``lengths`` tokens: ``input_ids``, ``labels`` (three targets
    left out at positions 20-22) and ``position_ids`` restarting at 0 for every document, ``[1, N]``."""
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, 20:23] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def documents_alone_loss(model, ids: torch.Tensor, labels: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """What a packed step must equal: each document of the packed row ``ids, labels [1, N]`` (of
    ``lengths`` tokens) run alone through ``model``, the sum over all targets over all targets."""
    total, count, start = 0.0, 0, 0
    for n in lengths:
        doc_labels = labels[:, start : start + n]
        c = int((doc_labels[:, 1:] != -100).sum())
        if c:
            total = total + model(input_ids=ids[:, start : start + n], labels=doc_labels).loss * c
            count += c
        start += n
    return total / count


def cp_grad_error(ring, ref) -> float:
    """The worst relative error of ``ring``'s gradients averaged over the world (as DDP would)
    against ``ref``'s, parameter by parameter (float64)."""
    from testkit.oracle import rel_err

    worst = 0.0
    for p, q in zip(ring.parameters(), ref.parameters()):
        if p.grad is None:
            continue
        grad = p.grad.double()
        dist.all_reduce(grad)
        worst = max(worst, rel_err(grad / dist.get_world_size(), q.grad))
    return worst
