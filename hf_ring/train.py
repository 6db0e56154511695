"""Long-context fine-tuning with context parallelism: one entry point, configuration in YAML.

    accelerate launch --config_file recipes/accelerate/cpu-4proc.yaml recipes/train.py \\
        hf_ring/recipes/tiny-cpu-demo.yaml

The world is cut into CP groups of ``parallel.cp_size`` ranks (the rest is data parallelism);
every batch goes through ``shard_batch``; the loss of a step is the mean over all its valid
targets (over gradient accumulation and DP replicas), so DDP's averaging gives the gradients of
one device running the whole step. Sample ``i`` of the data is a pure function of ``i``, so a run
resumed from a checkpoint sees exactly the batches it would have seen.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .data.loader import count_targets
from .data.passkey import PasskeyDataset, retrieved
from .parallel import ContextParallel, setup_context_parallel, unshard
from .recipes import read_recipe
from .transformers.batch import shard_batch
from .transformers.patches import enable_activation_checkpointing, enable_chunked_loss, enable_tiled_mlp

STATE_FILE = "trainer_state.pt"


@dataclass(kw_only=True)
class TrainConfig:
    """A run. ``model``: ``config`` (a transformers config dict, random init) or ``name_or_path``;
    optional ``init_from`` (a saved model to start from), ``dtype``, ``overrides`` (config fields).
    ``stages``: ``[{seq_len, steps}]`` run in order (a curriculum, or one stage)."""

    model: dict[str, Any]
    stages: list[dict[str, int]]
    cp_size: int = 1
    data: dict[str, Any] = field(default_factory=lambda: {"task": "passkey"})
    batch_size: int = 1
    grad_accum: int = 1
    lora: dict[str, Any] | None = None
    gradient_checkpointing: bool = False
    activation_offload: bool = False  # checkpointed activations in host memory (hf_ring.ops.offload)
    chunked_loss: bool = True  # loss without full logits (hf_ring.ops.cross_entropy); eval logits unaffected
    tiled_mlp: int | None = None  # run each MLP over tiles of this many tokens (hf_ring.ops.tiled_mlp)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"  # or "cosine"
    max_grad_norm: float | None = 1.0
    eval: dict[str, int] | None = None  # {seq_len, samples}: passkey accuracy before and after
    output_dir: str = "runs/run"
    save_every: int = 0
    stop_after: int | None = None  # leave after this many steps (as if preempted); resume continues
    log_every: int = 1
    seed: int = 0
    memory_gb: dict[str, float] | None = None  # planner's per-GPU estimate, for the reader

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> TrainConfig:
        """The run a recipe describes (a path, or a packaged recipe's name: ``hf_ring.recipes``)."""
        raw = read_recipe(path)
        raw.update(overrides)
        return cls(**raw)

    @property
    def total_steps(self) -> int:
        return sum(s["steps"] for s in self.stages)


def build_model(cfg: TrainConfig, attn: str = "ring") -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    m = cfg.model
    dtype = getattr(torch, m.get("dtype", "float32"))
    if m.get("init_from"):
        model = AutoModelForCausalLM.from_pretrained(m["init_from"], attn_implementation=attn, dtype=dtype)
    elif "config" in m:
        conf = dict(m["config"])
        config = AutoConfig.for_model(conf.pop("model_type"), **conf, **m.get("overrides", {}))
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            m["name_or_path"], attn_implementation=attn, dtype=dtype, **m.get("overrides", {})
        )
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**cfg.lora))
    if cfg.activation_offload and not cfg.gradient_checkpointing:
        raise ValueError("activation_offload: true needs gradient_checkpointing: true")
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(model, offload=cfg.activation_offload)
        if cfg.lora:
            model.enable_input_require_grads()
    if cfg.chunked_loss:
        enable_chunked_loss(model)
    if cfg.tiled_mlp:
        enable_tiled_mlp(model, cfg.tiled_mlp)
    return model


def dataset(cfg: TrainConfig, seq_len: int, stage: int, split: str = "train") -> Any:
    task = cfg.data.get("task", "passkey")
    if task == "passkey":
        return PasskeyDataset(seq_len=seq_len, seed=cfg.seed * 100 + stage + (50 if split == "eval" else 0))
    if task == "tokens":
        from .data.text import PackedTokens

        return PackedTokens(cfg.data["path"], seq_len=seq_len, seed=cfg.seed)
    raise ValueError(f"unknown data task {task!r}; use 'passkey' or 'tokens'")


def _collate(samples: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}


def _lr_factor(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        t = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
    return 1.0


class Trainer:
    """Runs a ``TrainConfig`` on this process; ``accelerate launch`` (or torchrun) starts one per rank."""

    def __init__(self, cfg: TrainConfig) -> None:
        from accelerate import Accelerator

        self.cfg = cfg
        launched = "WORLD_SIZE" in os.environ or dist.is_initialized()
        if cfg.cp_size > 1 and not launched:
            raise RuntimeError(f"cp_size={cfg.cp_size} needs {cfg.cp_size} processes: start with accelerate launch")
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.cp: ContextParallel | None = setup_context_parallel(cfg.cp_size) if launched else None
        self.dp_size = self.cp.dp_size if self.cp else 1
        self.dp_rank = self.cp.dp_rank if self.cp else 0
        self.is_main = self.accelerator.is_main_process
        self.device = self.accelerator.device
        model = build_model(cfg).to(self.device)
        attn = model.config._attn_implementation
        if cfg.cp_size > 1 and attn != "ring":
            raise ValueError(f'cp_size={cfg.cp_size} needs attn_implementation="ring", the model has {attn!r}')
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.model, self.opt = self.accelerator.prepare(model, opt)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: _lr_factor(cfg, s))
        self.step = 0
        self.out = Path(cfg.output_dir)
        self.history: list[dict[str, Any]] = []

    # --- data ---------------------------------------------------------------------------------
    def _stage(self, step: int) -> tuple[int, int]:
        for i, s in enumerate(self.cfg.stages):
            if step < s["steps"]:
                return i, s["seq_len"]
            step -= s["steps"]
        raise IndexError("step past the last stage")

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This DP replica's micro-batches of ``step`` (the same on every rank of its CP group)."""
        cfg = self.cfg
        stage, seq_len = self._stage(step)
        ds = dataset(cfg, seq_len, stage)
        out = []
        for a in range(cfg.grad_accum):
            first = ((step * cfg.grad_accum + a) * self.dp_size + self.dp_rank) * cfg.batch_size
            out.append(_collate([ds[first + j] for j in range(cfg.batch_size)], self.device))
        return out

    # --- training -----------------------------------------------------------------------------
    def forward_backward(self) -> tuple[torch.Tensor, int]:
        """Gradients of the current step (all-reduced by DDP); returns its loss and token count."""
        micro = self.micro_batches(self.step)
        n_targets = count_targets(micro, self.cp.dp_group if self.cp else None)
        loss_sum = torch.zeros((), device=self.device)
        self.model.train()
        for i, mb in enumerate(micro):
            kwargs = shard_batch({**mb, "num_items_in_batch": n_targets}, dp_size=self.dp_size)
            with nullcontext() if i == len(micro) - 1 else self.accelerator.no_sync(self.model):
                out = self.model(**kwargs)
                self.accelerator.backward(out.loss)
            loss_sum += out.loss.detach().float()
        if self.cp is not None and self.dp_size > 1:
            dist.all_reduce(loss_sum, group=self.cp.dp_group)  # each replica holds its share
        return loss_sum, sum(mb["input_ids"].numel() for mb in micro) * self.dp_size

    def optimizer_step(self) -> None:
        if self.cfg.max_grad_norm:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        seq_len = self._stage(self.step)[1]
        loss, tokens = self.forward_backward()
        self.optimizer_step()
        self.step += 1
        seconds = time.perf_counter() - t0
        return {
            "step": self.step,
            "seq_len": seq_len,
            "loss": loss.item(),
            "lr": self.sched.get_last_lr()[0],
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
        }

    def fit(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        last = min(cfg.total_steps, cfg.stop_after or cfg.total_steps)
        while self.step < last:
            rec = self.train_step()
            self.history.append(rec)
            if self.is_main and (rec["step"] % cfg.log_every == 0 or rec["step"] == cfg.total_steps):
                print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
            if (cfg.save_every and rec["step"] % cfg.save_every == 0) or rec["step"] == cfg.stop_after:
                self.save()
        return self.history

    # --- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def passkey_accuracy(self, seq_len: int, samples: int) -> float:
        """Fraction of ``samples`` passkeys retrieved at ``seq_len``, with context-parallel prefill."""
        ds = dataset(self.cfg, seq_len, 0, split="eval")
        self.model.eval()
        hits = torch.zeros(2)
        for i in range(self.dp_rank, samples, self.dp_size):
            batch = _collate([ds[i]], self.device)
            kwargs = shard_batch({"input_ids": batch["input_ids"]})
            logits = unshard(self.model(**kwargs).logits)[:, :seq_len]
            hits += torch.tensor([retrieved(logits.float(), batch["labels"]).sum().item(), 1.0])
        if self.cp is not None and self.dp_size > 1:
            dist.all_reduce(hits, group=self.cp.dp_group)
        return float(hits[0] / hits[1])

    # --- checkpoints --------------------------------------------------------------------------
    def _trainable_state(self) -> dict[str, torch.Tensor]:
        model = self.accelerator.unwrap_model(self.model)
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}

    def save(self, tag: str | None = None) -> Path:
        """Trainable weights (LoRA adapters, or the whole model), optimizer, schedule and step,
        written once by the main process; the model is also saved with ``save_pretrained``."""
        path = self.out / (tag or f"step-{self.step}")
        if self.is_main:
            path.mkdir(parents=True, exist_ok=True)
            self.accelerator.unwrap_model(self.model).save_pretrained(path)
            state = {
                "step": self.step,
                "trainable": self._trainable_state(),
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "history": self.history,
            }
            torch.save(state, path / STATE_FILE)
        if dist.is_initialized():
            dist.barrier()
        return path

    def resume(self, path: str | os.PathLike) -> None:
        """Continue from a checkpoint written by ``save``: the next step is the one it stopped at."""
        state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
        model = self.accelerator.unwrap_model(self.model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in state["trainable"].items():
                params[n].copy_(t)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.history = state["history"]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    steps = sorted(Path(output_dir).glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    steps = [p for p in steps if (p / STATE_FILE).exists()]
    return steps[-1] if steps else None


def plot_loss(history: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], lw=1.2)
    for i in range(1, len(history)):
        if history[i]["seq_len"] != history[i - 1]["seq_len"]:
            ax.axvline(steps[i] - 0.5, color="gray", ls=":", lw=1)
            ax.text(steps[i], ax.get_ylim()[1] * 0.95, f"{history[i]['seq_len']} tokens", fontsize=8, va="top")
    ax.set(xlabel="optimizer step", ylabel="loss (mean over answer tokens)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: TrainConfig, *, resume: bool = True) -> dict[str, Any]:
    """Train (resuming from the latest checkpoint of ``output_dir``), evaluate, save; returns a summary."""
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    ckpt = latest_checkpoint(cfg.output_dir) if resume else None
    if ckpt is not None:
        trainer.resume(ckpt)
    summary: dict[str, Any] = {"cp_size": cfg.cp_size, "dp_size": trainer.dp_size}
    if cfg.eval and trainer.step == 0:
        summary["accuracy_before"] = trainer.passkey_accuracy(cfg.eval["seq_len"], cfg.eval["samples"])
        if trainer.is_main:
            print(json.dumps({"passkey_accuracy_before": summary["accuracy_before"], **cfg.eval}), flush=True)
    history = trainer.fit()
    if trainer.step < cfg.total_steps:  # stopped early: the checkpoint is written, resume later
        return {**summary, "steps": trainer.step, "history": history}
    if cfg.eval:
        summary["accuracy_after"] = trainer.passkey_accuracy(cfg.eval["seq_len"], cfg.eval["samples"])
    trainer.save("final")
    summary.update(steps=trainer.step, wall_seconds=time.perf_counter() - t0, final_loss=history[-1]["loss"])
    summary["history"] = history
    if trainer.is_main:
        out = Path(cfg.output_dir)
        with open(out / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(h) + "\n" for h in history)
        plot_loss(history, out / "loss.png", f"{out.name}: CP={cfg.cp_size}, DP={trainer.dp_size}")
        brief = {k: v for k, v in summary.items() if k != "history"}
        (out / "summary.json").write_text(json.dumps(brief, indent=2))
        print(json.dumps(brief), flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="hf_ring long-context fine-tuning")
    p.add_argument("config", help="a recipe YAML, or the name of one in hf_ring/recipes/")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--no-resume", action="store_true")
    args = p.parse_args(argv)
    overrides = {"output_dir": args.output_dir} if args.output_dir else {}
    run(TrainConfig.from_yaml(args.config, **overrides), resume=not args.no_resume)


__all__ = ["TrainConfig", "Trainer", "run", "main"]
