"""The CPU demo's summary, written by ``scripts/demo.sh`` after both stages:

    python scripts/demo_summary.py SEED MARKS       # writes runs/tiny-cpu-demo/demo.json and prints it in words

``MARKS`` holds one line per point of the demo (``start``, ``setup``, ``pretrain``, ``finetune``): its
name, the wall clock, bash's ``times`` line of the finished children's CPU time, and the 1-minute load
average. With the two runners' ``summary.json`` (their phases' wall seconds on rank 0 and CPU seconds
over every process) they give where the time went (``split``):

* ``setup``: ``scripts/setup_env.sh``, before the demo's clock starts (not in ``wall_seconds``);
* ``startup``: each launch's time outside its runner (interpreter, imports, launcher, exit); the
  second launch imports while the first stage trains, so its wall time counts only what is left over,
  its CPU time all of it;
* ``pretraining``: the first runner's phases but its evaluations (building, training, saving);
* ``evaluations``: the passkey evaluations of both runners;
* ``finetuning``: the second runner's training; ``other``: its building and saving.

In wall seconds the last five add up to the demo's ``wall_seconds``, in CPU seconds to its ``cpu_seconds``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

SPLIT = ("setup", "startup", "pretraining", "evaluations", "finetuning", "other")


def read_marks(path: str | os.PathLike) -> dict[str, tuple[float, float, float]]:
    """``{name: (wall clock, CPU seconds of the shell's finished children, 1-minute load average)}``."""
    marks = {}
    for line in Path(path).read_text().splitlines():
        name, wall, rest = line.split(" ", 2)
        cpu = sum(float(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", rest))
        marks[name] = (float(wall), cpu, float(rest.split()[-1]))
    return marks


def split(marks: dict[str, tuple[float, float, float]], pretrain: dict, finetune: dict) -> dict[str, dict]:
    """Where the time went: ``{"wall_seconds": {part: s}, "cpu_seconds": {part: s}}`` (parts: ``SPLIT``)."""

    def span(a: str, b: str) -> tuple[float, float]:
        return marks[b][0] - marks[a][0], marks[b][1] - marks[a][1]

    wall = dict.fromkeys(SPLIT, 0.0)
    cpu = dict.fromkeys(SPLIT, 0.0)
    wall["setup"], cpu["setup"] = span("start", "setup")
    for stage, (a, b), summary in (("pretraining", ("setup", "pretrain"), pretrain),
                                   ("finetuning", ("pretrain", "finetune"), finetune)):  # fmt: skip
        w, c = span(a, b)
        wall["startup"] += w - sum(summary["seconds"].values())
        cpu["startup"] += c - sum(summary["cpu_seconds"].values())
        for phase in summary["seconds"]:
            if phase.startswith("eval"):
                key = "evaluations"
            else:  # the first stage's building and saving count as pretraining
                key = stage if phase == "train" or stage == "pretraining" else "other"
            wall[key] += summary["seconds"][phase]
            cpu[key] += summary["cpu_seconds"][phase]
    return {"wall_seconds": {k: round(v, 1) for k, v in wall.items()},
            "cpu_seconds": {k: round(v, 1) for k, v in cpu.items()}}  # fmt: skip


def demo_record(seed: int, marks: dict, pretrain: dict, finetune: dict, machine: dict) -> dict:
    """The demo's ``demo.json``: seed, accuracies, steps, wall and CPU seconds, their split, the load."""
    wall = marks["finetune"][0] - marks["setup"][0]
    cpu = marks["finetune"][1] - marks["setup"][1]
    return {
        "seed": seed,
        "accuracy_before": finetune["accuracy_before"],
        "accuracy_after": finetune["accuracy_after"],
        "eval": finetune["eval"],
        "cp_size": finetune["cp_size"],
        "final_loss": finetune["final_loss"],
        "pretrain_steps": pretrain["steps"],
        "pretrain_seconds": pretrain["train_seconds"],
        "finetune_steps": finetune["steps"],
        "finetune_seconds": finetune["train_seconds"],
        "wall_seconds": round(wall, 1),  # from the end of the set-up to the end of the second stage
        "cpu_seconds": round(cpu, 1),
        "split": split(marks, pretrain, finetune),
        "cpus": os.cpu_count(),
        "machine": machine,
        "load_average_1min": {k: v[2] for k, v in marks.items()},  # at the start, after set-up, after each stage
    }


def main(argv: list[str]) -> int:
    from hf_ring.evaluation.runtime import machine_info

    seed, marks = int(argv[0]), read_marks(argv[1])
    p = json.loads(Path("runs/tiny-cpu-demo-pretrain/summary.json").read_text())
    s = json.loads(Path("runs/tiny-cpu-demo/summary.json").read_text())
    demo = demo_record(seed, marks, p, s, machine_info())
    Path("runs/tiny-cpu-demo/demo.json").write_text(json.dumps(demo, indent=2))
    ev, load = s["eval"], demo["load_average_1min"]
    wall, cpu = demo["split"]["wall_seconds"], demo["split"]["cpu_seconds"]
    print(f"\nseed {seed}")
    print(f"short-context pretraining: {p['steps']} steps in {p['train_seconds']:.0f} s")
    print(f"ring-attention fine-tuning (CP={s['cp_size']}): {s['steps']} steps in {s['train_seconds']:.0f} s, "
          f"final loss {s['final_loss']:.4f}")
    print(f"passkey retrieval at {ev['seq_len'] // 1024}K tokens ({ev['samples']} held-out samples, CP=4 prefill): "
          f"{s['accuracy_before']:.0%} before -> {s['accuracy_after']:.0%} after ring-attention fine-tuning")
    print("where the time went, wall / CPU seconds: " + ", ".join(f"{k} {wall[k]:.0f} / {cpu[k]:.0f}" for k in SPLIT))
    print(f"demo wall time {demo['wall_seconds']:.0f} s (set-up not counted), CPU time {demo['cpu_seconds']:.0f} s on "
          f"{demo['machine']['cpu']} ({demo['machine']['cores']} cores, load average {load['setup']:g} at the start, "
          f"{load['finetune']:g} at the end); loss curves: runs/tiny-cpu-demo*/loss.png; runs/tiny-cpu-demo/demo.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
