"""The data and the trainer of a DPO or GRPO recipe (``trainer: dpo | grpo``), for the runner.

DPO: ``data.path`` holds preference pairs as TRL's ``DPOTrainer`` takes them (json/jsonl files, a
``save_to_disk`` folder or a hub dataset with ``prompt``, ``chosen`` and ``rejected``; text or
conversations), trained by ``RingDPOTrainer``; with a ``lora`` section the reference model is the
policy with its adapter disabled. GRPO: ``data.path`` holds ``prompt``s (any other column reaches
the reward functions as a keyword argument, as in TRL), ``data.rewards`` the reward functions
(``hf_ring.recipes.rewards``), trained by ``RingGRPOTrainer``. Both need a tokenizer
(``data.tokenizer``, or the model's ``name_or_path`` / ``init_from``).
"""

from __future__ import annotations

from typing import Any

from ..errors import RecipeError
from .data import load_documents, stages_of
from .recipe import Recipe
from .rewards import reward_functions

__all__ = ["COLUMNS", "post_dataset", "post_trainer"]

# the columns each trainer needs
COLUMNS = {"dpo": ("prompt", "chosen", "rejected"), "grpo": ("prompt",)}


def _check_prompts(ds: Any, tokenizer: Any, room: int, seq_len: int, completion: int) -> None:
    """Refuse a text prompt of more than ``room`` tokens: with its completion it would pass the
    ``seq_len`` the recipe is planned (and checked against the ring) for."""
    for i, prompt in enumerate(ds["prompt"]):
        if isinstance(prompt, str) and len(tokenizer(prompt)["input_ids"]) > room:
            raise RecipeError(
                f"data: prompt {i} has {len(tokenizer(prompt)['input_ids'])} tokens, more than data.seq_len={seq_len} "
                f"- max_completion_length={completion} = {room}; raise data.seq_len, or shorten the prompts"
            )


def post_dataset(recipe: Recipe, tokenizer: Any, vocab_size: int | None) -> Any:
    """The training data of a DPO / GRPO recipe, its columns and tokenizer checked: the columns the
    trainer needs (``COLUMNS``), a tokenizer whose ids fit the model's ``vocab_size``, and (GRPO)
    prompts that leave room for ``max_completion_length`` in ``data.seq_len``."""
    trainer, data = recipe.trainer, recipe.data
    if tokenizer is None:
        raise RecipeError(f"data.tokenizer: trainer {trainer} needs a tokenizer (data.tokenizer, or a model with "
                          "name_or_path or init_from)")  # fmt: skip
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise RecipeError(f"data.tokenizer: {len(tokenizer)} tokens, more than the model's vocab_size {vocab_size}: "
                          "give the model's tokenizer, or a model whose vocab_size covers it")  # fmt: skip
    ds = load_documents(data)
    missing = [c for c in COLUMNS[trainer] if c not in ds.column_names]
    if missing:
        raise RecipeError(f"data.path {data['path']!r}: no column {missing} in {ds.column_names}; trainer {trainer} "
                          f"reads {list(COLUMNS[trainer])}")  # fmt: skip
    if trainer == "grpo":
        seq_len, completion = stages_of(data, trainer)[0]["seq_len"], recipe.args.max_completion_length
        _check_prompts(ds, tokenizer, seq_len - completion, seq_len, completion)
    return ds


def post_trainer(recipe: Recipe, model: Any, dataset: Any, tokenizer: Any) -> Any:
    """``RingDPOTrainer`` or ``RingGRPOTrainer`` of a recipe over ``dataset`` (``post_dataset``)."""
    if recipe.trainer == "dpo":
        from ..trainer.dpo import RingDPOTrainer

        return RingDPOTrainer(model=model, args=recipe.args, train_dataset=dataset, processing_class=tokenizer)
    from ..trainer.grpo import RingGRPOTrainer

    rewards = reward_functions(recipe.data["rewards"])
    return RingGRPOTrainer(model=model, reward_funcs=rewards, args=recipe.args, train_dataset=dataset,
                           processing_class=tokenizer)  # fmt: skip
