"""accelerate's ``ParallelismConfig(cp_size=...)`` adopted by hf_ring (``hf_ring.trainer.mesh``): the CP
size taken from it, the config taken away from accelerate, and one error naming the field for what
cannot work; real runs on 4 gloo processes with ``ParallelismConfig(dp_shard_size=2, cp_size=2)`` and
accelerate's FSDP2 ``prepare`` (``RingTrainer``, ``RingDPOTrainer``) equal to one process. (CP = 2
alone through the config: tests/test_dpo.py, case ``lora-sigmoid-parallelism_config``.)"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hf_ring.trainer.mesh import adopt_parallelism_config
from testkit.post import Run, metric_tolerance


def _pc(**sizes):
    base = dict(dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1, cp_backend="torch")
    return SimpleNamespace(**{**base, **sizes})


def test_cp_size_is_taken_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    args = SimpleNamespace(parallelism_config=_pc(cp_size=4, dp_shard_size=2), cp_size=1)
    assert adopt_parallelism_config(args, None) == 4
    assert args.parallelism_config is None and args.cp_size == 4
    assert adopt_parallelism_config(SimpleNamespace(parallelism_config=_pc(tp_size=1)), 2) == 2  # no CP there


def test_cp_size_is_taken_from_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    args = SimpleNamespace(parallelism_config=None)
    assert adopt_parallelism_config(args, None) == 2
    import os

    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"  # accelerate does not build it again


@pytest.mark.parametrize(
    "sizes,field",
    [
        ({"tp_size": 2}, "tp_size"),
        ({"sp_size": 2}, "sp_size"),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, "dp_replicate_size"),  # HSDP
    ],
)
def test_what_cannot_work_names_the_field(monkeypatch: pytest.MonkeyPatch, sizes: dict, field: str) -> None:
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    with pytest.raises(ValueError, match=f"Set {field} to 1"):
        adopt_parallelism_config(SimpleNamespace(parallelism_config=_pc(cp_size=2, **sizes)), None)


@pytest.mark.parametrize(
    "sizes,world,fsdp,match",
    [
        ({"dp_shard_size": 2}, 4, False, 'dp_shard_size=2 shards the model with FSDP2.*set fsdp="full_shard"'),
        ({"dp_replicate_size": 2}, 4, True, "set dp_shard_size to 2 and dp_replicate_size to 1"),
        (
            {"dp_shard_size": 2},
            8,
            True,
            "dp_shard_size=2 x cp_size=2 = 4 processes, but 8 were launched; set dp_shard_size to 4",
        ),
        ({"dp_replicate_size": 3}, 4, False, "set dp_replicate_size to 2"),
    ],
)
def test_layout_that_cannot_run_names_the_field(sizes: dict, world: int, fsdp: bool, match: str) -> None:
    from hf_ring.trainer.mesh import check_layout

    full = {**dict(dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=2, sp_size=1), **sizes}
    with pytest.raises(ValueError, match=match):
        check_layout(full, world, fsdp)
    ok = {**full, "dp_replicate_size": 1, "dp_shard_size": 1}
    check_layout(ok, 6, fsdp)  # cp_size alone: the rest of the world is data parallelism
    check_layout({**full, "dp_shard_size": 2, "dp_replicate_size": 1}, 4, True)
    check_layout({**full, "dp_shard_size": 1, "dp_replicate_size": 2}, 4, False)


def test_disagreeing_cp_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    with pytest.raises(ValueError, match="cp_size=4 but TrainingArguments.parallelism_config has cp_size=2"):
        adopt_parallelism_config(SimpleNamespace(parallelism_config=_pc(cp_size=2)), 4)


# --- a real run: FSDP2 over dp_shard x cp, 4 gloo processes ----------------------------------------------
MESH_TIMEOUT = 300
SEQ, VOCAB = 37, 64  # 37 tokens: not a multiple of 2 x cp_size


def _lm_data() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(8):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: 5 + i] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def _full_grads(model) -> dict[str, np.ndarray]:
    """Every trainable parameter's gradient, whole (FSDP2 holds ``DTensor`` shards: gathered)."""
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[n.replace("_checkpoint_wrapped_module.", "")] = g.detach().float().numpy().copy()
    return out


def _keep_grads(holder: list):
    from transformers import TrainerCallback

    class Keep(TrainerCallback):
        steps: list = []

        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
            self.steps.append(_full_grads(holder[0]))

    return Keep()


def mesh_run(kind: str, trainer: str, out: str, tok_dir: str | None = None, data_dir: str | None = None) -> dict:
    """Two optimizer steps (2 micro-batches of gradient accumulation each) over 8 rows or pairs: ``kind="ring"``
    on 4 ranks with ``ParallelismConfig(dp_shard_size=2, cp_size=2)`` and accelerate's FSDP2 ``prepare``
    (``testkit.fsdp``), the sizes in ``TrainingArguments`` or, for ``trainer="lm-env"``, in the environment
    ``accelerate launch`` sets; ``kind="ref"``: one process, transformers' ``Trainer`` / TRL's ``DPOTrainer``,
    sdpa."""
    from testkit.spawn import launcher_env

    ring = kind == "ring"
    if ring:
        launcher_env()
    attn = "ring" if ring else "sdpa"
    common = dict(output_dir=out, max_steps=2, gradient_accumulation_steps=2, learning_rate=0.05, optim="sgd",
                  logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0,
                  per_device_train_batch_size=1 if ring else 2)  # fmt: skip
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
           "PARALLELISM_CONFIG_CP_SIZE": "2"}  # what `accelerate launch` sets from its config file  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    if ring and trainer.endswith("-env"):
        os.environ.update(env)
    elif ring:
        from accelerate.parallelism_config import ParallelismConfig

        common["parallelism_config"] = ParallelismConfig(dp_shard_size=2, cp_size=2)
    try:
        res = _mesh_train(ring, trainer.removesuffix("-env"), attn, common, tok_dir, data_dir)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return res


def _mesh_train(ring: bool, trainer: str, attn: str, common: dict, tok_dir: str | None, data_dir: str | None) -> dict:
    from contextlib import nullcontext

    from testkit.fsdp import fsdp2_on_cpu
    from testkit.models import tiny_model

    holder: list = [None]
    keep = _keep_grads(holder)
    keep.steps = []
    with fsdp2_on_cpu() if ring else nullcontext():
        if trainer == "lm":
            from datasets import Dataset
            from transformers import Trainer, TrainingArguments

            from hf_ring.trainer import RingTrainer, RingTrainingArguments

            args = (RingTrainingArguments if ring else TrainingArguments)(**common)
            cls = RingTrainer if ring else Trainer
            t = cls(model=tiny_model("llama", attn, vocab_size=VOCAB), args=args,
                    train_dataset=Dataset.from_list(_lm_data()), callbacks=[keep])  # fmt: skip
        else:
            from datasets import load_from_disk
            from peft import LoraConfig
            from transformers import AutoTokenizer
            from trl import DPOConfig, DPOTrainer

            from hf_ring.trainer.dpo import RingDPOConfig, RingDPOTrainer

            args = (RingDPOConfig if ring else DPOConfig)(bf16=False, max_length=48, beta=0.2, **common)
            cls = RingDPOTrainer if ring else DPOTrainer
            lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
            t = cls(model=tiny_model("llama", attn, vocab_size=VOCAB), args=args, peft_config=lora,
                    train_dataset=load_from_disk(data_dir), processing_class=AutoTokenizer.from_pretrained(tok_dir),
                    callbacks=[keep])  # fmt: skip
        holder[0] = t.model
        t.train()
    logs = [{k: v for k, v in h.items() if not k.startswith("train_") and k not in ("epoch", "step", "total_flos")}
            for h in t.state.log_history if "loss" in h]  # fmt: skip
    return {"logs": logs, "grads": keep.steps, "fsdp": bool(t.is_fsdp_enabled), "cp": getattr(t, "cp_size", 1),
            "dp": getattr(t, "dp_size", 1), "world": t.args.world_size}  # fmt: skip


@pytest.mark.parametrize("trainer", ["lm", "lm-env", "dpo"])
def test_fsdp2_over_dp_shard_x_cp_equals_one_process(tmp_path, trainer: str) -> None:
    """``ParallelismConfig(dp_shard_size=2, cp_size=2)`` on 4 processes: hf_ring's ring over CP groups of 2,
    FSDP2 over all 4 (accelerate's real ``fsdp2_prepare_model``): the loss, the logged metrics and every
    gradient of two optimizer steps equal those of one process (``Trainer`` / ``DPOTrainer``, sdpa)."""
    from testkit.spawn import run_ranks

    extra: list = []
    if trainer == "dpo":
        pytest.importorskip("trl")
        from datasets import Dataset

        from tests.test_dpo import _pairs
        from tests.test_trl import _tokenizer

        _tokenizer(tmp_path / "tok")
        Dataset.from_list(_pairs()).save_to_disk(tmp_path / "pairs")
        extra = [str(tmp_path / "tok"), str(tmp_path / "pairs")]
    ring = run_ranks(4, mesh_run, "ring", trainer, str(tmp_path / "ring"), *extra, timeout=MESH_TIMEOUT)
    ref = run_ranks(1, mesh_run, "ref", trainer, str(tmp_path / "ref"), *extra, timeout=MESH_TIMEOUT)[0]
    assert [(r["fsdp"], r["cp"], r["dp"]) for r in ring] == [(True, 2, 2)] * 4
    assert len(ref["logs"]) == len(ring[0]["logs"]) == 2 and len(ref["grads"]) == len(ring[0]["grads"]) == 2
    worst = {"metric": 0.0, "grad": 0.0}
    for r in ring:
        for step in range(2):
            got, want = r["logs"][step], ref["logs"][step]
            assert set(got) - {"seq_len", "tokens_per_second"} == set(want)
            for key, b in want.items():
                a = got[key]
                worst["metric"] = max(worst["metric"], abs(a - b))
                if trainer == "dpo":  # rewards and margins: differences of sums (testkit.post's error model)
                    tol, model = metric_tolerance(key, want, Run("dpo", VOCAB, beta=0.2))
                else:  # the LM loss, a mean of cross-entropies >= 0, and the gradient norm: 84 eps of themselves
                    tol, model = 1e-5 * abs(b), "relative"
                assert abs(a - b) <= tol, f"step {step + 1} {key}: {a} vs {b}, within {tol:.3g}: {model}"
            assert set(r["grads"][step]) == set(ref["grads"][step])
            for name, g in ref["grads"][step].items():
                err = float(np.abs(r["grads"][step][name] - g).max() / max(np.abs(g).max(), 1e-8))
                worst["grad"] = max(worst["grad"], err)
                assert err <= 2e-5, f"step {step + 1} {name}: relative gradient error {err}"
    print(f"{trainer} dp_shard 2 x cp 2, FSDP2: metrics max abs {worst['metric']:.2e}; gradients max error "
          f"relative to the parameter's largest {worst['grad']:.2e}")  # fmt: skip


def dp_shard_without_fsdp(out: str, asked: bool = False) -> str:
    from accelerate.parallelism_config import ParallelismConfig
    from datasets import Dataset

    from hf_ring.trainer import RingTrainer, RingTrainingArguments
    from testkit.models import tiny_model
    from testkit.spawn import launcher_env

    launcher_env()
    more = {"fsdp": "full_shard", "fsdp_config": {"version": 2}} if asked else {}
    args = RingTrainingArguments(output_dir=out, use_cpu=True, report_to="none",
                                 parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=2), **more)  # fmt: skip
    data = Dataset.from_list(_lm_data())
    RingTrainer(model=tiny_model("llama", "ring", vocab_size=VOCAB), args=args, train_dataset=data)
    return "built"


@pytest.mark.parametrize("asked", [False, True])
def test_dp_shard_without_fsdp_is_one_clear_error_on_every_rank(tmp_path, asked: bool) -> None:
    """Without ``fsdp`` the message says to set it; with ``fsdp="full_shard"`` and FSDP2 asked for on gloo
    (which accelerate never shards on) it says why FSDP is off and what to do instead."""
    from testkit.spawn import run_ranks

    with pytest.raises(RuntimeError) as err:
        run_ranks(4, dp_shard_without_fsdp, str(tmp_path), asked, timeout=MESH_TIMEOUT)
    msg = str(err.value)
    assert "failed on 4 rank(s)" in msg and "dp_shard_size=2 shards the model with FSDP2" in msg
    if asked:
        assert "only on GPU-type backends" in msg and "MULTI_CPU" in msg and "set dp_shard_size to 1" in msg, msg
        assert 'set fsdp="full_shard"' not in msg
    else:
        assert 'set fsdp="full_shard"' in msg and "or set dp_shard_size to 1" in msg
