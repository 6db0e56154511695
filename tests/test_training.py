"""Training under DP x CP: exact optimizer steps with DDP, CP=4 against CP=1 over 20 steps,
exact resume, data for DP x CP, and the accelerate configs of the recipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import hf_ring
from hf_ring.data.passkey import VOCAB, PasskeyDataset
from hf_ring.recipes import packaged_recipes
from hf_ring.train import TrainConfig, Trainer, run
from testkit.models import tiny_model
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

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


def _launcher_env() -> None:
    """Pool workers already share a gloo group; tell accelerate about it as a launcher would."""
    os.environ.update(
        RANK=str(dist.get_rank()),
        WORLD_SIZE=str(dist.get_world_size()),
        LOCAL_RANK=str(dist.get_rank()),
        LOCAL_WORLD_SIZE=str(dist.get_world_size()),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
    )


def _config(**kw) -> TrainConfig:
    base = dict(model={"config": TINY}, stages=[{"seq_len": 37, "steps": 3}], lr=1e-3, max_grad_norm=None)
    return TrainConfig(**{**base, **kw})


# --- one optimizer step under DP=2 x CP=2 equals one process on both sequences ------------------


def _reference_step(cfg: TrainConfig, samples: list[dict]) -> tuple[dict, dict]:
    """One AdamW step of one process, float64, on all ``samples`` as one batch:
    (gradients, parameters after the step)."""
    from hf_ring.train import build_model

    model = build_model(cfg, attn="sdpa").double()
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    model(**batch).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay).step()
    return grads, {n: p.detach() for n, p in model.named_parameters()}


def dp_cp_step(grad_accum: int) -> dict[str, dict[str, float]]:
    """Through hf_ring.train.Trainer (accelerate's DDP over all 4 ranks): the gradients of the
    step (after DDP's averaging) and the parameters after AdamW, against one float64 process."""
    _launcher_env()
    cfg = _config(cp_size=2, grad_accum=grad_accum, lr=1e-3)
    trainer = Trainer(cfg)
    model = trainer.accelerator.unwrap_model(trainer.model)
    trainer.forward_backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    trainer.optimizer_step()
    ds = PasskeyDataset(seq_len=37, seed=0)  # the trainer's first stage: samples 0, 1, ... in step order
    want_grads, want_params = _reference_step(cfg, [ds[i] for i in range(2 * grad_accum)])
    return {
        "grad": {n: rel_err(grads[n], g) for n, g in want_grads.items()},
        "param": {n: rel_err(p, want_params[n]) for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_dp2_cp2_step_equals_single_process(grad_accum: int) -> None:
    for rank, errs in enumerate(run_ranks(4, dp_cp_step, grad_accum)):
        for kind in ("grad", "param"):
            for name, e in errs[kind].items():
                assert e <= 1e-5, f"rank {rank}: {kind} of {name} rel err {e:.2e}"


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


# --- CP=4 against CP=1 over 20 steps; exact resume ----------------------------------------------


def losses(cp_size: int, out: str, steps: int, stop_after: int | None = None) -> list[float]:
    _launcher_env()
    cfg = _config(
        cp_size=cp_size,
        stages=[{"seq_len": 64, "steps": steps}],
        batch_size=2,
        lr=3e-3,
        warmup_steps=2,
        schedule="cosine",
        max_grad_norm=1.0,
        output_dir=out,
        stop_after=stop_after,
    )
    return [h["loss"] for h in run(cfg)["history"]]


def test_cp4_losses_match_cp1_over_20_steps(tmp_path: Path) -> None:
    ring = run_ranks(4, losses, 4, str(tmp_path / "cp4"), 20)[0]
    one = run_ranks(1, losses, 1, str(tmp_path / "cp1"), 20)[0]
    assert len(ring) == len(one) == 20
    for step, (a, b) in enumerate(zip(ring, one), 1):
        assert abs(a - b) <= 1e-4, f"step {step}: CP=4 loss {a:.6f}, CP=1 loss {b:.6f}"
    assert ring[-1] < ring[0]  # it trains


def test_resume_continues_exactly(tmp_path: Path) -> None:
    whole = run_ranks(2, losses, 2, str(tmp_path / "whole"), 8)[0]
    first = run_ranks(2, losses, 2, str(tmp_path / "split"), 8, 4)[0]
    assert (tmp_path / "split" / "step-4" / "trainer_state.pt").exists()
    resumed = run_ranks(2, losses, 2, str(tmp_path / "split"), 8)[0]
    assert first == whole[:4]
    assert resumed == whole, f"resumed {resumed[4:]} vs uninterrupted {whole[4:]}"
    saved = sorted(p.name for p in (tmp_path / "split").iterdir())
    assert "final" in saved and "adapter_config.json" not in saved


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


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_config_parses(path: Path) -> None:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), str(ROOT / "recipes" / "train.py")])
    args, _, _ = _validate_launch_command(args)
    assert args.num_processes >= 1 and args.num_machines >= 1


@pytest.mark.timeout(400)
def test_two_node_launch_on_loopback(tmp_path: Path) -> None:
    """recipes/accelerate/cpu-2node.yaml: two 'nodes' of 2 processes each, DP=2 x CP=2."""
    recipe = tmp_path / "tiny.yaml"
    out = tmp_path / "out"
    stages = "[{seq_len: 48, steps: 2}]"
    recipe.write_text(f"model: {{config: {TINY}}}\ncp_size: 2\nstages: {stages}\noutput_dir: {out}\n")
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    cmd = [*launch, "--config_file", str(ROOT / "recipes/accelerate/cpu-2node.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen([*cmd, "--machine_rank", str(r), str(ROOT / "recipes/train.py"), str(recipe)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    outs = [n.communicate(timeout=360)[0] for n in nodes]
    for n, out in zip(nodes, outs):
        assert n.returncode == 0, out[-3000:]
    assert '"dp_size": 2' in (tmp_path / "out" / "summary.json").read_text()


@pytest.mark.parametrize("path", packaged_recipes(), ids=lambda p: p.name)
def test_recipe_config_loads(path: Path) -> None:
    cfg = TrainConfig.from_yaml(path)
    assert cfg.total_steps > 0 and cfg.cp_size >= 1
    for stage in cfg.stages:
        assert stage["seq_len"] >= 2 * cfg.cp_size


def test_tokens_task_packs_documents(tmp_path: Path) -> None:
    import json

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(i, i + 50))}) + "\n" for i in range(10)))
    cfg = _config(data={"task": "tokens", "path": str(data)}, stages=[{"seq_len": 64, "steps": 2}],
                  output_dir=str(tmp_path / "out"))  # fmt: skip
    summary = run(cfg)
    assert summary["steps"] == 2 and summary["final_loss"] > 0
    from hf_ring.data.text import PackedTokens

    ds = PackedTokens(data, seq_len=64)
    assert len(ds) == 500 // 64 and ds[0]["input_ids"].shape == (64,)
