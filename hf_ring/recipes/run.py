"""The recipe runner: ``hf-ring train RECIPE [--field value ...]`` on every process.

    accelerate launch --config_file $(hf-ring train --config fsdp2-8gpu) -m hf_ring.cli train \\
        llama-3.1-8b-128k [--max_steps 4 --output_dir runs/try]

Parses the recipe (``hf_ring.recipes.recipe``), resolves the model's config and checks it (no
weights), builds the data once (``hf_ring.recipes.data``; token ids checked against the config's
``vocab_size``), the model (LoRA through PEFT), and trains it with ``RingTrainer``: progress bar,
``report_to``, checkpoints every ``save_steps`` (sharded under FSDP2) and resume are ``Trainer``'s,
sealed by ``RingTrainer`` (a kill cannot break them). A run resumes from the newest complete
checkpoint in ``output_dir`` unless ``--resume_from_checkpoint`` names one (a path) or is ``no``,
and says from which step; starting over where an earlier run left files needs
``--overwrite_output_dir true`` (``prepare_output_dir``). At the end ``trainer.save_model`` writes
``output_dir/final`` (a PEFT adapter, or the full model), ``metrics.jsonl`` (the logged steps),
``summary.json`` and, when matplotlib is installed, ``loss.png`` (else one line says why not);
passkey runs with ``data.eval`` report retrieval accuracy before and after. Everything the recipe,
its flags and the launch can get wrong is refused before the data is built (``check_layout``,
``prepare_output_dir``, the model's config and ``check_ulysses``, ``check_ring_model``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..data.passkey import VOCAB as PASSKEY_VOCAB
from ..errors import RecipeError, reports
from ..plots import plot_loss
from ..trainer import RingTrainer
from ..trainer.startup import earlier_run
from .data import StagedDataset, collate, load_documents, pack, passkey_stage, stages_of, tokenize
from .evaluate import passkey_accuracy
from .recipe import Recipe, auto_class, build_model, check_local, check_ring_model, model_config, parse_recipe
from .vlm_data import build_processor, collate_multimodal, multimodal_dataset

__all__ = ["build_train_dataset", "check_layout", "check_ulysses", "main", "prepare_output_dir", "run"]


def _tokenizer(recipe: Recipe) -> Any:
    ref = recipe.data.get("tokenizer") or recipe.model.get("name_or_path") or recipe.model.get("init_from")
    if ref is None:
        return None
    field = next(f"{s}.{k}" for s, k in (("data", "tokenizer"), ("model", "name_or_path"), ("model", "init_from"))
                 if getattr(recipe, s).get(k))  # fmt: skip
    check_local(field, ref)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ref)


def build_train_dataset(recipe: Recipe, dp_size: int, tokenizer: Any = None, vocab_size: int | None = None,
                        processor: Any = None, config: Any = None) -> StagedDataset:  # fmt: skip
    """The training data of a recipe, stages laid out along the optimizer steps (built once:
    tokenised and packed into datasets' cache by the main process of each node first). Token ids
    outside ``[0, vocab_size)`` (the model config's) are refused while the data is built. With a
    ``processor`` (``data.processor``): image / video examples packed by ``vlm_data.images_dataset``,
    Qwen's M-RoPE positions from ``config``'s model built on the meta device."""
    args, data = recipe.args, recipe.data
    stages = stages_of(data)
    if stages[-1]["steps"] == 0:
        stages[-1]["steps"] = args.max_steps
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp_size
    if data.get("task") == "passkey":
        if vocab_size is not None and vocab_size < PASSKEY_VOCAB:
            raise RecipeError(f"data.task passkey uses token ids 0..{PASSKEY_VOCAB - 1}, but the model's vocab_size "
                              f"is {vocab_size}: set model.config.vocab_size >= {PASSKEY_VOCAB}")  # fmt: skip
        parts = [(passkey_stage(s["seq_len"], args.seed, k), s["steps"]) for k, s in enumerate(stages)]
        return StagedDataset(parts, per_step, args.max_steps, shuffle_seed=None)
    if processor is not None:
        rope = _rope_model(config)
        parts = [(multimodal_dataset(load_documents(data), data, processor, s["seq_len"], rope), s["steps"])
                 for s in stages]  # fmt: skip
        return StagedDataset(parts, per_step, args.max_steps, args.seed)
    with args.main_process_first(desc="tokenize and pack the data"):
        docs = tokenize(load_documents(data), data, tokenizer)
        pad = data.get("pad_id", getattr(tokenizer, "pad_token_id", None) or 0)
        packed = {
            s["seq_len"]: pack(docs, s["seq_len"], data.get("boundaries", "pad"), pad_id=pad,
                               num_proc=data.get("num_proc"), vocab_size=vocab_size)
            for s in stages
        }  # fmt: skip
    return StagedDataset([(packed[s["seq_len"]], s["steps"]) for s in stages], per_step, args.max_steps, args.seed)


def _rope_model(config: Any) -> Any:
    """The model of ``config`` on the meta device when it computes its own multimodal positions
    (Qwen's ``get_rope_index``, which reads only the config), else ``None``."""
    import torch

    with torch.device("meta"):
        model = auto_class(True).from_config(config)
    inner = getattr(model, "model", model)
    return model if hasattr(model, "get_rope_index") or hasattr(inner, "get_rope_index") else None


_NO = ("no", "false", "none", "")


def _say(message: str) -> None:
    """One line to the user from the process that reports (rank 0, or this process alone)."""
    if reports():
        print(f"hf-ring train: {message}", flush=True)


def check_layout(recipe: Recipe, world: int) -> None:
    """Refuse a CP layout the launch cannot make: ``cp_size`` over one process, or not dividing the
    launched processes."""
    cp = recipe.args.cp_size
    if cp > 1 and world == 1:
        raise RecipeError(
            f"cp_size={cp}: needs {cp} processes (or a multiple), but this is one process; launch with "
            f"torchrun --nproc_per_node {cp} -m hf_ring.cli train {recipe.source} (or accelerate launch, "
            "hf-ring train --list), or set --cp_size 1"
        )
    if world % cp:
        raise RecipeError(f"cp_size={cp} does not divide the {world} launched processes: launch a multiple of {cp} "
                          f"processes, or set --cp_size to a divisor of {world}")  # fmt: skip


def check_ulysses(args: Any, config: Any) -> None:
    """Refuse an int ``ulysses_size`` that does not divide the model's query heads."""
    u = args.ulysses_size
    heads = getattr(config.get_text_config(), "num_attention_heads", None)
    if u != "auto" and isinstance(heads, int) and heads % int(u):
        raise RecipeError(
            f"ulysses_size={u} does not divide the model's {heads} query heads (num_attention_heads): pick a "
            f"divisor of both {heads} and cp_size={args.cp_size} (1: ring attention only)"
        )


def prepare_output_dir(args: Any) -> None:
    """Decide what this run does with ``output_dir`` before anything is built (every rank decides the
    same): resume from its newest checkpoint (the default when it has one: ``_resume`` says which),
    or start over. Starting over where an earlier run left files (or checkpoints, with
    ``--resume_from_checkpoint no``) needs ``overwrite_output_dir``: its checkpoints are then removed
    (by the process that saves), so that a later resume cannot pick one of them."""
    given = args.resume_from_checkpoint
    fresh = given is not None and str(given).lower() in _NO
    if given is not None and not fresh and str(given).lower() not in ("last", "true", "yes"):
        return  # a checkpoint named by its path: resumed from, whatever else is there
    earlier = earlier_run(args.output_dir)
    if not earlier or (earlier.checkpoints and not fresh):
        return
    if not args.overwrite_output_dir:
        what = "checkpoints" if earlier.checkpoints else "no checkpoint"
        raise RecipeError(
            f"output_dir {args.output_dir!r} holds an earlier run ({earlier.names()}; {what}) and this run would "
            "start over: add --overwrite_output_dir true to replace it, or give another --output_dir"
            + ("" if not earlier.checkpoints else ", or drop --resume_from_checkpoint no to resume")
        )
    if args.should_save:
        for folder in earlier.checkpoints:
            shutil.rmtree(folder, ignore_errors=True)
    removed = f"; its {len(earlier.checkpoints)} checkpoint(s) removed" if earlier.checkpoints else ""
    _say(f"output_dir {args.output_dir} holds an earlier run ({earlier.names()}): starting over "
         f"(overwrite_output_dir){removed}")  # fmt: skip


def _resume(trainer: RingTrainer) -> str | None:
    """The checkpoint to resume from: ``--resume_from_checkpoint`` (a path, or ``no``), by default
    the newest complete one in ``output_dir`` (skipped ones are logged), else none."""
    given = trainer.args.resume_from_checkpoint
    if given is not None and str(given).lower() in _NO:
        return None
    if given is not None and str(given).lower() not in ("last", "true", "yes"):
        return trainer._resolve_checkpoint(str(given))
    return trainer._resolve_checkpoint("last")


def _step(checkpoint: str) -> int | None:
    """The optimizer step a checkpoint was saved at (its ``trainer_state.json``), ``None`` if unknown."""
    try:
        return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Clock:
    """Wall seconds (this process) and CPU seconds (summed over the launched processes at ``total``)
    of the runner's phases: ``summary["seconds"]``, ``summary["cpu_seconds"]``. Timing only."""

    def __init__(self) -> None:
        self.marks = [(time.perf_counter(), time.process_time())]
        self.names: list[str] = []

    def lap(self, name: str) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))
        self.names.append(name)

    def total(self, device: Any) -> tuple[dict[str, float], dict[str, float]]:
        import torch
        import torch.distributed as dist

        wall = [b[0] - a[0] for a, b in zip(self.marks, self.marks[1:])]
        cpu = torch.tensor([b[1] - a[1] for a, b in zip(self.marks, self.marks[1:])], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            cpu = cpu.to(device)
            dist.all_reduce(cpu)
        return ({n: round(w, 1) for n, w in zip(self.names, wall)},
                {n: round(float(c), 1) for n, c in zip(self.names, cpu.cpu())})  # fmt: skip


def run(recipe: Recipe) -> dict[str, Any]:
    """Train a parsed recipe on this process; returns the summary (also written to output_dir)."""
    t0 = time.perf_counter()
    clock = _Clock()
    args = recipe.args
    if recipe.trainer == "sft":
        args.train_sampling_strategy = "sequential"  # StagedDataset lays the data out along the steps
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # everything that can be refused is refused before the data is built or any weight is read
    check_layout(recipe, world)
    prepare_output_dir(args)
    config = model_config(recipe.model, recipe.path)
    check_ulysses(args, config)
    lengths = [s["seq_len"] for s in stages_of(recipe.data, recipe.trainer)]
    longest = max([*lengths, (recipe.data.get("eval") or {}).get("seq_len", 0)])
    vision = recipe.data.get("processor") is not None
    check_ring_model(config, recipe.model.get("attn_implementation", "ring"), args.cp_size, longest, vision)
    vocab_size = config.get_text_config().vocab_size
    processor = None
    if vision:
        processor = build_processor(recipe.data["processor"], recipe.data.get("tokenizer"))
        tokenizer = getattr(processor, "tokenizer", processor)
        if len(tokenizer) > vocab_size:
            raise RecipeError(f"data.processor: its tokenizer has {len(tokenizer)} tokens, more than the model's "
                              f"vocab_size {vocab_size}; give the model's processor, or raise vocab_size")  # fmt: skip
        args.remove_unused_columns = False  # the pixel tensors reach the model
    else:
        tokenizer = _tokenizer(recipe) if recipe.data.get("task") != "passkey" else None
    if recipe.trainer == "sft":
        train = build_train_dataset(recipe, world // args.cp_size, tokenizer, vocab_size, processor, config)
        model = build_model(recipe.model, recipe.lora, args.seed, recipe.path, vision)
        trainer = RingTrainer(model=model, args=args, train_dataset=train,
                              data_collator=collate_multimodal if vision else collate,
                              processing_class=tokenizer)  # fmt: skip
    else:  # DPO, GRPO: TRL's trainers with the ring (hf_ring.recipes.post)
        from .post import post_dataset, post_trainer

        pairs = post_dataset(recipe, tokenizer, vocab_size)
        model = build_model(recipe.model, recipe.lora, args.seed, recipe.path)
        trainer = post_trainer(recipe, model, pairs, tokenizer)
    summary: dict[str, Any] = {"trainer": recipe.trainer, "cp_size": trainer.cp_size, "dp_size": trainer.dp_size}
    resume = _resume(trainer)
    if resume is not None:
        step = _step(resume)
        _say(f"resuming from {resume} (step {step if step is not None else '?'} of {args.max_steps}); "
             "--resume_from_checkpoint no --overwrite_output_dir true starts over")  # fmt: skip
    elif earlier_run(args.output_dir).checkpoints and str(args.resume_from_checkpoint).lower() not in _NO:
        _say(f"starting at step 0: no checkpoint in {args.output_dir} can be resumed from (the warning above says why)")
    evaluation = recipe.data.get("eval")
    eval_seed = (evaluation or {}).get("seed", args.seed)  # held-out samples: data.eval.seed, else the run's seed
    if evaluation:
        summary["eval"] = {**evaluation, "seed": eval_seed}
    clock.lap("setup")
    if evaluation and resume is None:
        summary["accuracy_before"] = passkey_accuracy(trainer, evaluation["seq_len"], evaluation["samples"], eval_seed)
        if trainer.is_world_process_zero():
            print(json.dumps({"passkey_accuracy_before": summary["accuracy_before"], **evaluation}), flush=True)
        clock.lap("eval_before")
    result = trainer.train(resume_from_checkpoint=resume)
    clock.lap("train")
    if evaluation:
        summary["accuracy_after"] = passkey_accuracy(trainer, evaluation["seq_len"], evaluation["samples"], eval_seed)
        clock.lap("eval_after")
    out = Path(args.output_dir)
    trainer.save_model(str(out / "final"), merged=args.save_merged_model)
    clock.lap("save")
    history = [h for h in trainer.state.log_history if "loss" in h]
    seconds, cpu_seconds = clock.total(args.device)
    summary.update(
        steps=trainer.state.global_step,
        train_seconds=round(result.metrics.get("train_runtime", 0.0), 1),
        wall_seconds=round(time.perf_counter() - t0, 1),
        final_loss=history[-1]["loss"] if history else None,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
    )
    if trainer.is_world_process_zero():
        with open(out / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(h) + "\n" for h in history)
        if plot_loss(history, out / "loss.png", f"{out.name}: CP={trainer.cp_size}, DP={trainer.dp_size}"):
            summary["plot"] = str(out / "loss.png")
        else:
            print(f"hf-ring train: {out / 'loss.png'} not drawn: matplotlib is not installed "
                  "(pip install 'hf-ring[plots]'); the losses are in metrics.jsonl", flush=True)  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse_recipe(sys.argv[1:] if argv is None else argv))
