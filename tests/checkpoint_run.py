"""RingTrainer runs that write checkpoints, for tests/test_checkpoints.py.

A tiny Llama with LoRA (dropout on: the RNG states matter), AdamW with a cosine schedule (the
optimizer and scheduler states matter), CP = 2 on 2 processes, passkey data; a checkpoint every
``SAVE`` steps with ``save_total_limit``. ``kind``: ``ddp`` or ``fsdp`` (accelerate's FSDP2 on the
CPU, ``testkit.fsdp``).

``train_run`` runs on every rank of a ``testkit.spawn`` pool; ``killed_rank`` is one rank of a job
that ``testkit.crash`` kills at a point of a checkpoint write (a fresh process, forked from a server
that imported torch and transformers already). As a script, one process per rank, started by the
test with the launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...):

    python tests/checkpoint_run.py freeze OUT TIMEOUT_S         rank 1 stops itself (SIGSTOP) at step 2;
                                                                rank 0 writes the error it ends with
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ = 40
STEPS = 6
SAVE = 2
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"])


def _model():
    from peft import LoraConfig, get_peft_model

    import hf_ring  # noqa: F401  (registers attn_implementation="ring")
    from hf_ring.data.passkey import VOCAB
    from testkit.models import tiny_model

    model = tiny_model("llama", "ring", vocab_size=VOCAB)
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(**LORA))


def _args(out: str, steps: int, limit: int | None, **extra):
    from hf_ring.trainer import RingTrainingArguments

    return RingTrainingArguments(
        output_dir=out,
        cp_size=2,
        max_steps=steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=2e-2,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE,
        save_total_limit=limit,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **extra,
    )


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train_run(
    kind: str,
    out: str,
    resume: str | bool | None = None,
    *,
    steps: int = STEPS,
    limit: int | None = 1,
    final: str | None = None,
    state_dict_type: str = "SHARDED_STATE_DICT",
    launched: bool = False,
) -> dict:
    """One run on this rank; returns the logged steps and losses, the step it started from, the
    warnings of ``hf_ring.trainer`` and, with ``final``, the logits of a probe batch after
    ``trainer.save_model(final)``."""
    from transformers import TrainerCallback

    import hf_ring
    from hf_ring.data.passkey import PasskeyDataset
    from hf_ring.trainer import RingTrainer
    from testkit.fsdp import fsdp2_on_cpu

    if not launched:
        from testkit.spawn import launcher_env

        launcher_env()
    caught = _Warnings()
    logging.getLogger("hf_ring.trainer").addHandler(caught)
    start: list[int] = []

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            start.append(state.global_step)

    try:
        with fsdp2_on_cpu(state_dict_type) if kind == "fsdp" else nullcontext():
            data = PasskeyDataset(seq_len=SEQ, length=64, seed=1)
            args = _args(out, steps, limit)
            trainer = RingTrainer(model=_model(), args=args, train_dataset=data, callbacks=[Start()])
            trainer.train(resume_from_checkpoint=resume)
            logs = [h for h in trainer.state.log_history if "loss" in h]
            res = {
                "start": start[0] if start else None,
                "steps": [h["step"] for h in logs],
                "loss": [h["loss"] for h in logs],
                "fsdp": trainer.is_fsdp_enabled,
                "warnings": caught.messages,
            }
            if final:
                ids = PasskeyDataset(seq_len=SEQ, length=4, seed=7)[0]["input_ids"][None]
                model = trainer.model
                model.eval()
                with torch.no_grad():
                    kw = hf_ring.shard_batch({"input_ids": ids}, group=trainer._cp_group)
                    logits = hf_ring.unshard(model(**kw).logits, group=trainer._cp_group)[:, : ids.shape[1]]
                res["logits"], res["ids"] = logits.float().numpy(), ids.numpy()
                trainer.save_model(final)
    finally:
        logging.getLogger("hf_ring.trainer").removeHandler(caught)
    return res


def killed_rank(rank: int, world: int, port: int, out: str, kind: str, spec: str) -> None:
    """Rank ``rank`` of a job of ``world`` that ``testkit.crash`` kills at ``spec``; training goes to
    ``out/run``. Returns only if the kill point was never reached."""
    from testkit import crash

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    crash.arm(spec, Path(out) / "pids", rank)
    train_run(kind, str(Path(out) / "run"), None, launched=True)


def _freeze(out: Path, timeout: float) -> None:
    """Rank 1 stops itself at the start of step 2; rank 0 must end with a clear error after ``timeout``."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    from hf_ring.data.passkey import PasskeyDataset
    from hf_ring.trainer import RingTrainer

    class Freeze(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1 and dist.get_rank() == 1:
                (out / "stopped").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)

    model, data = _model(), PasskeyDataset(seq_len=SEQ, length=64, seed=1)
    rank = int(os.environ["RANK"])
    (out / f"ready{rank}").write_text("")  # start together: a late rank must not hit the short timeout
    while not all((out / f"ready{r}").exists() for r in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.05)
    args = _args(str(out / "run"), 4, None, ddp_timeout=int(timeout))
    args.save_strategy = "no"
    trainer = RingTrainer(model=model, args=args, train_dataset=data, callbacks=[Freeze()])
    try:
        trainer.train()
    except Exception as e:
        (out / f"error{dist.get_rank()}.json").write_text(json.dumps({"type": type(e).__name__, "message": str(e),
                                                                      "time": time.time()}))  # fmt: skip
        raise  # the process must end by itself (no os._exit here: that is what is tested)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _freeze(Path(sys.argv[2]), float(sys.argv[3]))  # sys.argv[1] == "freeze"
