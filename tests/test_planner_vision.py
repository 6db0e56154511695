"""The planner prices a multimodal model's vision tower: its parameters as transformers builds them, its
memory and time when the data has visual tokens, nothing when it has none."""

from __future__ import annotations

from dataclasses import replace

import pytest
import transformers

from hf_ring.cli import main
from hf_ring.planner import PlanSettings, model_shape, plan
from hf_ring.planner.vision import VisionShape

GiB = 2**30

TOWERS = {
    "qwen3_vl": (dict(vision_config=dict(depth=2)), ("visual",)),
    "qwen3_5": (dict(vision_config=dict(depth=2)), ("visual",)),
    "gemma3": (
        dict(vision_config=dict(num_hidden_layers=2, image_size=896, patch_size=14, hidden_size=1152,
                                intermediate_size=4304, num_attention_heads=16)),
        ("vision_tower", "multi_modal_projector"),
    ),  # fmt: skip
    "llama4": (dict(vision_config=dict(num_hidden_layers=2)), ("vision_model", "multi_modal_projector")),
}


# a one-layer language model of width 64 (the towers are full width; a full-size text model would take GBs)
_TEXT = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128)  # fmt: skip
TINY_TEXT = {
    "qwen3_vl": _TEXT, "qwen3_5": _TEXT, "gemma3": _TEXT,
    "llama4": {**_TEXT, "intermediate_size_mlp": 64, "num_local_experts": 2},
}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type", sorted(TOWERS))
def test_vision_parameters_match_the_built_tower(model_type):
    """``VisionShape.params`` counts what transformers builds: blocks, patch embedding, positions, mergers and
    projector (two-block towers, the language model cut to one layer)."""
    kwargs, parts = TOWERS[model_type]
    config = transformers.AutoConfig.for_model(model_type, **kwargs, text_config=TINY_TEXT[model_type])
    model = transformers.AutoModel.from_config(config)
    built = sum(p.numel() for name in parts for p in getattr(model, name).parameters())
    shape = VisionShape.from_config(config.to_dict())
    assert shape is not None
    assert shape.params == pytest.approx(built, rel=1e-3), (shape, built)


def test_patches_per_visual_token():
    qwen = VisionShape.from_config(transformers.AutoConfig.for_model("qwen3_vl").to_dict())
    llama = VisionShape.from_config(transformers.AutoConfig.for_model("llama4").to_dict())
    gemma = VisionShape.from_config(
        {"mm_tokens_per_image": 256, "vision_config": dict(image_size=896, patch_size=14, hidden_size=1152,
                                                           intermediate_size=4304, num_attention_heads=16,
                                                           num_hidden_layers=27)})  # fmt: skip
    assert (qwen.patches_per_token, qwen.temporal_patch, qwen.mergers) == (4, 2, 4)  # 2 x 2 merge, 3 deepstack
    assert llama.patches_per_token == 4  # pixel shuffle 0.5
    assert gemma.patches_per_token == 16  # 64 x 64 patches pooled to 16 x 16 tokens
    assert VisionShape.from_config({"hidden_size": 8}) is None


SETTINGS = PlanSettings(seq_len=256 * 1024, gpus=8, cp=8, sharding="fsdp", offload=True, tiled_mlp=8192)


def test_text_only_data_prices_no_tower():
    """A multimodal model with no visual tokens in its data plans as its language model alone."""
    m = model_shape("Qwen3.5-9B")
    assert m.vision is not None
    text = plan(replace(m, vision=None), SETTINGS)
    same = plan(m, SETTINGS)
    assert same.rows == text.rows and same.phases == text.phases and same.peak == text.peak
    assert same.time is not None and same.time.vision_s == 0


def test_frozen_tower_adds_its_weights_and_an_encoding_phase():
    m = model_shape("Qwen3.5-9B")
    text = plan(m, SETTINGS)
    video = plan(m, replace(SETTINGS, visual_fraction=0.9))
    v = m.vision
    assert v is not None
    # weights: bf16, sharded over the 8 GPUs by FSDP; a frozen tower has no gradients or optimizer state
    assert video.rows["weights"] - text.rows["weights"] == pytest.approx(v.params * 2 / 8)
    assert video.rows["gradients"] == text.rows["gradients"]
    assert video.rows["optimizer state"] == text.rows["optimizer state"]
    assert "vision tower (kept for backward)" not in video.rows
    # the step's start: one block's working set over the rank's 1/8 of the patches, all the gathered
    # features, the whole merged sequence
    visual = 0.9 * SETTINGS.seq_len
    start = video.phases["vision tower forward, merge"]
    features = visual * v.out_hidden * 2
    assert start >= visual * 4 / 8 * v.block_saved(2) + features + SETTINGS.seq_len * m.hidden * 2
    assert {k: video.phases[k] for k in text.phases} == text.phases  # the decoder's phases keep nothing of it
    assert any("vision tower" in n and "frozen" in n for n in video.notes)
    assert video.time is not None and text.time is not None
    assert video.time.vision_s > 0 and video.time.total_s == pytest.approx(text.time.total_s + video.time.vision_s)
    # more visual tokens cost more
    half = plan(m, replace(SETTINGS, visual_fraction=0.5))
    assert half.phases["vision tower forward, merge"] < start and half.time.vision_s < video.time.vision_s


def test_trained_tower_keeps_its_blocks_through_the_step():
    m = model_shape("Qwen3.5-9B")
    frozen = plan(m, replace(SETTINGS, mode="full", visual_fraction=0.9))
    trained = plan(m, replace(SETTINGS, mode="full", visual_fraction=0.9, train_vision=True))
    v = m.vision
    assert v is not None
    assert trained.rows["gradients"] - frozen.rows["gradients"] == pytest.approx(v.params * 2 / 8)
    assert trained.rows["optimizer state"] - frozen.rows["optimizer state"] == pytest.approx(v.params * 12 / 8)
    kept = trained.rows["vision tower (kept for backward)"]
    assert kept == pytest.approx(0.9 * SETTINGS.seq_len * 4 / 8 * v.layers * v.hidden * 2)  # its 1/8 of the patches
    for phase, value in frozen.phases.items():
        assert trained.phases[phase] >= value + kept * (phase != "vision tower forward, merge") - 1
    assert "vision tower backward" in trained.phases
    assert trained.time is not None and frozen.time is not None
    assert trained.time.vision_s == pytest.approx(4 * frozen.time.vision_s)  # forward, recompute, 2x backward


@pytest.mark.parametrize(
    ("model", "changes", "match"),
    [
        ("Llama-3.1-8B", dict(visual_fraction=0.5), "has no vision tower"),
        ("Qwen3.5-9B", dict(visual_fraction=0.5, train_vision=True), "mode='full'"),
        ("Qwen3.5-9B", dict(train_vision=True, mode="full"), "visual_fraction > 0"),
        ("Qwen3.5-9B", dict(visual_fraction=1.5), "between 0 and 1"),
    ],
)
def test_vision_settings_that_cannot_be_priced_are_refused(model, changes, match):
    with pytest.raises(ValueError, match=match):
        plan(model_shape(model), replace(SETTINGS, **changes))


def test_cli_prices_the_tower(capsys):
    main(["plan", "Qwen3.5-9B", "--seq-len", "256K", "--gpus", "8", "--cp", "8", "--visual-fraction", "0.9",
          "--sharding", "fsdp", "--offload", "--tiled-mlp", "8K"])  # fmt: skip
    out = capsys.readouterr().out
    assert "vision tower forward, merge" in out and "+ vision tower" in out and "456M parameters (frozen)" in out
    assert "each rank encoding 1/8 of the frames" in out
