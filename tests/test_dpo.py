"""``RingDPOTrainer`` at CP = 2 (and 4, LoRA) against one-process ``trl.DPOTrainer`` (sdpa) on the same tiny model
and pairs, float32: the loss, every gradient (each parameter's, at every optimizer step, after
DDP's averaging) and every logged metric (rewards, margins, accuracies, log-probabilities, logits,
entropy, token accuracy, token count) -- full fine-tuning with a reference model and two loss
types at once, LoRA with the adapter disabled as reference, precomputed reference
log-probabilities with ``ld_alpha``, CP asked for through accelerate's ``ParallelismConfig``,
Ulysses (``ulysses_size=2``), and ``padding_free=True`` (the pairs of a micro-batch packed as
documents of one row, at CP = 2 and 4; TRL's own ``DPOTrainer`` pads: the reference);
gradient accumulation over 2 micro-batches throughout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from testkit.post import dpo_arguments
from testkit.spawn import launcher_env, run_ranks

pytest.importorskip("trl")

from tests.test_trl import _tokenizer  # noqa: E402

VOCAB = 64
CASES = {
    "full-sigmoid+ipo": dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5], lora=False, ref=True, evals=True),
    "lora-sigmoid": dict(loss_type=["sigmoid"], lora=True, ref=False),
    # CP asked for through accelerate's ParallelismConfig(cp_size=2) instead of cp_size
    "lora-sigmoid-parallelism_config": dict(loss_type=["sigmoid"], lora=True, ref=False, mesh=True),
    "lora-sigmoid-cp4": dict(loss_type=["sigmoid"], lora=True, ref=False, cp=4),
    # Ulysses inside the CP group (ulysses_size=2 of cp_size=2: the all-to-all over heads, no ring)
    "full-sigmoid-ulysses": dict(loss_type=["sigmoid"], lora=False, ref=True, ulysses=2),
    # padding_free=True: the 2 pairs of a micro-batch run as 4 packed documents of one row (TRL pads: the reference)
    "full-sigmoid+ipo-packed": dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5], lora=False, ref=True,
                                    padding_free=True, ld_alpha=0.5, evals=True),
    "lora-sigmoid-packed-cp4": dict(loss_type=["sigmoid"], lora=True, ref=False, cp=4, padding_free=True),
    # packed under Ulysses x ring (cp_size=4 = ulysses 2 x ring 2), ld_alpha's two sums per document
    "full-hinge-packed-ulysses2x2-ld_alpha": dict(loss_type=["hinge"], lora=False, ref=True, cp=4, ulysses=2,
                                                  padding_free=True, ld_alpha=0.3),
    "precomputed-sigmoid-packed": dict(loss_type=["sigmoid"], lora=False, ref=True, precompute_ref_log_probs=True,
                                       padding_free=True),
    "precomputed-hinge-ld_alpha": dict(loss_type=["hinge"], lora=False, ref=True, precompute_ref_log_probs=True,
                                       ld_alpha=0.5),
}  # fmt: skip
SKIP = {"epoch", "step", "learning_rate", "train_runtime", "train_samples_per_second", "train_steps_per_second",
        "total_flos", "train_loss"}  # fmt: skip


def _pairs() -> list[dict]:
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (n,), generator=g))

    sizes = torch.randint(3, 19, (8, 3), generator=g).tolist()
    return [{"prompt": words(p), "chosen": " " + words(c), "rejected": " " + words(r)} for p, c, r in sizes]


class _Grads:
    """A callback keeping every trainable parameter's gradient just before each optimizer step."""

    def __new__(cls, model_ref: list):
        from transformers import TrainerCallback

        class Keep(TrainerCallback):
            def __init__(self) -> None:
                self.steps: list[dict[str, np.ndarray]] = []

            def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
                model = model_ref[0]
                self.steps.append({n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()
                                   if p.requires_grad and p.grad is not None})  # fmt: skip

        return Keep()


def logit_stats(prediction) -> dict[str, float]:  # noqa: ANN001
    """``compute_metrics``: statistics of the logits TRL hands it (a plain forward on the evaluation pairs)."""
    logits = np.asarray(prediction.predictions, dtype=np.float64)
    real = logits[logits != -100]  # the evaluation loop pads the batches' logits to one length with -100
    return {"logits_mean": float(real.mean()), "logits_abs_mean": float(np.abs(real).mean()),
            "logits_max": float(real.max()), "logits_count": float(real.size)}  # fmt: skip


def dpo_run(
    kind: str, case: str, out: str, tok_dir: str, data_dir: str, cp: int | None = None, metrics: bool = False
) -> dict:
    """One run on this rank (``kind``: ``ring`` or ``ref``, one-process TRL) of ``CASES[case]``; ``cp``
    overrides the case's CP size; ``metrics``: evaluation with ``compute_metrics=logit_stats``."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from hf_ring.trainer.dpo import RingDPOConfig, RingDPOTrainer
    from testkit.models import tiny_model

    spec = dict(CASES[case])
    lora, ref, mesh, ulysses = spec.pop("lora"), spec.pop("ref"), spec.pop("mesh", False), spec.pop("ulysses", 1)
    evals, cp = spec.pop("evals", False) or metrics, spec.pop("cp", 2) if cp is None else cp
    if evals:  # evaluation under CP too: eval_loss and the eval_ metrics
        spec.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    ring = kind == "ring"
    if ring:
        launcher_env()
    attn = "ring" if ring else "sdpa"
    common = dpo_arguments(out, max_length=48, **spec)
    if ring and mesh:
        from accelerate.parallelism_config import ParallelismConfig

        args = RingDPOConfig(parallelism_config=ParallelismConfig(cp_size=cp), **common)
    else:
        args = RingDPOConfig(cp_size=cp, ulysses_size=ulysses, **common) if ring else DPOConfig(**common)
    cls = RingDPOTrainer if ring else DPOTrainer
    model = tiny_model("llama", attn, vocab_size=VOCAB)
    extra: dict = {}
    if ref:
        extra["ref_model"] = tiny_model("llama", attn, vocab_size=VOCAB, seed=1)
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    holder: list = [None]
    keep = _Grads(holder)
    trainer = cls(model=model, args=args, train_dataset=load_from_disk(data_dir),
                  eval_dataset=load_from_disk(data_dir) if evals else None,
                  processing_class=AutoTokenizer.from_pretrained(tok_dir), callbacks=[keep],
                  compute_metrics=logit_stats if metrics else None, **extra)  # fmt: skip
    holder[0] = trainer.model
    rows: list[int] = []
    gathered: list[int] = []
    if ring:  # the batches the ring ran (one packed row per micro-batch with padding_free=True); per-token gathers
        from hf_ring.trainer import fused_head

        shard, gather = fused_head.shard_batch, fused_head.gather_tokens
        fused_head.shard_batch = lambda batch, **kw: rows.append(batch["input_ids"].shape[0]) or shard(batch, **kw)
        fused_head.gather_tokens = lambda *a, **kw: gathered.append(1) or gather(*a, **kw)
    try:
        trainer.train()
    finally:
        if ring:
            fused_head.shard_batch, fused_head.gather_tokens = shard, gather
    logs = [{k: v for k, v in h.items() if k not in SKIP and not k.endswith(("_runtime", "_per_second"))}
            for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]  # fmt: skip
    state = getattr(trainer, "_cp", None)
    return {"logs": logs, "grads": keep.steps, "cp": getattr(trainer, "cp_size", None), "rows": sorted(set(rows)),
            "gathered": bool(gathered),
            "ulysses": state.ulysses_size if state is not None else None}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_ring_dpo_trainer_cp2_matches_single_process_dpo_trainer(tmp_path: Path, case: str) -> None:
    from datasets import Dataset

    _tokenizer(tmp_path / "tok")
    for kind in ("ring", "ref"):  # on disk, one copy per run: the ranks share its cache (precomputed log-probs)
        Dataset.from_list(_pairs()).save_to_disk(tmp_path / f"pairs-{kind}")
    run = [str(tmp_path / "tok")]
    cp = CASES[case].get("cp", 2)
    ring = run_ranks(cp, dpo_run, "ring", case, str(tmp_path / "ring"), *run, str(tmp_path / "pairs-ring"), timeout=300)
    ref = run_ranks(1, dpo_run, "ref", case, str(tmp_path / "ref"), *run, str(tmp_path / "pairs-ref"), timeout=300)[0]
    assert ring[0]["cp"] == cp and len(ref["logs"]) == len(ring[0]["logs"]) == 2 + bool(CASES[case].get("evals"))
    assert ring[0]["ulysses"] == CASES[case].get("ulysses", 1)
    packed = CASES[case].get("padding_free", False)
    assert ring[0]["rows"] == ([1] if packed else [4]), ring[0]["rows"]  # 2 pairs: 4 rows, or 1 packed
    # TRL reads per-row sums only (sequence_sums, two per row with ld_alpha): nothing gathered per token
    assert not ring[0]["gathered"]
    assert len(ref["grads"]) == len(ring[0]["grads"]) == 2
    assert_same_runs(case, ring, ref, "RingDPOTrainer", "DPOTrainer")


def assert_same_runs(case: str, ring: list[dict], ref: dict, name: str, ref_name: str) -> None:
    """Every rank's logged values equal the one-process run's (within float32 sums: 1e-6 + 1e-5
    relative) and every gradient at every optimizer step (within 2e-5 of the parameter's largest);
    prints the worst differences."""
    worst = {"metric": 0.0, "metric_rel": 0.0, "grad": 0.0}
    for r in ring:
        for step, (got, want) in enumerate(zip(r["logs"], ref["logs"]), 1):
            assert set(got) == set(want), f"step {step}: logged {sorted(got)} vs {sorted(want)}"
            for key, b in want.items():
                a = got[key]
                worst["metric"] = max(worst["metric"], abs(a - b))
                worst["metric_rel"] = max(worst["metric_rel"], abs(a - b) / max(abs(b), 1e-12))
                # float32 sums of ~50 log-probabilities, differences of such sums after one SGD step
                assert abs(a - b) <= 1e-6 + 1e-5 * abs(b), f"step {step} {key}: {name} {a} vs {ref_name} {b}"
        for step, (got, want) in enumerate(zip(r["grads"], ref["grads"]), 1):
            assert set(got) == set(want)
            for param, g in want.items():
                err = float(np.abs(got[param] - g).max() / max(np.abs(g).max(), 1e-8))
                worst["grad"] = max(worst["grad"], err)
                assert err <= 2e-5, f"step {step} {param}: relative gradient error {err}"
    print(f"{case}: metrics max abs {worst['metric']:.2e} (rel {worst['metric_rel']:.2e}); gradients max error "
          f"relative to the parameter's largest gradient {worst['grad']:.2e}")  # fmt: skip


def test_pack_rows_keeps_each_row_a_document_and_refuses_what_it_cannot_pack() -> None:
    from hf_ring.trainer.rows import pack_rows

    ids = torch.arange(1, 13).view(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    packed, keep = pack_rows({"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask})
    assert packed["input_ids"].tolist() == [[1, 2, 3, 5, 6, 7, 8, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert keep.equal(mask.bool())
    with pytest.raises(NotImplementedError, match="padding that is not on the right.*padding_free=False"):
        pack_rows({"input_ids": ids, "attention_mask": mask.flip(1)})
    with pytest.raises(NotImplementedError, match="position_ids"):
        pack_rows({"input_ids": ids, "position_ids": ids})


def test_planted_row_sums_give_trl_its_masked_row_sums() -> None:
    """What TRL's DPO reads from its fused head (masked row sums, the masked count of ``is_top1``) equals the
    given per-row sums; the gradient reaches them."""
    from hf_ring.trainer.rows import plant_row_sums

    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    lp = torch.tensor([-3.5, -7.25, 0.0], requires_grad=True)
    out = plant_row_sums({"log_probs": lp, "entropy": torch.tensor([1.5, 2.0, 0.0]),
                          "is_top1": torch.tensor([1.0, 3.0, 0.0])}, mask)  # fmt: skip
    assert out["log_probs"].sum(1).tolist() == [-3.5, -7.25, 0.0] and (out["log_probs"] * ~mask).abs().sum() == 0
    assert (out["entropy"] * mask).sum(1).tolist() == [1.5, 2.0, 0.0]
    assert (out["is_top1"] & mask).sum(1).tolist() == [1, 3, 0] and out["is_top1"].dtype == torch.bool
    (out["log_probs"].sum(1) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert lp.grad.tolist() == [1.0, 2.0, 0.0]  # a row without labels: nothing planted
    # ld_alpha: two sums per row, read by TRL through its shared and tail masks (the tail of row 1: its last 2)
    from hf_ring.trainer.dpo import ld_alpha_tail

    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.bool)  # chosen 4 tokens, rejected 2
    tail = ld_alpha_tail(mask)
    assert (tail & mask).tolist() == [[False, False, False, True, True], [False] * 5]
    out = plant_row_sums({"log_probs": torch.tensor([-1.0, -2.0]), "log_probs_tail": torch.tensor([-4.0, 0.0])},
                         mask, tail)  # fmt: skip
    comp_pos = mask.long().cumsum(1)  # TRL's masks
    shared = (comp_pos > 0) & (comp_pos <= 2)
    assert (out["log_probs"] * shared).sum(1).tolist() == [-1.0, -2.0]
    assert (out["log_probs"] * (comp_pos > 2)).sum(1).tolist() == [-4.0, 0.0]


@pytest.mark.parametrize("case", ["full-sigmoid+ipo-packed", "lora-sigmoid"])
def test_ring_dpo_trainer_cp1_is_dpo_trainer(tmp_path: Path, case: str) -> None:
    """At ``cp_size=1`` ``RingDPOTrainer`` with a ring-loaded model is TRL's ``DPOTrainer``: padded pairs, the
    evaluation with ``compute_metrics``, and ``padding_free=True``, which TRL 1.16 runs padded."""
    from datasets import Dataset

    _tokenizer(tmp_path / "tok")
    for kind in ("ring", "ref"):
        Dataset.from_list(_pairs()).save_to_disk(tmp_path / f"pairs-{kind}")
    runs = {kind: run_ranks(1, dpo_run, kind, case, str(tmp_path / kind), str(tmp_path / "tok"),
                            str(tmp_path / f"pairs-{kind}"), 1, True, timeout=300)  # fmt: skip
            for kind in ("ring", "ref")}
    ring, ref = runs["ring"], runs["ref"][0]
    assert ring[0]["cp"] == 1 and len(ref["logs"]) == len(ring[0]["logs"]) == 3
    assert "eval_logits_mean" in ref["logs"][-1]
    assert_same_runs(f"{case}-cp1", ring, ref, "RingDPOTrainer", "DPOTrainer")


def test_ring_dpo_trainer_compute_metrics_matches_single_process(tmp_path: Path) -> None:
    """TRL's ``compute_metrics`` gets the logits of a plain forward on the evaluation pairs (no fused head, no
    ``shard_batch``): at CP = 2 each rank computes them on the whole batch, as one process does."""
    from datasets import Dataset

    _tokenizer(tmp_path / "tok")
    for kind in ("ring", "ref"):
        Dataset.from_list(_pairs()).save_to_disk(tmp_path / f"pairs-{kind}")
    case = "full-sigmoid+ipo"
    ring = run_ranks(2, dpo_run, "ring", case, str(tmp_path / "ring"), str(tmp_path / "tok"),
                     str(tmp_path / "pairs-ring"), None, True, timeout=300)  # fmt: skip
    ref = run_ranks(1, dpo_run, "ref", case, str(tmp_path / "ref"), str(tmp_path / "tok"),
                    str(tmp_path / "pairs-ref"), None, True, timeout=300)[0]  # fmt: skip
    assert ring[0]["cp"] == 2 and "eval_logits_mean" in ref["logs"][-1]
    assert_same_runs(f"{case}-compute_metrics", ring, ref, "RingDPOTrainer", "DPOTrainer")
