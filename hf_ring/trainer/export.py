"""The final model of a run, in the formats that load without hf_ring: a LoRA adapter in PEFT's
format (``PeftModel.from_pretrained(base, path)``), or a full model (``save_pretrained``), whatever
the FSDP state-dict type of the checkpoints (``SHARDED_STATE_DICT`` checkpoints are for resume).
Optionally also the base model with the adapter merged in (``from_pretrained`` without peft).
``RingTrainer.save_model`` writes it; ``save_final`` is the name it had before."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["full_state_dict", "merged_state_dict", "save_final", "save_model"]


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def full_state_dict(model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of ``model``'s parameters -- only the trainable ones, or all its
    state -- on rank 0 (an empty dict elsewhere). Every rank must call it (FSDP2 parameters are
    gathered with ``DTensor.full_tensor``)."""
    from torch.distributed.tensor import DTensor

    items = (
        [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if trainable_only
        else list(model.state_dict().items())
    )
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        t = t.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if _is_main():
            out[name] = t.cpu().clone()
    return out


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state with every LoRA ``Linear`` of the active adapter merged in:
    ``W + scaling * B @ A`` (in float32, float64 for float64 weights; stored in ``W``'s dtype), keys
    as the base model names them.

    ``model``: a ``PeftModel`` (sharded or not; only its module structure and LoRA scalings are read);
    ``state``: its full state dict (``full_state_dict(model, trainable_only=False)``). DoRA, LoRA
    biases, LoRA on layers other than ``Linear``, and any other weight of the adapter that is not
    merged are refused with ``ValueError``.
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    prefix = "base_model.model."
    merged = dict(state)
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        held = adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {})
        if not held:
            continue
        dora = module.use_dora.get(adapter, False)
        bias = getattr(module, "lora_bias", {}).get(adapter, False)
        if not isinstance(module, LoraLinear) or dora or bias:
            raise ValueError(
                f"save_model(merged=True): cannot merge the adapter of {name} ({type(module).__name__}, "
                f"DoRA={dora}, lora_bias={bias}); only plain LoRA on Linear layers is merged. "
                "Load the adapter with PeftModel.from_pretrained and call merge_and_unload() instead."
            )
        w_key = f"{name}.base_layer.weight"
        w = merged[w_key]
        acc = torch.promote_types(w.dtype, torch.float32)
        a = merged.pop(f"{name}.lora_A.{adapter}.weight").to(acc)
        b = merged.pop(f"{name}.lora_B.{adapter}.weight").to(acc)
        delta = (b @ a) * module.scaling[adapter]
        merged[w_key] = (w.to(acc) + (delta.T if module.fan_in_fan_out else delta)).to(w.dtype)
    left = [k for k in merged if ".lora_" in k and f".{adapter}" in k]
    if left:  # a weight of the active adapter that no merge above consumed would be silently dropped
        raise ValueError(
            f"save_model(merged=True): cannot merge the adapter's weights {left[:3]}; load the "
            "adapter with PeftModel.from_pretrained and call merge_and_unload() instead."
        )
    out = {}
    for key, t in merged.items():
        if ".lora_" in key or ".original_module." in key:
            continue  # other adapters' weights; modules_to_save keeps its trained copy below
        key = key.removeprefix(prefix).replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        out[key] = t
    return out


def save_model(trainer: Any, path: str | os.PathLike, *, merged: bool = False) -> Path:
    """Write the trained model of ``trainer`` (a ``RingTrainer``) to ``path``: a PEFT model's adapter
    in PEFT's format, any other model with ``save_pretrained``, gathered from FSDP2 shards whatever
    the state-dict type; the tokenizer (``processing_class``) and ``training_args.bin`` beside it.
    With ``merged=True`` a PEFT model is also written whole, adapter merged into the base weights,
    to ``path / "merged"`` (``AutoModelForCausalLM.from_pretrained`` loads it without peft).
    Collective: call it on every rank. Returns ``path``. ``RingTrainer.save_model(path)`` calls it."""
    from peft import PeftModel

    path = Path(path)
    model = trainer.model  # FSDP2 shards it in place; DDP keeps the unwrapped module here
    inner = trainer.accelerator.unwrap_model(model)
    peft = isinstance(inner, PeftModel)
    state = full_state_dict(inner, trainable_only=peft)
    whole = full_state_dict(inner, trainable_only=False) if peft and merged else {}
    if _is_main():
        path.mkdir(parents=True, exist_ok=True)
        inner.save_pretrained(path, state_dict=state, safe_serialization=True)
        if getattr(trainer, "processing_class", None) is not None:
            trainer.processing_class.save_pretrained(path)
        if getattr(trainer, "args", None) is not None:
            torch.save(trainer.args, path / "training_args.bin")
        if whole:
            from huggingface_hub import save_torch_state_dict

            base = inner.get_base_model()
            base.config.save_pretrained(path / "merged")
            if getattr(base, "generation_config", None) is not None:
                base.generation_config.save_pretrained(path / "merged")
            save_torch_state_dict(merged_state_dict(inner, whole), path / "merged")
            if getattr(trainer, "processing_class", None) is not None:
                trainer.processing_class.save_pretrained(path / "merged")
    if dist.is_initialized():
        dist.barrier()
    return path


save_final = save_model  # its former name; ``RingTrainer.save_model(path)`` is the way to call it
