"""RingTrainer under FSDP2 on the CPU: accelerate's real FSDP2 ``prepare`` on gloo (``testkit.fsdp``),
with LoRA (dropout on), activation checkpointing, chunked loss and CP=2, on passkey data whose
answer lies in rank 0's shard only (rank 1 of each CP group has no target):

- the logged losses and gradient norms equal those of the same run under DDP within 1e-5, at CP=2
  and at DP=2 x CP=2;
- a run resumed from its sharded checkpoint at step 3 logs exactly the losses of the uninterrupted
  run (model, optimizer, scheduler, RNG and data position restored);
- the final adapter, written in PEFT's format from the sharded model by ``trainer.save_model``, loads
  with ``PeftModel.from_pretrained`` and reproduces the trained model's logits;
- ranks that see different output directories (no shared filesystem) all get a clear error.

Each multi-process call runs under the pool's timeout (a hang fails the test).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_ring
from hf_ring.data.passkey import VOCAB, PasskeyDataset
from testkit.spawn import launcher_env, run_ranks

SEQ = 40  # CP=2: rank 1 holds tokens 10..29; the answer (targets at 34..38) is in rank 0's chunk 30..39
STEPS = 6
TIMEOUT = 300
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])


def _model():
    from peft import LoraConfig, get_peft_model

    from testkit.models import tiny_model

    model = tiny_model("llama", "ring", vocab_size=VOCAB)
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(**LORA))


def _args(out: str, save_steps: int):
    from hf_ring.trainer import RingTrainingArguments

    return RingTrainingArguments(
        output_dir=out,
        cp_size=2,
        max_steps=STEPS,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=2e-2,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        activation_checkpointing=True,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )


def _targets_per_rank(trainer, sample: dict) -> list[int]:
    import torch.distributed as dist

    kw = hf_ring.shard_batch({k: v[None] for k, v in sample.items()}, group=trainer._cp_group)
    mine = torch.tensor([int((kw["shift_labels"] != -100).sum())])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t) for t in every]


@torch.no_grad()
def _logits(trainer, ids: torch.Tensor) -> np.ndarray:
    model = trainer.model
    model.eval()
    out = model(**hf_ring.shard_batch({"input_ids": ids}, group=trainer._cp_group)).logits
    return hf_ring.unshard(out, group=trainer._cp_group)[:, : ids.shape[1]].float().numpy()


def train_run(kind: str, out: str, save_steps: int = 0, resume: str | None = None, final: bool = False) -> dict:
    """One RingTrainer run on this rank (``kind``: ``ddp`` or ``fsdp``)."""
    from hf_ring.trainer import RingTrainer
    from testkit.fsdp import fsdp2_on_cpu

    launcher_env()
    data = PasskeyDataset(seq_len=SEQ, length=64, seed=1)
    with fsdp2_on_cpu() if kind == "fsdp" else nullcontext():
        trainer = RingTrainer(model=_model(), args=_args(out, save_steps), train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        res = {
            "steps": [h["step"] for h in logs],
            "loss": [h["loss"] for h in logs],
            "grad_norm": [h["grad_norm"] for h in logs],
            "fsdp": trainer.is_fsdp_enabled,
            "targets": _targets_per_rank(trainer, data[0]),
            "seq_len": logs[-1].get("seq_len"),
        }
        if final:
            ids = PasskeyDataset(seq_len=SEQ, length=4, seed=7)[0]["input_ids"][None]
            res["logits"] = _logits(trainer, ids)
            res["ids"] = ids.numpy()
            trainer.save_model(str(Path(out) / "final"), merged=True)
    return res


@pytest.fixture(scope="module")
def fsdp_whole(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("fsdp_whole")
    return out, run_ranks(2, train_run, "fsdp", str(out), 3, None, True, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_losses_equal_ddp(world: int, tmp_path: Path, fsdp_whole) -> None:
    if world == 2:
        fsdp = fsdp_whole[1]
    else:
        fsdp = run_ranks(world, train_run, "fsdp", str(tmp_path / "fsdp"), timeout=TIMEOUT)
    ddp = run_ranks(world, train_run, "ddp", str(tmp_path / "ddp"), timeout=TIMEOUT)
    assert [r["fsdp"] for r in fsdp] == [True] * world and not any(r["fsdp"] for r in ddp)
    assert fsdp[0]["targets"][1] == 0 < fsdp[0]["targets"][0]  # a rank without targets trained along
    assert fsdp[0]["seq_len"] == SEQ
    f, d = fsdp[0], ddp[0]
    assert f["steps"] == d["steps"] == list(range(1, STEPS + 1))
    for step, (a, b) in enumerate(zip(f["loss"], d["loss"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"world {world}, step {step}: FSDP2 loss {a} vs DDP {b}"
    for step, (a, b) in enumerate(zip(f["grad_norm"], d["grad_norm"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"world {world}, step {step}: FSDP2 grad norm {a} vs DDP {b}"
    assert f["loss"][-1] < f["loss"][0]


def test_fsdp2_resume_from_sharded_checkpoint_is_exact(tmp_path: Path, fsdp_whole) -> None:
    out, whole = fsdp_whole
    ckpt = out / "checkpoint-3"
    assert (ckpt / "pytorch_model_fsdp_0").is_dir() and (ckpt / "optimizer_0").is_dir()  # sharded
    assert (ckpt / "rng_state_0.pth").exists() and (ckpt / "rng_state_1.pth").exists()
    resumed = run_ranks(2, train_run, "fsdp", str(tmp_path / "resumed"), 3, str(ckpt), timeout=TIMEOUT)[0]
    after = {s: loss for s, loss in zip(resumed["steps"], resumed["loss"]) if s > 3}
    want = {s: loss for s, loss in zip(whole[0]["steps"], whole[0]["loss"]) if s > 3}
    assert after == want, f"resumed {after} vs uninterrupted {want}"


def test_fsdp2_final_adapter_loads_with_peft(fsdp_whole) -> None:
    from peft import PeftModel

    from testkit.models import tiny_model

    out, whole = fsdp_whole
    final = out / "final"
    assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()
    base = tiny_model("llama", "sdpa", vocab_size=VOCAB)
    loaded = PeftModel.from_pretrained(base, str(final)).eval()
    with torch.no_grad():
        got = loaded(input_ids=torch.as_tensor(whole[0]["ids"])).logits.numpy()
    want = whole[0]["logits"]
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err <= 1e-5, f"logits of the loaded adapter differ from the trained model's: rel err {err:.2e}"
    untrained = PeftModel.from_pretrained(tiny_model("llama", "sdpa", vocab_size=VOCAB), str(final))
    assert any(
        float(p.abs().sum()) > 0 for n, p in untrained.named_parameters() if "lora_B" in n
    )  # the adapter trained (lora_B starts at zero)


def test_fsdp2_merged_model_loads_without_peft(fsdp_whole) -> None:
    """``save_model(path, merged=True)``: the base model with the adapter merged in, from FSDP2 shards."""
    from transformers import AutoModelForCausalLM

    out, whole = fsdp_whole
    merged = out / "final" / "merged"
    model = AutoModelForCausalLM.from_pretrained(str(merged), attn_implementation="sdpa").eval()
    assert not any("lora" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        got = model(input_ids=torch.as_tensor(whole[0]["ids"])).logits.numpy()
    want = whole[0]["logits"]
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err <= 1e-5, f"logits of the merged model differ from the trained model's: rel err {err:.2e}"


def different_dirs(root: str) -> str:
    import torch.distributed as dist

    from hf_ring.trainer.startup import check_shared_output_dir

    rank = dist.get_rank()
    check_shared_output_dir(Path(root) / "same")  # a shared path passes
    check_shared_output_dir(Path(root) / f"node{rank}")  # each rank its own: every rank raises
    return "no error"


def test_output_dir_not_shared_is_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as err:
        run_ranks(2, different_dirs, str(tmp_path), timeout=60)
    msg = str(err.value)
    assert "failed on 2 rank(s)" in msg and "rank 1 on" in msg and "shared by all nodes" in msg
    assert not list((tmp_path / "node0").glob(".hf_ring-shared-*"))  # the probe is removed


def test_merged_state_dict_equals_peft_merge_and_refuses_what_it_cannot_merge() -> None:
    """One process: the merged weights equal PEFT's own ``merge_and_unload`` (fan-in/out as stored);
    LoRA on the embedding, DoRA and LoRA biases are refused, never dropped."""
    from peft import LoraConfig, get_peft_model

    from hf_ring.trainer.export import full_state_dict, merged_state_dict
    from testkit.models import tiny_model

    def peft(**kw):
        torch.manual_seed(3)
        cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kw)
        return get_peft_model(tiny_model("llama", "sdpa", torch.float64, vocab_size=VOCAB), cfg)

    model = peft(target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True)
    got = merged_state_dict(model, full_state_dict(model, trainable_only=False))
    want = model.merge_and_unload().state_dict()
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert torch.equal(got[k], w) or float((got[k] - w).abs().max()) <= 1e-12, k
    for kw, what in (
        (dict(target_modules=["q_proj", "embed_tokens"]), "Embedding"),
        (dict(target_modules=["q_proj"], use_dora=True), "DoRA=True"),
        (dict(target_modules=["q_proj"], lora_bias=True), "lora_bias=True"),
    ):
        model = peft(**kw)
        with pytest.raises(ValueError, match=what):
            merged_state_dict(model, full_state_dict(model, trainable_only=False))
