"""Recipes: the YAML files that configure a run, and everything that reads them.

The recipes shipped with hf_ring live in this package (``hf_ring/recipes/*.yaml``, package data,
found through ``importlib.resources``), so a bare name works from an installed wheel:

    hf-ring plan llama-3.1-8b-128k                 # or a path: hf-ring plan my-run.yaml
    hf-ring plan llama-3.1-8b-128k --write         # refresh its memory_gb line
    hf-ring train --list                           # recipes, and the accelerate launch configs
    accelerate launch --config_file $(hf-ring train --config fsdp2-8gpu) -m hf_ring.cli train \\
        llama-3.1-8b-128k --max_steps 4

The accelerate launch configs ship here too (``accelerate/*.yaml``). Modules: ``reader`` (find and
read a recipe, the planner's view of it; imported here, light), ``sections`` (the one resolver of
the model section and of the data section, for the planner and the runner alike; light),
``recipe`` (a recipe and its command-line flags -> ``RingTrainingArguments`` and the sections; the
model it builds), ``data`` (the data section through ``datasets``), ``vlm_data`` (image and video
examples through a processor, packed as documents), ``run`` (the runner around ``RingTrainer``),
``evaluate`` (passkey accuracy) and ``plots`` (the loss curve). Only ``reader`` is
imported with this package: the others import transformers.
"""

from .reader import (
    RECIPES_DIR,
    description,
    launch_config_path,
    launch_configs,
    missing_recipe,
    packaged_recipes,
    read_recipe,
    recipe_memory,
    recipe_model,
    recipe_model_config,
    recipe_notes,
    recipe_path,
    recipe_plan,
    recipe_settings,
    write_recipe_memory,
)

__all__ = [
    "RECIPES_DIR",
    "description",
    "launch_config_path",
    "launch_configs",
    "missing_recipe",
    "packaged_recipes",
    "read_recipe",
    "recipe_memory",
    "recipe_model",
    "recipe_model_config",
    "recipe_notes",
    "recipe_path",
    "recipe_plan",
    "recipe_settings",
    "write_recipe_memory",
]
