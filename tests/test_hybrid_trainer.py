"""RingTrainer with a hybrid model (Qwen3.5: Gated DeltaNet and full attention layers) against
transformers' Trainer: 5 optimizer steps at CP = 2 (2 processes) against one process with sdpa, as
tests/test_trainer.py does for Llama (logged losses, gradient norms, eval loss, final parameters and
predictions within 1e-5; each parameter's update within 1e-4 of at least 1e-3 x the largest update:
the decay parameters of the last Gated DeltaNet layer get gradients ~1e-3 of the others', whose
update after 5 steps is at the level of float32 rounding, on one process as on the ring)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.test_trainer import TIMEOUT, _compare, _launch

MODEL = "qwen3_5_text"


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_trainer_hybrid")
    env = {"HF_RING_TEST_MODEL": MODEL}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        jobs = {
            "ref": _launch(["ref", str(out), "1"], None, out / "ref.log"),
            "cp2": _launch(["ring", str(out), "2"], 2, out / "cp2.log"),
        }
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + TIMEOUT
    failed = []
    for name, proc in jobs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            rc = "timeout"
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            for p in jobs.values():
                p.kill()
            rc = "timeout"
        if rc != 0:
            failed.append(f"--- {name}: exit {rc}\n{(out / f'{name}.log').read_text()[-4000:]}")
    if failed:
        pytest.fail("training runs failed:\n" + "\n".join(failed))
    return out


def test_hybrid_cp2_matches_single_process_trainer(hybrid_runs: Path) -> None:
    _compare(hybrid_runs, "ring_w2_cp2", "ref_dp1", floor=1e-3)
