"""RingTrainer against transformers' Trainer: 5 optimizer steps (gradient accumulation 2, right
padding, masked prompt spans) of a tiny Llama at CP=2 (2 processes), DP=2 x CP=2 (4 processes) and
DP=2 x CP=2 with the CP group as Ulysses 2 (4 processes),
against one process of plain Trainer with sdpa attention on the same data in the same order: the
logged losses, gradient norms and eval loss, and the final parameters, agree in float32.

The runs are tests/trainer_run.py under torchrun (Trainer needs the launcher's environment),
started together once per session; each writes JSON and parameters that the tests read.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "trainer_run.py"
TIMEOUT = 420
TOL = 1e-5


def _launch(args: list[str], nproc: int | None, log: Path) -> subprocess.Popen:
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [*cmd, str(SCRIPT), *args], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Runs the reference and both RingTrainer layouts (concurrently); returns their output folder."""
    out = tmp_path_factory.mktemp("hf_trainer")
    jobs = {
        "ref": _launch(["ref", str(out), "1", "2"], None, out / "ref.log"),
        "cp2": _launch(["ring", str(out), "2"], 2, out / "cp2.log"),
        "dp2cp2": _launch(["ring", str(out), "2"], 4, out / "dp2cp2.log"),
        "dp2u2": _launch(["ring", str(out), "2", "2"], 4, out / "dp2u2.log"),
    }
    deadline = time.monotonic() + TIMEOUT
    failed = []
    for name, proc in jobs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in jobs.values():
                p.kill()
            rc = "timeout"
        if rc != 0:
            failed.append(f"--- {name}: exit {rc}\n{(out / f'{name}.log').read_text()[-4000:]}")
    if failed:
        pytest.fail("training runs failed:\n" + "\n".join(failed))
    return out


def _rel(x, ref) -> float:
    x, ref = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    return float((x - ref).norm() / ref.norm())


def _load(runs: Path, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((runs / f"{name}.json").read_text()), torch.load(runs / f"{name}.pt")


def _compare(runs: Path, ring: str, ref: str, floor: float = 0.0, allow_still: bool = False) -> None:
    """``floor``: judge each parameter's update against at least ``floor`` x the largest update (for
    parameters whose gradients are rounding-level next to the others'). ``allow_still``: a parameter
    that one process leaves exactly put (its SGD steps below float32 rounding) must stay exactly put
    on the ring too."""
    (r, r_params), (s, s_params) = _load(runs, ring), _load(runs, ref)
    init = torch.load(runs / "init.pt")
    largest = max(float((p.double() - init[k].double()).norm()) for k, p in s_params.items())
    assert r["steps"] == s["steps"] == [1, 2, 3, 4, 5]
    for step, (a, b) in enumerate(zip(r["loss"], s["loss"]), 1):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs single-process Trainer {b}"
    for step, (a, b) in enumerate(zip(r["grad_norm"], s["grad_norm"]), 1):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: grad norm {a} vs single-process Trainer {b}"
    assert abs(r["eval_loss"] - s["eval_loss"]) <= TOL * abs(s["eval_loss"])
    assert r_params.keys() == s_params.keys() == init.keys()
    for k, p in s_params.items():
        assert _rel(r_params[k], p) <= TOL, f"{k}: parameter rel err {_rel(r_params[k], p):.2e}"
        # the updates themselves agree, so the check above is not passed by parameters that barely moved
        step = p.double() - init[k].double()
        if allow_still and step.norm() == 0:
            assert float((r_params[k].double() - init[k].double()).norm()) == 0, k
            continue
        assert step.norm() > 0, k
        diff = float((r_params[k].double() - p.double()).norm())
        err = diff / max(float(step.norm()), floor * largest)
        assert err <= 1e-4, f"{k}: update rel err {err:.2e}"
    # predict(): logits gathered over the CP group and the DP replicas, in dataset order
    r_pred, s_pred = torch.load(runs / f"{ring}_pred.pt"), torch.load(runs / f"{ref}_pred.pt")
    real = s_pred["mask"].bool()  # sdpa and ring differ only at padded positions (no targets there)
    for key in ("labelled", "unlabelled"):
        assert r_pred[key].shape == s_pred[key].shape == (*real.shape, 97), key
        err = _rel(r_pred[key][real], s_pred[key][real])
        assert err <= TOL, f"predict ({key}): logits rel err {err:.2e}"


def test_cp2_matches_single_process_trainer(runs: Path) -> None:
    _compare(runs, "ring_w2_cp2", "ref_dp1")


def test_dp2_cp2_matches_single_process_trainer(runs: Path) -> None:
    _compare(runs, "ring_w4_cp2", "ref_dp2")


def test_dp2_cp2_as_ulysses2_matches_single_process_trainer(runs: Path) -> None:
    """Each CP group of 2 is one Ulysses group (all-to-all over heads, no ring), DP 2 across."""
    r, _ = _load(runs, "ring_w4_cp2_u2")
    assert (r["cp_size"], r["dp_size"], r["ulysses_size"]) == (2, 2, 2)
    _compare(runs, "ring_w4_cp2_u2", "ref_dp2")


def test_cp_groups_share_batches_replicas_split_them(runs: Path) -> None:
    cp2, _ = _load(runs, "ring_w2_cp2")
    dp2, _ = _load(runs, "ring_w4_cp2")
    ref1, _ = _load(runs, "ref_dp1")
    ref2, _ = _load(runs, "ref_dp2")
    assert (cp2["cp_size"], cp2["dp_size"], cp2["total_batch"]) == (2, 1, 4)
    assert (dp2["cp_size"], dp2["dp_size"], dp2["total_batch"]) == (2, 2, 8)
    a, b = cp2["first_batches"]
    assert a == b == ref1["first_batch"]
    r0, r1, r2, r3 = dp2["first_batches"]
    assert r0 == r1 and r2 == r3 and r0 != r2
    assert sorted(r0 + r2) == sorted(ref2["first_batch"])


def test_refuses_attention_other_than_ring(runs: Path) -> None:
    for name in ("ring_w2_cp2", "ring_w4_cp2"):
        res, _ = _load(runs, name)
        msg = res["errors"].get("sdpa", "")
        assert 'attn_implementation="ring"' in msg and "'sdpa'" in msg, msg


def test_import_hf_ring_does_not_load_trainer(runs: Path) -> None:
    ref, _ = _load(runs, "ref_dp1")
    assert not ref["trainer_loaded_by_import"], "`import hf_ring` imported transformers.trainer"


def test_cp_size_without_launcher_raises(monkeypatch) -> None:
    from hf_ring.trainer import RingTrainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node 2"):
        RingTrainer(model=None, cp_size=2)


def test_model_side_options_train_like_plain_trainer(tmp_path) -> None:
    """RingTrainingArguments' model-side options (chunked loss, tiled MLP, activation checkpointing
    with offload) are put on the model by RingTrainer and leave the training unchanged: one process,
    3 steps, against plain Trainer on the same data."""
    from transformers import Trainer, TrainingArguments

    from hf_ring.trainer import RingTrainer, RingTrainingArguments
    from testkit.models import tiny_model

    sys.path.insert(0, str(ROOT / "tests"))
    from trainer_run import Samples

    common = dict(max_steps=3, per_device_train_batch_size=2, learning_rate=0.1, optim="sgd", logging_steps=1,
                  report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0)  # fmt: skip
    plain = Trainer(model=tiny_model("llama", "sdpa"), args=TrainingArguments(str(tmp_path / "a"), **common),
                    train_dataset=Samples(12, 1))  # fmt: skip
    plain.train()
    options = dict(tiled_mlp=8, activation_checkpointing=True, activation_offload=True)
    ring = RingTrainer(model=tiny_model("llama", "ring"), args=RingTrainingArguments(str(tmp_path / "b"), **common,
                       **options), train_dataset=Samples(12, 1))  # fmt: skip
    lm = ring.model
    from hf_ring.transformers.loss import CHUNKED
    from hf_ring.transformers.patches import offloaded, tiled

    assert lm in CHUNKED and offloaded(lm) is not None
    assert all(tiled(layer.mlp) == 8 for layer in lm.model.layers)
    ring.train()
    assert lm.is_activation_checkpointing
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (ring, plain)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    with pytest.raises(ValueError, match="activation_offload=True needs activation_checkpointing"):
        RingTrainingArguments(str(tmp_path / "c"), activation_offload=True, use_cpu=True)


def test_no_future_warning_from_hf_ring_calls(tmp_path) -> None:
    """hf_ring's own use of transformers and TRL warns of nothing deprecated: the configs (TRL's default the
    deprecated ``gradient_checkpointing`` alias to True, which transformers >= 5.25 warns of at every run), and
    a RingTrainer step with activation checkpointing and offload; FutureWarning raised as an error."""
    import warnings

    from hf_ring.trainer import RingTrainer, RingTrainingArguments
    from testkit.models import tiny_model

    sys.path.insert(0, str(ROOT / "tests"))
    from trainer_run import Samples

    common = dict(max_steps=1, per_device_train_batch_size=2, report_to="none", use_cpu=True, disable_tqdm=True,
                  save_strategy="no")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        if importlib.util.find_spec("trl") is not None:
            from hf_ring.trainer.dpo import RingDPOConfig
            from hf_ring.trainer.grpo import RingGRPOConfig
            from hf_ring.trainer.trl import RingSFTConfig

            for config in (RingDPOConfig, RingGRPOConfig, RingSFTConfig):
                more = {"num_generations": 2} if config is RingGRPOConfig else {}
                assert config(str(tmp_path / config.__name__), **common, **more).activation_checkpointing is True
        args = RingTrainingArguments(str(tmp_path / "run"), activation_checkpointing=True, activation_offload=True,
                                     **common)  # fmt: skip
        RingTrainer(model=tiny_model("llama", "ring"), args=args, train_dataset=Samples(4, 1)).train()


def _device_setup_messages(out: str) -> dict:
    """On a rank whose gloo group is up and no launcher's environment is set: what transformers' arguments log
    while setting up their devices, for ``TrainingArguments``, ``RingTrainingArguments`` and ``RingDPOConfig``."""
    import logging

    from transformers import TrainingArguments

    from hf_ring.trainer import RingTrainingArguments

    classes = {"TrainingArguments": TrainingArguments, "RingTrainingArguments": RingTrainingArguments}
    try:
        from hf_ring.trainer.dpo import RingDPOConfig

        classes["RingDPOConfig"] = RingDPOConfig
    except ImportError:  # no TRL
        pass
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.pop(k) for k in launcher if k in os.environ}
    seen: dict[str, list[str]] = {}
    handler = logging.Handler()
    handler.emit = lambda record: seen[current].append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.training_args")
    logger.addHandler(handler)
    try:
        for current, cls in classes.items():
            seen[current] = []
            cls(output_dir=out, use_cpu=True, report_to="none")
    finally:
        logger.removeHandler(handler)
        os.environ.update(saved)
    return seen


def test_the_parallel_mode_hint_does_not_reach_the_user(tmp_path) -> None:
    """transformers warns "process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED" when
    arguments set up their devices with a group up that accelerate's state does not use (one process with a
    group, as the tests' one-process references; a CPU launch without use_cpu, which RingTrainer refuses naming
    the fix): hf_ring's arguments keep it from the user, plain ``TrainingArguments`` still say it."""
    from testkit.spawn import run_ranks

    seen = run_ranks(1, _device_setup_messages, str(tmp_path / "out"), timeout=120)[0]
    hint = "torch.distributed process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED"
    assert any(hint in m for m in seen.pop("TrainingArguments")), "transformers no longer says it: drop the filter"
    assert seen and all(not any(hint in m for m in msgs) for msgs in seen.values()), seen
