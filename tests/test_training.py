"""Training under DP x CP through the one training path (``RingTrainer``, driven by the recipe
runner ``hf_ring.recipes.run``): CP=4 against CP=1 over 20 steps of a two-stage curriculum, exact
resume from the last checkpoint of ``output_dir``, a documents recipe (datasets, tokeniser, padding,
TensorBoard), gradients of torch's DDP and FSDP2 against one process, data for DP x CP, and the
accelerate configs of the recipes (one launched as two "nodes" on loopback)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DataLoader

import hf_ring
from hf_ring.data.passkey import VOCAB, PasskeyDataset
from hf_ring.recipes import launch_config_path, launch_configs
from testkit.models import tiny_model
from testkit.oracle import rel_err
from testkit.spawn import launcher_env, run_ranks

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _recipe(path: Path, data: dict, **fields) -> Path:
    base = dict(
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        output_dir=str(path.parent / "out"),
    )
    path.write_text(yaml.safe_dump({"model": {"config": TINY}, "data": data, **base, **fields}))
    return path


def recipe_run(recipe: str, argv: list[str]) -> dict:
    """The recipe runner on this rank; returns its summary and logged steps."""
    from hf_ring.recipes.recipe import parse_recipe
    from hf_ring.recipes.run import run

    launcher_env()
    parsed = parse_recipe(argv, source=recipe)
    summary = run(parsed)
    path = Path(parsed.args.output_dir) / "metrics.jsonl"
    logs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {"summary": summary, "logs": logs}


# --- CP=4 against CP=1 over 20 steps; exact resume ----------------------------------------------


def test_cp4_losses_match_cp1_over_20_steps(tmp_path: Path) -> None:
    stages = [{"seq_len": 48, "steps": 10}, {"seq_len": 64, "steps": 10}]
    recipe = str(_recipe(tmp_path / "r.yaml", {"task": "passkey", "stages": stages}))
    ring = run_ranks(4, recipe_run, recipe, ["--cp_size", "4", "--output_dir", str(tmp_path / "cp4")], timeout=400)
    one = run_ranks(1, recipe_run, recipe, ["--cp_size", "1", "--output_dir", str(tmp_path / "cp1")], timeout=400)
    ring_logs, one_logs = ring[0]["logs"], one[0]["logs"]
    assert [h["step"] for h in ring_logs] == [h["step"] for h in one_logs] == list(range(1, 21))
    assert [h["seq_len"] for h in ring_logs] == [48] * 10 + [64] * 10  # the curriculum, step by step
    for h1, h2 in zip(ring_logs, one_logs):
        assert abs(h1["loss"] - h2["loss"]) <= 1e-4, f"step {h1['step']}: CP=4 loss {h1['loss']}, CP=1 {h2['loss']}"
        assert h1["tokens_per_second"] > 0
    assert ring_logs[-1]["loss"] < ring_logs[0]["loss"]  # it trains
    assert ring[0]["summary"]["cp_size"] == 4 and ring[0]["summary"]["dp_size"] == 1
    assert (tmp_path / "cp4" / "final" / "model.safetensors").exists()


def test_runner_resumes_from_the_last_checkpoint_exactly(tmp_path: Path) -> None:
    """Stopped after step 4 (mid-way through the second stage), a run picks up its last checkpoint
    and logs exactly the losses of the uninterrupted run: model, optimizer, schedule, RNG and the
    position in the staged data are restored."""
    stages = [{"seq_len": 40, "steps": 3}, {"seq_len": 48, "steps": 5}]
    recipe = str(_recipe(tmp_path / "r.yaml", {"task": "passkey", "stages": stages}, cp_size=2))
    args = ["--save_strategy", "steps", "--save_steps", "4"]
    whole = run_ranks(2, recipe_run, recipe, [*args, "--output_dir", str(tmp_path / "whole")], timeout=300)[0]
    split = tmp_path / "split"
    split.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", split / "checkpoint-4")  # as if preempted after step 4
    resumed = run_ranks(2, recipe_run, recipe, [*args, "--output_dir", str(split)], timeout=300)[0]
    assert "accuracy_before" not in resumed["summary"]
    want = {h["step"]: h["loss"] for h in whole["logs"] if h["step"] > 4}
    got = {h["step"]: h["loss"] for h in resumed["logs"] if h["step"] > 4}
    assert list(want) == [5, 6, 7, 8] and got == want, f"resumed {got} vs uninterrupted {want}"


def test_documents_recipe_in_one_process(tmp_path: Path) -> None:
    """Text documents, tokenised with the recipe's tokenizer, one document per padded window;
    TensorBoard logs; metrics with sequence length and throughput; the final model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(tmp_path / "tok")
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (int(n),), generator=g))
            for n in torch.randint(20, 90, (24,), generator=g)]  # fmt: skip
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = {"path": str(tmp_path / "docs.jsonl"), "text_field": "text", "tokenizer": str(tmp_path / "tok"),
            "seq_len": 64, "boundaries": "pad"}  # fmt: skip
    recipe = str(_recipe(tmp_path / "r.yaml", data, max_steps=3, report_to="tensorboard"))
    res = run_ranks(1, recipe_run, recipe, [], timeout=300)[0]
    logs, out = res["logs"], tmp_path / "out"
    assert [h["step"] for h in logs] == [1, 2, 3] and all(h["seq_len"] == 64 for h in logs)
    assert list(out.glob("runs/*/events.out.tfevents.*")), "report_to tensorboard wrote no event file"
    assert (out / "final" / "config.json").exists() and (out / "final" / "tokenizer.json").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_plots_are_optional(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_ring.plots import plot_loss, smooth

    history = [{"step": i, "loss": 1.0 / i, "seq_len": 24 if i < 5 else 64} for i in range(1, 10)]
    assert smooth([1.0, 1.0, 9.0, 1.0, 1.0], window=3) == [1.0, 1.0, 1.0, 1.0, 1.0]  # a spike drops out
    with monkeypatch.context() as m:  # matplotlib not installed; restored (submodules included) after
        m.setitem(sys.modules, "matplotlib", None)
        assert plot_loss(history, tmp_path / "loss.png", "t") is False and not (tmp_path / "loss.png").exists()
    pytest.importorskip("matplotlib")
    assert plot_loss(history, tmp_path / "loss.png", "t") and (tmp_path / "loss.png").exists()


# --- gradients of torch's DDP and FSDP2 against one process ----------------------------------------


def ddp_cp_step() -> dict[str, float]:
    """The same with torch's DDP and shard_batch by hand (no hf_ring trainer)."""
    cp = hf_ring.setup_context_parallel(2)
    model = tiny_model("qwen2", "ring")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ds = PasskeyDataset(seq_len=41, seed=3)
    mine = {k: v[None] for k, v in ds[cp.dp_rank].items()}
    n = hf_ring.count_targets([mine], cp.dp_group)
    ddp(**hf_ring.shard_batch({**mine, "num_items_in_batch": n}, dp_size=cp.dp_size)).loss.backward()
    ref = tiny_model("qwen2", "sdpa", torch.float64)
    both = {k: torch.stack([ds[0][k], ds[1][k]]) for k in ds[0]}
    ref(**both).loss.backward()
    grads = dict(ref.named_parameters())
    return {name: rel_err(p.grad, grads[name].grad) for name, p in model.named_parameters()}


def test_ddp_gradients_equal_single_process() -> None:
    for errs in run_ranks(4, ddp_cp_step):
        assert max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])


def fsdp2_cp_step() -> dict[str, float]:
    """FSDP2 (torch's fully_shard, per decoder layer and root) over the DP x CP world, on CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cp = hf_ring.setup_context_parallel(2)
    model = tiny_model("llama", "ring")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ds = PasskeyDataset(seq_len=41, seed=3)
    mine = {k: v[None] for k, v in ds[cp.dp_rank].items()}
    n = hf_ring.count_targets([mine], cp.dp_group)
    model(**hf_ring.shard_batch({**mine, "num_items_in_batch": n}, dp_size=cp.dp_size)).loss.backward()
    ref = tiny_model("llama", "sdpa", torch.float64)
    ref(**{k: torch.stack([ds[0][k], ds[1][k]]) for k in ds[0]}).loss.backward()
    grads = dict(ref.named_parameters())
    return {name: rel_err(p.grad.full_tensor(), grads[name].grad) for name, p in model.named_parameters()}


def test_fsdp2_gradients_equal_single_process() -> None:
    for errs in run_ranks(4, fsdp2_cp_step):
        assert max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])


# --- data for DP x CP ----------------------------------------------------------------------------


def loader_batches(kind: str) -> list[list[int]]:
    cp = hf_ring.setup_context_parallel(2)
    ds = list(range(40))
    if kind == "sampler":
        loader = DataLoader(ds, batch_size=4, sampler=hf_ring.dp_sampler(ds, cp, seed=1))
    else:
        loader = hf_ring.prepare_dataloader(DataLoader(ds, batch_size=4, shuffle=False), cp)
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("kind", ["sampler", "accelerate"])
def test_cp_ranks_share_batches_dp_replicas_split_them(kind: str) -> None:
    r0, r1, r2, r3 = run_ranks(4, loader_batches, kind)
    assert r0 == r1 and r2 == r3  # one CP group, one stream of batches
    seen0 = {i for b in r0 for i in b}
    seen2 = {i for b in r2 for i in b}
    assert not seen0 & seen2 and len(seen0 | seen2) == 40


# --- recipes' accelerate configs ------------------------------------------------------------------


@pytest.mark.parametrize("path", launch_configs(), ids=lambda p: p.name)
def test_accelerate_config_parses(path: Path) -> None:
    """Each packaged launch config, as ``hf-ring train --config NAME`` gives it, with the module entry point."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from hf_ring.cli import main

    assert launch_config_path(path.stem) == path
    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "hf_ring.cli", "train", "x"])
    args, _, _ = _validate_launch_command(args)
    assert args.num_processes >= 1 and args.num_machines >= 1 and args.module
    assert main(["train", "--config", path.stem]) == 0


@pytest.mark.timeout(400)
def test_two_node_launch_on_loopback(tmp_path: Path) -> None:
    """The packaged launch config cpu-2node: two 'nodes' of 2 processes each, DP=2 x CP=2, each
    process running ``hf-ring train`` as a module (``-m hf_ring.cli train RECIPE``)."""
    recipe = _recipe(tmp_path / "tiny.yaml", {"task": "passkey", "stages": [{"seq_len": 48, "steps": 2}]}, cp_size=2)
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    cmd = [*launch, "--config_file", str(launch_config_path("cpu-2node"))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    nodes = [
        subprocess.Popen([*cmd, "--machine_rank", str(r), "-m", "hf_ring.cli", "train", str(recipe)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    try:
        outs = [n.communicate(timeout=360)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    for n, out in zip(nodes, outs):
        assert n.returncode == 0, out[-3000:]
    assert '"dp_size": 2' in (tmp_path / "out" / "summary.json").read_text()
