"""The CPU demo's clock (``scripts/demo_summary.py``): where its time went adds up to the time it took,
and its second stage (``scripts/demo_finetune.py``) waits for the first one's model before it trains."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _summary_module():
    spec = importlib.util.spec_from_file_location("demo_summary", ROOT / "scripts" / "demo_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runner(seconds: dict, cpu: dict, **extra) -> dict:
    return {"seconds": seconds, "cpu_seconds": cpu, "steps": 10, "train_seconds": seconds["train"], **extra}


def test_the_split_adds_up_to_the_demo_time(tmp_path: Path) -> None:
    demo = _summary_module()
    marks = tmp_path / "marks"
    marks.write_text(  # bash's `times` second line: the children's user and system time
        "start 100.0 0m0.000s 0m0.000s 0.5\n"
        "setup 107.5 0m5.000s 0m1.000s 0.6\n"
        "pretrain 147.5 0m40.000s 0m2.000s 1.1\n"
        "finetune 227.5 4m0.000s 0m4.000s 1.9\n"
    )
    pre = _runner({"setup": 0.5, "eval_before": 1.0, "train": 30.0, "eval_after": 1.5, "save": 0.2},
                  {"setup": 0.4, "eval_before": 0.9, "train": 29.0, "eval_after": 1.4, "save": 0.1})  # fmt: skip
    fine = _runner({"setup": 1.0, "eval_before": 12.0, "train": 50.0, "eval_after": 12.0, "save": 0.5},
                   {"setup": 2.0, "eval_before": 47.0, "train": 100.0, "eval_after": 46.0, "save": 0.4},
                   accuracy_before=0.5, accuracy_after=1.0, eval={"seq_len": 8192, "samples": 32, "seed": 0},
                   cp_size=4, final_loss=0.001)  # fmt: skip
    rec = demo.demo_record(3, demo.read_marks(marks), pre, fine, {"cpu": "x", "cores": 2})
    wall, cpu = rec["split"]["wall_seconds"], rec["split"]["cpu_seconds"]
    assert rec["wall_seconds"] == 120.0 and rec["cpu_seconds"] == 238.0  # from the end of the set-up
    assert (wall["setup"], cpu["setup"]) == (7.5, 6.0)
    assert wall["pretraining"] == pytest.approx(30.7) and cpu["pretraining"] == pytest.approx(29.5)
    assert wall["evaluations"] == pytest.approx(26.5) and cpu["evaluations"] == pytest.approx(95.3)
    assert (wall["finetuning"], wall["other"]) == (50.0, 1.5)
    assert wall["startup"] == pytest.approx(40.0 - 33.2 + 80.0 - 75.5)
    assert cpu["startup"] == pytest.approx(36.0 - 31.8 + 202.0 - 195.4)  # the CPU time outside the runners
    assert sum(v for k, v in wall.items() if k != "setup") == pytest.approx(rec["wall_seconds"], abs=0.2)
    assert sum(v for k, v in cpu.items() if k != "setup") == pytest.approx(rec["cpu_seconds"], abs=0.2)
    assert rec["load_average_1min"] == {"start": 0.5, "setup": 0.6, "pretrain": 1.1, "finetune": 1.9}


def test_the_second_stage_waits_for_the_first(tmp_path: Path) -> None:
    """scripts/demo_finetune.py imports, waits until READY exists, then runs ``hf-ring train`` with the
    rest of its arguments (here ``--list``, which trains nothing)."""
    ready = tmp_path / "ready"
    made: list[float] = []

    def later() -> None:
        time.sleep(2.0)
        made.append(time.monotonic())
        ready.touch()

    threading.Thread(target=later, daemon=True).start()
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo_finetune.py"), str(ready), "--list"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    done = time.monotonic()
    assert out.returncode == 0, out.stderr
    assert made and done >= made[0] and "tiny-cpu-demo" in out.stdout
