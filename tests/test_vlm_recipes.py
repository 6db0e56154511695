"""Recipes with image and video examples (``data.processor``; ``hf_ring.recipes.vlm_data``): examples
given as file paths or arrays run through a processor, labelled (visual tokens -100) and packed as
documents into rows of ``seq_len``; the tiny CPU recipe trains at CP = 2 with the losses of one process;
the Qwen3.5-9B long-video recipe is priced by the planner with its visual share; what can go wrong is
refused naming the field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hf_ring.errors import RecipeError
from hf_ring.recipes import RECIPES_DIR, recipe_plan
from testkit.spawn import run_ranks
from tests.test_training import recipe_run

TOKENIZER = RECIPES_DIR / "tiny" / "tokenizer"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def _processor():
    from hf_ring.recipes.vlm_data import build_processor

    return build_processor("tiny-qwen-vl", str(TOKENIZER))


def _examples(tmp_path: Path) -> Path:
    """Three examples: a PNG image by path, a video as a .npy path, and an image as an inline array."""
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    np.save(tmp_path / "clip.npy", rng.integers(0, 256, (3, 8, 16, 3), dtype=np.uint8))  # 3 frames: padded to 4
    rows = [{"text": f"w1 {IMAGE} w2 w3", "images": ["a.png"]},
            {"text": f"w4 {VIDEO} w5", "videos": ["clip.npy"]},
            {"text": f"w6 {IMAGE} w7", "images": [rng.integers(0, 256, (8, 8, 3)).tolist()]}]  # fmt: skip
    path = tmp_path / "vlm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(path: Path, seq_len: int, **data):
    from hf_ring.recipes.data import load_documents
    from hf_ring.recipes.vlm_data import multimodal_dataset

    section = {"path": str(path), "processor": "tiny-qwen-vl", "seq_len": seq_len, **data}
    return multimodal_dataset(load_documents(section), section, _processor(), seq_len)


def test_examples_are_processed_labelled_and_packed(tmp_path: Path) -> None:
    from hf_ring.recipes.vlm_data import collate_multimodal

    rows = _rows(_examples(tmp_path), 32)
    # tokens: 3 + 2 vision start/end + 4 image; 2 + 2 frame groups x (start, 8 video tokens, end); 2 + 6: 9, 22, 8
    assert len(rows) == 2  # [9 + 22 + 1 padding | 8 + 24 padding] in rows of 32
    first = rows[0]
    assert first["input_ids"].shape == first["labels"].shape == first["mm_token_type_ids"].shape == (1, 32)
    assert first["image_grid_thw"].tolist() == [[1, 4, 4]] and first["video_grid_thw"].tolist() == [[2, 4, 8]]
    assert first["pixel_values"].shape == (16, 3 * 2 * 2 * 2) and first["pixel_values_videos"].shape == (64, 24)
    types, labels, ids = first["mm_token_type_ids"][0], first["labels"][0], first["input_ids"][0]
    assert int((types == 1).sum()) == 4 and int((types == 2).sum()) == 16
    assert bool((labels[types != 0] == -100).all()) and bool((labels[ids >= 64] == -100).all())  # vision tokens
    assert bool((labels[31:] == -100).all()) and labels[0] == ids[0]  # the padding document; text is a target
    pos = first["position_ids"][0]
    assert pos[0] == 0 and pos[9] == 0 and pos[31] == 0  # restart at each document, and at the padding
    batch = collate_multimodal([rows[0], rows[1]])
    assert batch["input_ids"].shape == (2, 32) and len(batch["image_grid_thw"]) == 2
    assert batch["pixel_values"].shape[0] == 32 and batch["position_ids"].shape == (2, 32)


def test_qwen_rows_carry_mrope_positions(tmp_path: Path) -> None:
    """With the model built on the meta device (``run._rope_model``), rows get ``[4, 1, N]`` positions."""
    from hf_ring.recipes.data import load_documents
    from hf_ring.recipes.recipe import model_config, parse_recipe
    from hf_ring.recipes.run import _rope_model
    from hf_ring.recipes.vlm_data import collate_multimodal, multimodal_dataset

    r = parse_recipe(["--cp_size", "1"], source="tiny-cpu-vlm")
    rope = _rope_model(model_config(r.model, r.path))
    section = {"path": str(_examples(tmp_path)), "processor": "tiny-qwen-vl", "seq_len": 32}
    rows = multimodal_dataset(load_documents(section), section, _processor(), 32, rope)
    pos = rows[0]["position_ids"]
    assert pos.shape == (4, 1, 32) and pos[0, 0, 9] == 0  # text row restarts at the second document
    assert not torch.equal(pos[2], pos[3])  # height and width differ inside an image
    assert collate_multimodal([rows[0], rows[1]])["position_ids"].shape == (4, 2, 32)


def test_refusals_name_the_field(tmp_path: Path) -> None:
    path = _examples(tmp_path)
    with pytest.raises(RecipeError, match="example 1 has 22 tokens .* more than data.seq_len=16"):
        _rows(path, 16)
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"text": f"w1 {IMAGE}", "images": ["nope.png"]}) + "\n")
    with pytest.raises(RecipeError, match=r"example 0 images\[0\]: no such file .*nope.png"):
        _rows(missing, 32)
    with pytest.raises(RecipeError, match="example 0 has no text in field 'caption'"):
        _rows(path, 32, text_field="caption")
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text(json.dumps({"text": "w1 w2", "images": ["a.png"]}) + "\n")
    with pytest.raises(RecipeError, match="example 0: the processor refused it .*fewer placeholders"):
        _rows(fewer, 32)
    from hf_ring.recipes.vlm_data import build_processor

    with pytest.raises(RecipeError, match=r"data.processor '/no/such/processor': no processor could be built"):
        build_processor("/no/such/processor")
    with pytest.raises(RecipeError, match="tiny-qwen-vl needs data.tokenizer"):
        build_processor("tiny-qwen-vl")
    from hf_ring.recipes.sections import resolve_data

    with pytest.raises(RecipeError, match="data.visual_fraction: the share of visual tokens, between 0 and 1"):
        resolve_data({"path": "x.jsonl", "seq_len": 8, "processor": "p", "visual_fraction": 1.5})
    with pytest.raises(RecipeError, match=r"\['visual_fraction'\] are for image / video examples: give data.proc"):
        resolve_data({"path": "x.jsonl", "seq_len": 8, "visual_fraction": 0.5})
    with pytest.raises(RecipeError, match=r"\['add_eos', 'boundaries'\] are not used with image / video examples"):
        resolve_data({"path": "x.jsonl", "seq_len": 8, "processor": "p", "add_eos": True, "boundaries": "pad"})


def test_recipe_model_has_its_tower_frozen() -> None:
    from hf_ring.recipes.recipe import build_model, parse_recipe

    r = parse_recipe(["--cp_size", "1"], source="tiny-cpu-vlm")
    model = build_model(r.model, r.lora, 0, r.path, vision=True)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n and "language_model" in n for n in trained)
    assert any("visual" in n for n, _ in model.named_parameters())  # the tower is there, frozen


def _qwen3_5_recipe(tmp_path: Path) -> str:
    """tiny-cpu-vlm with a tiny Qwen3.5 (Gated DeltaNet + attention, the 9B video recipe's family)."""
    raw = yaml.safe_load((RECIPES_DIR / "tiny-cpu-vlm.yaml").read_text())
    config = raw["model"]["config"]
    config["model_type"] = "qwen3_5"
    config["text_config"].update(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                 linear_conv_kernel_dim=4)  # fmt: skip
    config["text_config"]["rope_parameters"]["partial_rotary_factor"] = 0.5
    config["vision_config"].pop("deepstack_visual_indexes")
    raw["lora"]["target_modules"] += ["in_proj_qkv", "in_proj_z", "out_proj"]
    for key in ("path", "tokenizer"):
        raw["data"][key] = str(RECIPES_DIR / raw["data"][key])
    path = tmp_path / "tiny-qwen3.5-vlm.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_tiny_vlm_recipe_trains_at_cp2_as_one_process(tmp_path: Path, family: str) -> None:
    """``torchrun --nproc_per_node 2 -m hf_ring.cli train tiny-cpu-vlm`` (and the same with a tiny
    Qwen3.5): every step's loss equals one process's (CP = 1) within 1e-5, finite, and the adapter is
    written."""
    recipe = "tiny-cpu-vlm" if family == "qwen3_vl" else _qwen3_5_recipe(tmp_path)
    ring = run_ranks(2, recipe_run, recipe, ["--output_dir", str(tmp_path / "cp2")], timeout=300)
    one = run_ranks(1, recipe_run, recipe, ["--cp_size", "1", "--output_dir", str(tmp_path / "cp1")], timeout=300)
    steps = yaml.safe_load((RECIPES_DIR / "tiny-cpu-vlm.yaml").read_text())["max_steps"]
    logs, ref = ring[0]["logs"], one[0]["logs"]
    assert [h["step"] for h in logs] == [h["step"] for h in ref] == list(range(1, steps + 1))
    for a, b in zip(logs, ref):
        assert math.isfinite(a["loss"]) and abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (logs, ref)
    assert ring[0]["summary"]["cp_size"] == 2 and ring[1]["summary"]["steps"] == steps
    assert (tmp_path / "cp2" / "final" / "adapter_model.safetensors").exists()


def test_video_recipe_is_priced_with_its_visual_share() -> None:
    from hf_ring.recipes.recipe import parse_recipe

    r = parse_recipe(["--output_dir", "runs/parse-test"], source="qwen3.5-9b-video-256k")
    assert r.data["processor"] == "Qwen/Qwen3.5-9B" and r.args.cp_size == 8
    p = recipe_plan("qwen3.5-9b-video-256k")
    assert p.settings.visual_fraction == 0.9 and p.settings.seq_len == 262144 and p.settings.mode == "lora"
    total = p.summary_gib()["total"]
    text = recipe_plan("qwen3.5-9b-video-256k", visual_fraction=0.0)
    assert "vision tower forward, merge" in p.phases and "vision tower forward, merge" not in text.phases
    assert text.summary_gib()["total"] < total < 80, total  # 19.1 GiB per GPU when written (frames spread)
    assert any("vision tower" in n and "frozen" in n for n in p.notes)
    stated = yaml.safe_load((RECIPES_DIR / "qwen3.5-9b-video-256k.yaml").read_text())["memory_gb"]
    assert stated["total"] == pytest.approx(total, abs=0.01)  # hf-ring plan --write is current
