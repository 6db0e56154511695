"""``RingDPOTrainer`` on image pairs: a tiny Qwen3-VL (``testkit.vlm``) at CP = 2 (and 4) against one-process
``trl.DPOTrainer`` (sdpa) on the same pairs, float32, TRL's own vision collator
(``DataCollatorForVisionPreference``: the prompt's image repeated for the chosen and the rejected row,
``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``). Each image batch enters the model whole on
every rank and is cut at the text decoder (``shard_batch``); the loss, every logged metric and every
gradient at every optimizer step are those of one process: LoRA on the decoder with the vision tower frozen
(the adapter disabled as reference), and full fine-tuning with the tower trained and a separate reference.
``padding_free=True`` packs each micro-batch's rows with their images (TRL's own ``DPOTrainer`` pads: the
reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from testkit.post import dpo_arguments
from testkit.spawn import launcher_env, run_ranks

pytest.importorskip("trl")

from tests.test_dpo import SKIP, _Grads, assert_same_runs  # noqa: E402

CASES = {
    "lora-decoder-frozen-tower": dict(loss_type=["sigmoid"], lora=True, ref=False),
    "lora-decoder-frozen-tower-cp4": dict(loss_type=["sigmoid"], lora=True, ref=False, cp=4),
    "full-trained-tower-sigmoid+ipo-ld_alpha": dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5],
                                                    lora=False, ref=True, ld_alpha=0.5),
    # padding_free=True: the 2 pairs' 4 rows as documents of one row, each with its image and its own M-RoPE rows
    "lora-decoder-frozen-tower-packed": dict(loss_type=["sigmoid"], lora=True, ref=False, padding_free=True),
    "full-trained-tower-hinge-packed-ld_alpha-cp4": dict(loss_type=["hinge"], lora=False, ref=True, cp=4,
                                                         padding_free=True, ld_alpha=0.3),
}  # fmt: skip
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _pairs() -> list[dict]:
    """8 pairs, each prompt with one image of its own size (4 to 9 image tokens) between words."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 77, (n,), generator=g))

    out = []
    for i, (p, c, r) in enumerate(torch.randint(2, 12, (8, 3), generator=g).tolist()):
        h, w = (8, 12, 12, 8)[i % 4], (8, 8, 12, 12)[i % 4]
        pixels = (np.random.RandomState(i).rand(h, w, 3) * 255).astype("uint8")
        out.append({"images": [Image.fromarray(pixels)], "prompt": f"{words(p)} {IMAGE} {words(2)}",
                    "chosen": " " + words(c), "rejected": " " + words(r)})  # fmt: skip
    return out


def dpo_vlm_run(kind: str, case: str, out: str, data_dir: str) -> dict:
    from datasets import load_from_disk
    from trl import DPOConfig, DPOTrainer

    from hf_ring.trainer.dpo import RingDPOConfig, RingDPOTrainer
    from testkit.vlm import tiny_model, tiny_processor

    spec = dict(CASES[case])
    lora, ref, cp = spec.pop("lora"), spec.pop("ref"), spec.pop("cp", 2)
    ring = kind == "ring"
    if ring:
        launcher_env()
    attn = "ring" if ring else "sdpa"
    common = dpo_arguments(out, max_length=None, **spec)
    args = RingDPOConfig(cp_size=cp, **common) if ring else DPOConfig(**common)
    model = tiny_model("qwen3_vl", attn, dtype=torch.float32)
    extra: dict = {}
    if ref:
        extra["ref_model"] = tiny_model("qwen3_vl", attn, dtype=torch.float32, seed=1)
    if lora:  # the decoder's attention and MLP only: the vision tower stays frozen
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8,
                                          target_modules=r".*language_model.*\.(q_proj|v_proj|up_proj)")  # fmt: skip
    holder: list = [None]
    keep = _Grads(holder)
    trainer = (RingDPOTrainer if ring else DPOTrainer)(
        model=model, args=args, train_dataset=load_from_disk(data_dir), processing_class=tiny_processor(),
        callbacks=[keep], **extra
    )
    holder[0] = trainer.model
    seen: list[str] = []
    rows: list[int] = []
    if ring:  # the batches the ring ran carry the images
        from hf_ring.trainer import fused_head

        shard = fused_head.shard_batch
        fused_head.shard_batch = lambda batch, **kw: seen.extend(sorted(batch)) or rows.append(
            batch["input_ids"].shape[0]) or shard(batch, **kw)
    try:
        trainer.train()
    finally:
        if ring:
            fused_head.shard_batch = shard
    logs = [{k: v for k, v in h.items() if k not in SKIP and not k.endswith(("_runtime", "_per_second"))}
            for h in trainer.state.log_history if "loss" in h]  # fmt: skip
    tower = [n for n in keep.steps[0] if ".visual." in n] if keep.steps else []
    return {"logs": logs, "grads": keep.steps, "cp": getattr(trainer, "cp_size", None), "keys": sorted(set(seen)),
            "rows": sorted(set(rows)), "tower_grads": len(tower)}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_ring_dpo_trainer_with_images_matches_single_process_dpo_trainer(tmp_path: Path, case: str) -> None:
    from datasets import Dataset

    for kind in ("ring", "ref"):
        Dataset.from_list(_pairs()).save_to_disk(tmp_path / f"pairs-{kind}")
    cp = CASES[case].get("cp", 2)
    ring = run_ranks(cp, dpo_vlm_run, "ring", case, str(tmp_path / "ring"), str(tmp_path / "pairs-ring"), timeout=400)
    ref = run_ranks(1, dpo_vlm_run, "ref", case, str(tmp_path / "ref"), str(tmp_path / "pairs-ref"), timeout=400)[0]
    assert ring[0]["cp"] == cp and len(ref["logs"]) == len(ring[0]["logs"]) == 2
    assert {"pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(ring[0]["keys"]), ring[0]["keys"]
    assert ring[0]["rows"] == ([1] if CASES[case].get("padding_free") else [4]), ring[0]["rows"]
    assert len(ref["grads"]) == len(ring[0]["grads"]) == 2
    # the tower: trained (its gradients compared too) or frozen (none)
    assert (ref["tower_grads"] > 0) == (not CASES[case]["lora"]) and ring[0]["tower_grads"] == ref["tower_grads"]
    assert_same_runs(case, ring, ref, "RingDPOTrainer", "DPOTrainer")


def test_pack_image_rows_gives_each_row_its_images_and_refuses_images_without_grids() -> None:
    from hf_ring.trainer.rows import pack_image_rows
    from testkit.vlm import documents, qwen_batch, tiny_model

    rows = [[("text", 3), ("image", 4), ("text", 2)], [("text", 2), ("image", 2), ("image", 4), ("text", 1)]]
    batch = qwen_batch(rows)
    model = tiny_model("qwen3_vl", "sdpa")
    packed, keep = pack_image_rows(batch, model)
    assert keep.equal(batch["attention_mask"].bool())
    docs = documents(rows, text_positions=False)
    assert packed["pixel_values"].equal(torch.cat([d["pixel_values"] for d in docs]))
    assert packed["input_ids"].equal(torch.cat([d["input_ids"] for d in docs], 1))
    assert packed["position_ids"].shape == (4, 1, keep.sum()) and packed["position_ids"][0, 0, 0] == 0
    with pytest.raises(NotImplementedError, match="Qwen-style.*padding_free=False"):
        pack_image_rows({k: v for k, v in batch.items() if k != "image_grid_thw"}, model)
