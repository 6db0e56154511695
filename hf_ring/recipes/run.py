"""The recipe runner: ``hf-ring train RECIPE [--field value ...]`` on every process.

    accelerate launch --config_file $(hf-ring train --config fsdp2-8gpu) -m hf_ring.cli train \\
        llama-3.1-8b-128k [--max_steps 4 --output_dir runs/try]

Parses the recipe (``hf_ring.recipes.recipe``), resolves the model's config and checks it (no
weights), builds the data once (``hf_ring.recipes.data``; token ids checked against the config's
``vocab_size``), the model (LoRA through PEFT), and trains it with ``RingTrainer``: progress bar,
``report_to``, checkpoints every ``save_steps`` (sharded under FSDP2) and resume are ``Trainer``'s,
sealed by ``RingTrainer`` (a kill cannot break them). A run resumes from the newest complete
checkpoint in ``output_dir`` unless ``--resume_from_checkpoint`` names one (a path) or is ``no``. At
the end ``trainer.save_model`` writes ``output_dir/final`` (a PEFT adapter, or the full model),
``metrics.jsonl`` (the logged steps), ``summary.json`` and, when matplotlib is installed,
``loss.png``; passkey runs with ``data.eval`` report retrieval accuracy before and after.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..data.passkey import VOCAB as PASSKEY_VOCAB
from ..trainer import RingTrainer
from .data import StagedDataset, collate, load_documents, pack, passkey_stage, stages_of, tokenize
from .evaluate import passkey_accuracy
from .plots import plot_loss
from .recipe import Recipe, build_model, check_ring_model, model_config, parse_recipe

__all__ = ["build_train_dataset", "main", "run"]


def _tokenizer(recipe: Recipe) -> Any:
    ref = recipe.data.get("tokenizer") or recipe.model.get("name_or_path") or recipe.model.get("init_from")
    if ref is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ref)


def build_train_dataset(recipe: Recipe, dp_size: int, tokenizer: Any = None, vocab_size: int | None = None
                        ) -> StagedDataset:  # fmt: skip
    """The training data of a recipe, stages laid out along the optimizer steps (built once:
    tokenised and packed into datasets' cache by the main process of each node first). Token ids
    outside ``[0, vocab_size)`` (the model config's) are refused while the data is built."""
    args, data = recipe.args, recipe.data
    stages = stages_of(data)
    if stages[-1]["steps"] == 0:
        stages[-1]["steps"] = args.max_steps
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp_size
    if data.get("task") == "passkey":
        if vocab_size is not None and vocab_size < PASSKEY_VOCAB:
            raise ValueError(f"data.task passkey uses token ids 0..{PASSKEY_VOCAB - 1}, but the model's vocab_size "
                             f"is {vocab_size}: set model.config.vocab_size >= {PASSKEY_VOCAB}")  # fmt: skip
        parts = [(passkey_stage(s["seq_len"], args.seed, k), s["steps"]) for k, s in enumerate(stages)]
        return StagedDataset(parts, per_step, args.max_steps, shuffle_seed=None)
    with args.main_process_first(desc="tokenize and pack the data"):
        docs = tokenize(load_documents(data), data, tokenizer)
        pad = data.get("pad_id", getattr(tokenizer, "pad_token_id", None) or 0)
        packed = {
            s["seq_len"]: pack(docs, s["seq_len"], data.get("boundaries", "pad"), pad_id=pad,
                               num_proc=data.get("num_proc"), vocab_size=vocab_size)
            for s in stages
        }  # fmt: skip
    return StagedDataset([(packed[s["seq_len"]], s["steps"]) for s in stages], per_step, args.max_steps, args.seed)


def _resume(trainer: RingTrainer) -> str | None:
    """The checkpoint to resume from: ``--resume_from_checkpoint`` (a path, or ``no``), by default
    the newest complete one in ``output_dir`` (skipped ones are logged), else none."""
    given = trainer.args.resume_from_checkpoint
    if given is not None and str(given).lower() in ("no", "false", "none", ""):
        return None
    if given is not None and str(given).lower() not in ("last", "true", "yes"):
        return trainer._resolve_checkpoint(str(given))
    return trainer._resolve_checkpoint("last")


def run(recipe: Recipe) -> dict[str, Any]:
    """Train a parsed recipe on this process; returns the summary (also written to output_dir)."""
    t0 = time.perf_counter()
    args = recipe.args
    args.train_sampling_strategy = "sequential"  # StagedDataset lays the data out along the steps
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.cp_size:
        raise ValueError(f"cp_size={args.cp_size} does not divide the {world} processes")
    # everything that can be refused is refused before the data is built or any weight is read
    config = model_config(recipe.model, recipe.path)
    longest = max([s["seq_len"] for s in stages_of(recipe.data)] + [(recipe.data.get("eval") or {}).get("seq_len", 0)])
    check_ring_model(config, recipe.model.get("attn_implementation", "ring"), args.cp_size, longest)
    tokenizer = _tokenizer(recipe) if recipe.data.get("task") != "passkey" else None
    train = build_train_dataset(recipe, world // args.cp_size, tokenizer, config.get_text_config().vocab_size)
    model = build_model(recipe.model, recipe.lora, args.seed, recipe.path)
    trainer = RingTrainer(
        model=model, args=args, train_dataset=train, data_collator=collate, processing_class=tokenizer
    )
    summary: dict[str, Any] = {"cp_size": trainer.cp_size, "dp_size": trainer.dp_size}
    resume = _resume(trainer)
    evaluation = recipe.data.get("eval")
    eval_seed = (evaluation or {}).get("seed", args.seed)  # held-out samples: data.eval.seed, else the run's seed
    if evaluation:
        summary["eval"] = {**evaluation, "seed": eval_seed}
    if evaluation and resume is None:
        summary["accuracy_before"] = passkey_accuracy(trainer, evaluation["seq_len"], evaluation["samples"], eval_seed)
        if trainer.is_world_process_zero():
            print(json.dumps({"passkey_accuracy_before": summary["accuracy_before"], **evaluation}), flush=True)
    result = trainer.train(resume_from_checkpoint=resume)
    if evaluation:
        summary["accuracy_after"] = passkey_accuracy(trainer, evaluation["seq_len"], evaluation["samples"], eval_seed)
    out = Path(args.output_dir)
    trainer.save_model(str(out / "final"), merged=args.save_merged_model)
    history = [h for h in trainer.state.log_history if "loss" in h]
    summary.update(
        steps=trainer.state.global_step,
        train_seconds=round(result.metrics.get("train_runtime", 0.0), 1),
        wall_seconds=round(time.perf_counter() - t0, 1),
        final_loss=history[-1]["loss"] if history else None,
    )
    if trainer.is_world_process_zero():
        with open(out / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(h) + "\n" for h in history)
        if plot_loss(history, out / "loss.png", f"{out.name}: CP={trainer.cp_size}, DP={trainer.dp_size}"):
            summary["plot"] = str(out / "loss.png")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse_recipe(sys.argv[1:] if argv is None else argv))
