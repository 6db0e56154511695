"""Train a tiny Llama for a few steps with transformers' Trainer or hf_ring's RingTrainer.

    python tests/trainer_run.py ref OUT_DIR DP [DP ...]        plain Trainer, one process, sdpa:
                                                                   one run per DP (batch DP * B)
    torchrun --nproc_per_node K tests/trainer_run.py ring OUT_DIR CP [U]
                                                                   RingTrainer, K / CP replicas of batch B
                                                                   (U: ulysses_size or auto, default 1)

``HF_RING_TEST_MODEL=<model type>`` trains that family's tiny config (``testkit.families``, vocabulary
97) instead of Llama: a hybrid such as ``qwen3_5_text``.

Each run writes ``<name>.json`` (per-step loss and grad norm, eval loss, error messages checked on
the way) and ``<name>.pt`` (final parameters) into OUT_DIR, from rank 0. The data: right-padded
sequences of varied length with prompt spans masked out of the labels, so that micro-batches and
replicas hold different numbers of targets.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_ring  # noqa: E402,F401  (registers attn_implementation="ring")

TRAINER_LOADED_BY_IMPORT = "transformers.trainer" in sys.modules  # `import hf_ring` must stay light
from testkit.models import tiny_model  # noqa: E402

MODEL = os.environ.get("HF_RING_TEST_MODEL", "llama")
N = 37  # padded length: not a multiple of 2 * CP
B = 2  # per-replica batch
GA = 2
STEPS = 5
TRAIN, EVAL = 40, 8


def build_model(attn: str):
    if MODEL == "llama":
        return tiny_model("llama", attn)
    from testkit.families import causal_lm_class, tiny_config

    torch.manual_seed(0)
    return causal_lm_class(MODEL)._from_config(tiny_config(MODEL, vocab_size=97), attn_implementation=attn)


class Samples(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(count):
            length = int(torch.randint(N // 2, N + 1, (), generator=g))
            prompt = int(torch.randint(1, length // 2, (), generator=g))
            ids = torch.zeros(N, dtype=torch.long)
            ids[:length] = torch.randint(1, 97, (length,), generator=g)
            mask = (torch.arange(N) < length).long()
            labels = ids.masked_fill(mask == 0, -100)
            labels[:prompt] = -100
            self.items.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def training_args(out: Path, batch: int, cls=None, **extra):
    from transformers import TrainingArguments

    cls = cls or TrainingArguments
    return cls(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        gradient_accumulation_steps=GA,
        learning_rate=0.1,
        optim="sgd",  # exact in both: AdamW turns rounding noise on near-zero gradients into +-lr steps
        warmup_steps=0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def result(trainer, eval_loss: float, **extra) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    return {
        "steps": [h["step"] for h in logs],
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "eval_loss": eval_loss,
        **extra,
    }


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def save(out: Path, name: str, trainer, res: dict) -> None:
    torch.save(params(trainer.accelerator.unwrap_model(trainer.model)), out / f"{name}.pt")
    (out / f"{name}.json").write_text(json.dumps(res))


def predictions(trainer) -> dict[str, torch.Tensor]:
    """Logits of the eval set (with labels: through compute_loss; without: the model alone)."""
    data = Samples(EVAL, 2)
    unlabelled = [{k: v for k, v in item.items() if k != "labels"} for item in data.items]
    return {
        "labelled": torch.as_tensor(trainer.predict(data).predictions),
        "unlabelled": torch.as_tensor(trainer.predict(unlabelled).predictions),
        "mask": torch.stack([item["attention_mask"] for item in data.items]),
    }


def run_ref(out: Path, dps: list[int]) -> None:
    from transformers import Trainer

    for dp in dps:
        model = build_model("sdpa")
        torch.save(params(model), out / "init.pt")
        trainer = Trainer(
            model=model,
            args=training_args(out / f"ref{dp}", dp * B),
            train_dataset=Samples(TRAIN, 1),
            eval_dataset=Samples(EVAL, 2),
        )
        trainer.train()
        first = next(iter(trainer.get_train_dataloader()))["input_ids"][:, :4]
        res = result(
            trainer,
            trainer.evaluate()["eval_loss"],
            first_batch=first.tolist(),
            trainer_loaded_by_import=TRAINER_LOADED_BY_IMPORT,
        )
        save(out, f"ref_dp{dp}", trainer, res)
        torch.save(predictions(trainer), out / f"ref_dp{dp}_pred.pt")


def run_ring(out: Path, cp: int, ulysses: int | str = 1) -> None:
    import torch.distributed as dist

    from hf_ring.trainer import RingTrainer, RingTrainingArguments

    world = int(os.environ["WORLD_SIZE"])
    errors = {}
    try:  # the wrong attention implementation is refused before anything else happens
        RingTrainer(model=build_model("sdpa"), args=training_args(out / "bad", B), cp_size=cp)
    except ValueError as e:
        errors["sdpa"] = str(e)
    model = build_model("ring")
    trainer = RingTrainer(
        model=model,
        args=training_args(out / f"ring{world}", B, cls=RingTrainingArguments, cp_size=cp, ulysses_size=ulysses),
        train_dataset=Samples(TRAIN, 1),
        eval_dataset=Samples(EVAL, 2),
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    pred = predictions(trainer)
    # which samples did each rank see in its first batch? (same within a CP group, different across replicas)
    first = next(iter(trainer.get_train_dataloader()))["input_ids"][:, :4].contiguous()
    seen = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(seen, first)
    res = result(
        trainer,
        eval_loss,
        errors=errors,
        cp_size=trainer.cp_size,
        dp_size=trainer.dp_size,
        first_batches=[s.tolist() for s in seen],
        total_batch=trainer.get_total_train_batch_size(trainer.args),
    )
    res["ulysses_size"] = trainer._cp.ulysses_size if trainer._cp is not None else 1
    u = res["ulysses_size"]
    name = f"ring_w{world}_cp{cp}" + (f"_u{u}" if u > 1 else "") + ("_auto" if ulysses == "auto" else "")
    if dist.get_rank() == 0:
        save(out, name, trainer, res)
        torch.save(pred, out / f"{name}_pred.pt")
    dist.barrier()
    # leave without running destructors: a gloo group torn down at interpreter exit can abort the
    # process ("terminate called without an active exception"), and one freed with the DDP reducer
    # while its worker thread waits for the GIL deadlocks (seen with torch 2.13)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if mode == "ref":
        run_ref(out, [int(a) for a in sys.argv[3:]])
    else:
        run_ring(out, int(sys.argv[3]), *(a if a == "auto" else int(a) for a in sys.argv[4:5]))
