"""``RingGRPOTrainer`` on image prompts: a tiny Qwen3-VL (``testkit.vlm``) at CP = 2 and 3 (and DP 2 x CP 2)
against one-process ``trl.GRPOTrainer`` (sdpa) on the same conversational prompts (one image each, every
third two), completions and rewards, float32. TRL tokenizes each prompt with the processor (``pixel_values``,
``image_grid_thw``, ``mm_token_type_ids``) and scores left-padded prompt + completion rows; here the rows
move to the right, the images enter the model whole on every rank and the text decoder runs on this rank's
shard. The loss, every logged metric (but the two reward standard deviations, see tests/test_grpo.py) and
every gradient at every optimizer step are those of one process: LoRA on the decoder with the vision tower
frozen (KL against the adapter-disabled reference, a temperature) and full fine-tuning with the tower
trained; and a tiny Qwen3.5 (Gated DeltaNet layers) in float64. And generation with images (transformers
``generate`` with sdpa on every rank of the group), and what stays refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from testkit.post import Run
from testkit.spawn import run_ranks
from testkit.vlm import VOCAB

pytest.importorskip("trl")

from tests.test_dpo import assert_same_runs  # noqa: E402
from tests.test_grpo import SKIP, grpo_setup, keep_grads  # noqa: E402

CASES = {
    "lora-decoder-frozen-tower-grpo-kl-temperature": dict(loss_type="grpo", beta=0.05, temperature=0.7, lora=True),
    "full-trained-tower-dapo": dict(loss_type="dapo", beta=0.0, lora=False),
    # Qwen3.5: Gated DeltaNet and attention layers, M-RoPE; float64, transformers' delta rule too
    # (``_delta_rule_in_float64``)
    "qwen3_5-full-trained-tower-dapo": dict(
        loss_type="dapo", beta=0.0, lora=False, family="qwen3_5", dtype=torch.float64
    ),
    # Gemma 3: the processor's token_type_ids (its image blocks attend both ways), sliding windows of 8 tokens
    "gemma3-lora-decoder-frozen-tower-grpo-kl-temperature": dict(
        loss_type="grpo", beta=0.05, temperature=0.7, lora=True, family="gemma3"
    ),
    # float64: SigLIP's key biases have a zero gradient (softmax ignores them), in float32 1e-11 of rounding that
    # differs by 7e-4 of itself between the runs after the first step (every other gradient within 4e-6)
    "gemma3-full-trained-tower-dapo": dict(
        loss_type="dapo", beta=0.0, lora=False, family="gemma3", dtype=torch.float64
    ),
}
# the inputs TRL hands the model for each family's image prompts
QWEN_KEYS = {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
IMAGE_KEYS = {"qwen3_vl": QWEN_KEYS, "qwen3_5": QWEN_KEYS, "gemma3": {"pixel_values", "token_type_ids"}}
# a chat template for the tiny processor: the image parts as Qwen's vision tokens, then the text
TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ p['text'] }} {% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)
# Gemma 3's: each image part as its start token, which the processor expands to the image's tokens
GEMMA3_TEMPLATE = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")
SEEN: list[list[str]] = []


def _prompts(n: int = 8) -> list[dict]:
    """``n`` conversational prompts of 2 to 9 words, each with one image (every third with two) of its own
    size (4, 6 or 9 image tokens)."""
    from PIL import Image

    g = torch.Generator().manual_seed(3)
    out = []
    for i, size in enumerate(torch.randint(2, 10, (n,), generator=g).tolist()):
        images = []
        for j in range(1 + (i % 3 == 0)):
            h, w = (8, 12, 12, 8)[(i + j) % 4], (8, 8, 12, 12)[(i + j) % 4]
            images.append(Image.fromarray((np.random.RandomState(10 + i + 50 * j).rand(h, w, 3) * 255).astype("uint8")))
        text = " ".join(f"w{int(t)}" for t in torch.randint(0, 60, (size,), generator=g))
        out.append({"prompt": [{"role": "user", "content": text}], "images": images})
    return out


def reward_words(completions: list, **_: object) -> list[float]:
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    SEEN.append(texts)
    return [float(len(t.split()) % 5) + 0.5 * t.count("w1") for t in texts]


@contextmanager
def _delta_rule_in_float64() -> Iterator[None]:
    """transformers' reference gated delta rule (``modeling_qwen3_5.torch_chunk_gated_delta_rule``, 5.x) casts its
    inputs to float32 and sums the log-decays within chunks of 64 tokens: in a float64 model its rounding then
    depends on where each chunk starts, which moves a row's decay gradients (``A_log``, ``dt_bias``,
    ``in_proj_a``) by about 3e-4 of their largest when the row is shifted by its padding, in one process (the
    ring, whose shards start chunks elsewhere, differs from one process by as much). Here the module's
    ``torch.float32`` reads as float64, for the reference and the ring alike: then within 1e-6."""
    from types import SimpleNamespace

    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    real = module.torch
    module.torch = SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    module.torch.float32 = real.float64
    try:
        yield
    finally:
        module.torch = real


def processor(family: str = "qwen3_vl"):  # noqa: ANN201
    from testkit.vlm import tiny_gemma3_processor, tiny_processor

    gemma = family == "gemma3"
    proc = tiny_gemma3_processor() if gemma else tiny_processor()
    proc.chat_template = GEMMA3_TEMPLATE if gemma else TEMPLATE
    proc.tokenizer.padding_side = "left"  # as TRL pads its prompt ids
    return proc


def grpo_vlm_run(
    kind: str, case: str, out: str, data_dir: str, cp: int = 2, fixed: bool = True, vllm: bool = False
) -> dict:  # fmt: skip
    """One run on this rank (``kind``: ``ring``, ``ref`` one process, ``ddp`` TRL over the launched processes);
    ``vllm``: TRL's vLLM server mode, its client the stand-in ``testkit.vllm_standin``."""
    if not vllm:
        return _grpo_vlm_run(kind, case, out, data_dir, cp, fixed)
    import trl.generation.vllm_generation as vg

    from testkit.vllm_standin import VLLMClientStandIn

    before = vg.is_vllm_available, vg.VLLMClient
    vg.is_vllm_available, vg.VLLMClient = (lambda: True), VLLMClientStandIn
    VLLMClientStandIn.requests, VLLMClientStandIn.image_requests, VLLMClientStandIn.synced = [], [], []
    try:
        res = _grpo_vlm_run(kind, case, out, data_dir, cp, False, use_vllm=True, vllm_mode="server")
    finally:
        vg.is_vllm_available, vg.VLLMClient = before
    return {**res, "requests": VLLMClientStandIn.requests, "image_requests": VLLMClientStandIn.image_requests}


def _grpo_vlm_run(kind: str, case: str, out: str, data_dir: str, cp: int, fixed: bool, **more: object) -> dict:
    from datasets import load_from_disk

    from testkit.vlm import tiny_model

    spec = dict(CASES[case])
    family = spec.pop("family", "qwen3_vl")
    dtype = spec.pop("dtype", torch.float32)
    args, cls, lora = grpo_setup(kind, spec, out, fixed, cp, **more)
    ring = kind == "ring"
    model = tiny_model(family, "ring" if ring else "sdpa", dtype=dtype)
    extra: dict = {}
    if lora:  # the decoder's attention and MLP only: the vision tower stays frozen
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8,
                                          target_modules=r".*language_model.*\.(q_proj|v_proj|up_proj)")  # fmt: skip
    grads: list[dict] = []
    SEEN.clear()
    keep = keep_grads(grads, lambda: trainer.model)
    trainer = cls(model=model, reward_funcs=reward_words, args=args, train_dataset=load_from_disk(data_dir),
                  processing_class=processor(family), callbacks=[keep], **extra)  # fmt: skip
    keys: list[str] = []
    if ring:  # the batches the ring ran carry the images
        from hf_ring.trainer import fused_head

        shard = fused_head.shard_batch
        fused_head.shard_batch = lambda batch, **kw: keys.extend(sorted(batch)) or shard(batch, **kw)
    try:
        with _delta_rule_in_float64() if dtype == torch.float64 else nullcontext():
            trainer.train()
    finally:
        if ring:
            fused_head.shard_batch = shard
    logs = [{k: v for k, v in h.items() if k not in SKIP} for h in trainer.state.log_history if "loss" in h]
    tower = [n for n in grads[0] if ".visual." in n or ".vision_tower." in n] if grads else []
    return {"logs": logs, "grads": grads, "cp": getattr(trainer, "cp_size", None), "seen": list(SEEN),
            "keys": sorted(set(keys)), "tower_grads": len(tower)}  # fmt: skip


def _data(tmp_path: Path) -> str:
    from datasets import Dataset

    Dataset.from_list(_prompts()).save_to_disk(tmp_path / "prompts")
    return str(tmp_path / "prompts")


def _check(case: str, ring: list[dict], ref: dict, cp: int) -> None:
    assert all(r["cp"] == cp for r in ring) and len(ref["logs"]) == len(ring[0]["logs"]) == 2
    assert all(r["seen"] == ref["seen"] for r in ring), "the runs scored different completions"
    assert IMAGE_KEYS[CASES[case].get("family", "qwen3_vl")] <= set(ring[0]["keys"]), ring[0]["keys"]
    assert len(ref["grads"]) == len(ring[0]["grads"]) == 2
    # the tower: trained (its gradients compared too) or frozen (none)
    assert (ref["tower_grads"] > 0) == (not CASES[case]["lora"]) and ring[0]["tower_grads"] == ref["tower_grads"]
    assert_same_runs(f"{case}-cp{cp}", ring, ref, "RingGRPOTrainer", "GRPOTrainer", Run.of("grpo", VOCAB, CASES[case]))


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_ring_grpo_trainer_with_image_prompts_matches_single_process(tmp_path: Path, case: str, cp: int) -> None:
    data = _data(tmp_path)
    ring = run_ranks(cp, grpo_vlm_run, "ring", case, str(tmp_path / "ring"), data, cp, timeout=500)
    ref = run_ranks(1, grpo_vlm_run, "ref", case, str(tmp_path / "ref"), data, timeout=400)[0]
    _check(case, ring, ref, cp)


def test_ring_grpo_trainer_with_image_prompts_dp2_cp2_matches_trl_over_2_processes(tmp_path: Path) -> None:
    """4 processes, 2 CP groups of 2 (DDP) against TRL's ``GRPOTrainer`` on 2 processes."""
    data = _data(tmp_path)
    case = "full-trained-tower-dapo"
    ring = run_ranks(4, grpo_vlm_run, "ring", case, str(tmp_path / "ring"), data, 2, timeout=500)
    ddp = run_ranks(2, grpo_vlm_run, "ddp", case, str(tmp_path / "ddp"), data, timeout=400)
    assert ring[0]["seen"] == ring[1]["seen"] == ddp[0]["seen"] and ring[2]["seen"] == ring[3]["seen"] == ddp[1]["seen"]
    _check(case, ring[:2], ddp[0], 2)
    _check(case, ring[2:], ddp[1], 2)


@pytest.mark.parametrize(("case", "cp"), [("full-trained-tower-dapo", 2), ("full-trained-tower-dapo", 3),
                                         ("gemma3-lora-decoder-frozen-tower-grpo-kl-temperature", 2)])  # fmt: skip
def test_ring_grpo_trainer_vllm_server_mode_with_image_prompts_matches_single_process(
    tmp_path: Path, case: str, cp: int
) -> None:
    """``use_vllm=True, vllm_mode="server"`` with image prompts (TRL's client replaced by ``testkit.vllm_standin``,
    whose completions are a fixed function of the prompt and its images): the server is asked for the CP group's
    image features and completions once, exactly what one process asks for, and the run (with vLLM's importance
    sampling correction) equals one-process ``GRPOTrainer``'s."""
    data = _data(tmp_path)
    ring = run_ranks(cp, grpo_vlm_run, "ring", case, str(tmp_path / "ring"), data, cp, False, True, timeout=500)
    ref = run_ranks(1, grpo_vlm_run, "ref", case, str(tmp_path / "ref"), data, cp, False, True, timeout=400)[0]
    assert ring[0]["requests"] == ref["requests"] and len(ref["requests"]) == 2  # one generation batch per step
    assert ring[0]["image_requests"] == ref["image_requests"] and all(c > 0 for c in ref["image_requests"][0])
    assert all(not r["requests"] and not r["image_requests"] for r in ring[1:])  # the main process asks
    _check(case, ring, ref, cp)


@pytest.mark.parametrize("case", ["full-trained-tower-dapo", "gemma3-lora-decoder-frozen-tower-grpo-kl-temperature"])
def test_ring_grpo_trainer_generates_from_image_prompts_once_per_cp_group(tmp_path: Path, case: str) -> None:
    """transformers' generate with the images and sampling (sdpa on every rank; Gemma 3 with its
    ``token_type_ids``): both ranks of the CP group score the same completions and log the same finite losses."""
    data = _data(tmp_path)
    ring = run_ranks(2, grpo_vlm_run, "ring", case, str(tmp_path / "ring"), data, 2, False, timeout=500)
    assert ring[0]["seen"] == ring[1]["seen"] and len(ring[0]["seen"]) == 2
    assert all(np.isfinite(h["loss"]) for h in ring[0]["logs"]) and ring[0]["logs"] == ring[1]["logs"]


def test_image_batches_without_grids_are_refused_at_the_fused_head() -> None:
    """Left-padded rows move to the right with their ``mm_token_type_ids`` / ``token_type_ids``; that keeps the
    positions of Qwen's M-RoPE (from the real tokens only) and Gemma 3's attention (positions as differences, its
    image blocks from ``token_type_ids``); image batches with neither (Llama 4) are refused."""
    from hf_ring.trainer.fused_head import refuse_unshiftable_images

    ids = torch.ones(2, 8, dtype=torch.long)
    refuse_unshiftable_images({"input_ids": ids, "pixel_values": torch.zeros(8, 24),
                                 "image_grid_thw": torch.tensor([[1, 2, 4]])})  # fmt: skip
    refuse_unshiftable_images({"input_ids": ids, "pixel_values": torch.zeros(1, 3, 8, 8),
                                 "token_type_ids": torch.zeros_like(ids)})  # fmt: skip
    with pytest.raises(NotImplementedError, match="Qwen-style models.*Gemma 3.*Llama 4 is not exact.*cp_size=1"):
        refuse_unshiftable_images({"input_ids": ids, "pixel_values": torch.zeros(1, 3, 8, 8)})
