"""Checkpoints that a kill cannot break, the final model, and a frozen rank (hf_ring.trainer.checkpoints,
saving, timeouts; the runs are tests/checkpoint_run.py: LoRA with dropout, AdamW, cosine schedule,
CP = 2 on 2 processes, under DDP and under accelerate's FSDP2 on the CPU):

- every rank of a job SIGKILLed at several points of a checkpoint write (a file cut in half, a rank
  dying before its FSDP2 shard, everything written but the manifest, half-way through the deletion
  of an older checkpoint by ``save_total_limit``): the plain rerun (``resume_from_checkpoint="last"``)
  says which checkpoint it skipped and why, resumes from the newest complete one, and logs exactly
  the losses of the uninterrupted run; ``save_total_limit`` never deleted the complete one;
- each damaged checkpoint (missing optimizer, scheduler, RNG state, FSDP2 shard or optimizer
  directory, truncated or altered files; with and without a manifest) is refused with an error that
  names the checkpoint and the file, or skipped for an earlier complete one with a warning; never a
  silent fresh optimizer;
- ``trainer.save_model(path)`` under FSDP2 (sharded and full state dicts) and DDP writes an adapter
  that ``PeftModel.from_pretrained`` loads and that reproduces the trained logits;
- a SIGSTOPped rank ends the job within ``ddp_timeout``, with a message naming the call, the group
  and the timeout.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_ring.trainer import checkpoints as ck
from hf_ring.trainer.checkpoints import MANIFEST, CheckpointError, Scope
from testkit.spawn import run_ranks
from tests.checkpoint_run import STEPS, killed_rank, train_run

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 400
TWO = Scope(rank=0, world=2, peers=(0, 1))  # how the ranks of the runs see the checkpoints, from here
KILLS = {  # kind -> kill points in the write of checkpoint-4 (testkit.crash), and where the rerun starts
    "ddp": [("checkpoint-4:truncate:optimizer.pt", 2), ("checkpoint-4:manifest", 2)],
    "fsdp": [("checkpoint-4:shard:pytorch_model_fsdp_0:1", 2), ("checkpoint-4:rotate", 4)],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], out: Path, world: int = 2) -> list[subprocess.Popen]:
    """``world`` processes of tests/checkpoint_run.py with a launcher's environment (no launcher:
    the test sees each rank end)."""
    port = _port()
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        log = (out / f"rank{r}.log").open("w")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "checkpoint_run.py"), *args],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    return procs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each kind run to the end in the pool (``save_total_limit=2``: checkpoints 4 and 6 stay), then
    ``trainer.save_model(out/final)``."""
    runs = {}
    for kind in ("ddp", "fsdp"):
        out = tmp_path_factory.mktemp(f"whole_{kind}")
        res = run_ranks(2, train_run, kind, str(out), None, limit=2, final=str(out / "final"), timeout=TIMEOUT)
        runs[kind] = (out, res[0])
    return runs


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, tuple[Path, list]]:
    """Each kill point: one job of 2 fresh processes (forked from a server that imported torch,
    transformers and peft once), all jobs at once; returns each job's folder and exit codes."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.checkpoint_run", "transformers", "peft", "accelerate", "hf_ring.trainer",
                                "torch.distributed.checkpoint"])  # fmt: skip
    jobs = {}
    for kind, points in KILLS.items():
        for spec, _ in points:
            d, port = tmp_path_factory.mktemp("killed"), _port()
            jobs[spec] = (d, [ctx.Process(target=killed_rank, args=(r, 2, port, str(d), kind, spec)) for r in range(2)])
            for p in jobs[spec][1]:
                p.start()
    deadline = time.monotonic() + TIMEOUT
    out = {}
    for spec, (d, procs) in jobs.items():
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        out[spec] = (d, [p.exitcode for p in procs])
    return out


@pytest.mark.parametrize("kind,spec,start", [(k, s, n) for k, pts in KILLS.items() for s, n in pts])
def test_kill_during_checkpoint_write_then_rerun_resumes_exactly(kind, spec, start, killed, uninterrupted) -> None:
    d, codes = killed[spec]
    assert codes == [-signal.SIGKILL] * 2, f"{spec}: the job was not killed at its point: exit codes {codes}"
    run = d / "run"
    assert (run / "checkpoint-4").is_dir()
    if spec.endswith("rotate"):  # sealed; the older one lost its manifest, then half its files
        assert (run / "checkpoint-4" / MANIFEST).exists() and not (run / "checkpoint-2" / MANIFEST).exists()
    else:  # the interrupted one is not a checkpoint; save_total_limit=1 kept the complete one
        assert not (run / "checkpoint-4" / MANIFEST).exists() and (run / "checkpoint-2" / MANIFEST).exists()
    rerun = run_ranks(2, train_run, kind, str(run), "last", timeout=TIMEOUT)[0]
    assert rerun["start"] == start, f"{spec}: resumed from step {rerun['start']}, not {start}"
    if start == 2:  # checkpoint-4 skipped, and said so
        assert any("Skipped checkpoint(s)" in w and "checkpoint-4 (the save into it did not finish" in w
                   for w in rerun["warnings"]), rerun["warnings"]  # fmt: skip
    else:  # the sealed checkpoint-4 is the newest: nothing to skip
        assert not rerun["warnings"], rerun["warnings"]
    whole = uninterrupted[kind][1]
    want = {s: loss for s, loss in zip(whole["steps"], whole["loss"]) if s > start}
    got = {s: loss for s, loss in zip(rerun["steps"], rerun["loss"]) if s > start}
    assert got == want, f"{spec}: losses after resuming {got} vs uninterrupted {want}"
    assert [p.name for _, p in ck.checkpoint_dirs(run)] == [f"checkpoint-{STEPS}"]  # rotated: only the last
    assert ck.inspect(run / f"checkpoint-{STEPS}") == ("complete", [])


# ------------------------------------------------------------------------------ damaged checkpoints
def _copy(src: Path, dst: Path, *, seal: bool = True) -> Path:
    shutil.copytree(src, dst)
    if not seal:
        (dst / MANIFEST).unlink()
    return dst


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {  # kind -> (what is done, the file the error must name)
    "ddp": [
        ("rm optimizer.pt", "optimizer.pt"),
        ("rm scheduler.pt", "scheduler.pt"),
        ("rm rng_state_1.pth", "rng_state_1.pth"),
        ("rm trainer_state.json", "trainer_state.json"),
        ("cut optimizer.pt", "optimizer.pt"),
        ("cut adapter_model.safetensors", "adapter_model.safetensors"),
        ("cut trainer_state.json", "trainer_state.json"),
    ],
    "fsdp": [
        ("rm optimizer_0", "optimizer_0"),
        ("rm pytorch_model_fsdp_0/__1_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"),
        ("rm pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/.metadata"),
        ("cut optimizer_0/__0_0.distcp", "optimizer_0/__0_0.distcp"),
        ("rm rng_state_0.pth", "rng_state_0.pth"),
    ],
}


def _damage(folder: Path, what: str) -> None:
    op, rel = what.split(" ", 1)
    path = folder / rel
    if op == "cut":
        _cut(path)
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


@pytest.mark.parametrize("sealed", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("kind,what,name", [(k, w, n) for k, cases in DAMAGE.items() for w, n in cases])
def test_damaged_checkpoint_is_named_or_skipped(kind, what, name, sealed, uninterrupted, tmp_path, caplog) -> None:
    src = uninterrupted[kind][0]
    run = tmp_path / "run"
    older = _copy(src / "checkpoint-4", run / "checkpoint-4", seal=sealed)
    newest = _copy(src / "checkpoint-6", run / "checkpoint-6", seal=sealed)
    assert ck.inspect(newest, world=2)[1] == []  # intact before the damage
    _damage(newest, what)
    _, problems = ck.inspect(newest, world=2)
    assert any(name in p for p in problems), problems
    with pytest.raises(CheckpointError) as err:  # named: no silent fresh optimizer
        ck.resolve_resume(str(newest), run, TWO)
    assert str(newest) in str(err.value) and name in str(err.value) and "resume_from_checkpoint" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="hf_ring.trainer"):  # "last": the earlier complete one
        assert ck.resolve_resume("last", run, TWO) == str(older)
    assert any("checkpoint-6" in r.getMessage() and name in r.getMessage() for r in caplog.records)
    shutil.rmtree(older)
    with pytest.raises(CheckpointError, match="No checkpoint in .* can be resumed from"):  # never start over silently
        ck.resolve_resume("last", run, TWO)


def test_checksums_catch_a_changed_file_of_the_same_size(uninterrupted, tmp_path) -> None:
    folder = _copy(uninterrupted["ddp"][0] / "checkpoint-6", tmp_path / "checkpoint-6")
    (folder / MANIFEST).unlink()
    started = time.perf_counter()
    ck.seal(folder, TWO, optimizer=True, checksums=True)
    assert time.perf_counter() - started < 30
    manifest = json.loads((folder / MANIFEST).read_text())
    assert set(manifest["sha256"]) == set(manifest["files"])
    data = bytearray((folder / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "optimizer.pt").write_bytes(bytes(data))
    assert ck.inspect(folder, checksums=False) == ("complete", [])  # the size alone does not see it
    assert any("optimizer.pt does not match its SHA-256" in p for p in ck.inspect(folder)[1])


def test_rotation_keeps_the_newest_complete_checkpoint(tmp_path) -> None:
    def make(step: int, state: str) -> Path:
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "trainer_state.json").write_text("{}")
        if state == "complete":
            (d / MANIFEST).write_text(json.dumps({"files": {"trainer_state.json": 2}}))
        elif state == "incomplete":
            (d / ck.IN_PROGRESS).write_text("")
        return d

    make(2, "complete"), make(4, "incomplete")  # killed while checkpoint-4 was written
    ck.rotate(tmp_path, 1)
    assert [p.name for _, p in ck.checkpoint_dirs(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    make(1, "trainer"), make(6, "complete"), make(8, "incomplete")
    ck.rotate(tmp_path, 1, best=str(tmp_path / "checkpoint-2"))
    assert [p.name for _, p in ck.checkpoint_dirs(tmp_path)] == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]
    ck.rotate(tmp_path, 1)
    assert [p.name for _, p in ck.checkpoint_dirs(tmp_path)] == ["checkpoint-6", "checkpoint-8"]
    make(10, "complete"), make(12, "complete")
    ck.rotate(tmp_path, 3)  # the interrupted checkpoint-8 does not count, and goes
    assert [p.name for _, p in ck.checkpoint_dirs(tmp_path)] == ["checkpoint-6", "checkpoint-10", "checkpoint-12"]


def _refused(kind: str, out: Path, resume: str) -> str:
    with pytest.raises(RuntimeError) as err:
        run_ranks(2, train_run, kind, str(out), resume, timeout=TIMEOUT)
    msg = str(err.value)
    assert "failed on 2 rank(s)" in msg and "CheckpointError" in msg, msg[-3000:]
    return msg


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_resume_from_a_checkpoint_without_its_optimizer_is_refused(kind, uninterrupted, tmp_path) -> None:
    """The case that resumed with fresh AdamW moments and no warning: now every rank refuses it before
    anything loads, naming the checkpoint and the file."""
    ckpt = _copy(uninterrupted[kind][0] / "checkpoint-4", tmp_path / "run" / "checkpoint-4")
    _damage(ckpt, "rm optimizer.pt" if kind == "ddp" else "rm optimizer_0")
    msg = _refused(kind, tmp_path / "run", str(ckpt))
    assert f"Checkpoint {ckpt} is damaged" in msg and ("optimizer.pt is missing" in msg or "optimizer_0/" in msg)


def test_a_file_that_fails_to_load_names_the_checkpoint(uninterrupted, tmp_path) -> None:
    """A checkpoint without a manifest whose optimizer.pt is damaged inside (its size and zip
    directory intact): the load error names the checkpoint and what to do."""
    ckpt = _copy(uninterrupted["ddp"][0] / "checkpoint-4", tmp_path / "run" / "checkpoint-4", seal=False)
    data = bytearray((ckpt / "optimizer.pt").read_bytes())
    data[:4] = b"XXXX"  # the first entry's local header
    (ckpt / "optimizer.pt").write_bytes(bytes(data))
    assert ck.inspect(ckpt, world=2) == ("unsealed", [])
    msg = _refused("ddp", tmp_path / "run", str(ckpt))
    assert f"Checkpoint {ckpt} could not be loaded" in msg and "A file in it is damaged" in msg


def test_recipe_runner_resumes_from_the_newest_complete_checkpoint(uninterrupted, tmp_path, caplog) -> None:
    from hf_ring.recipes.run import _resume
    from hf_ring.trainer import RingTrainer, RingTrainingArguments
    from testkit.models import tiny_model

    run = tmp_path / "run"
    good = _copy(uninterrupted["ddp"][0] / "checkpoint-4", run / "checkpoint-4")
    (run / "checkpoint-6").mkdir()
    (run / "checkpoint-6" / "rng_state_1.pth").write_bytes(b"")  # what a kill left (issue: every rerun failed)
    args = RingTrainingArguments(output_dir=str(run), use_cpu=True, report_to="none", max_steps=1)
    trainer = RingTrainer(model=tiny_model("llama", "sdpa"), args=args)
    with caplog.at_level(logging.WARNING, logger="hf_ring.trainer"):
        assert _resume(trainer) == str(good)
    assert any("checkpoint-6 (" in r.getMessage() and "trainer_state.json is missing" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    args.resume_from_checkpoint = "no"
    assert _resume(trainer) is None
    args.resume_from_checkpoint = str(run / "checkpoint-6")
    with pytest.raises(CheckpointError, match="checkpoint-6 cannot be resumed from: trainer_state.json is missing"):
        _resume(trainer)


# ------------------------------------------------------------------------------------ final model
def _peft_logits(final: Path, ids: np.ndarray) -> np.ndarray:
    from peft import PeftModel

    from hf_ring.data.passkey import VOCAB
    from testkit.models import tiny_model

    loaded = PeftModel.from_pretrained(tiny_model("llama", "sdpa", vocab_size=VOCAB), str(final)).eval()
    with torch.no_grad():
        return loaded(input_ids=torch.as_tensor(ids)).logits.numpy()


def _assert_reproduces(final: Path, res: dict) -> None:
    assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()
    got, want = _peft_logits(final, res["ids"]), res["logits"]
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err <= 1e-5, f"{final}: logits of the loaded adapter differ from the trained model's: rel err {err:.2e}"


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_save_model_writes_the_adapter(kind, uninterrupted) -> None:
    """``trainer.save_model(path)``: under FSDP2 with SHARDED_STATE_DICT (the shipped configs) it
    wrote nothing before; now the gathered adapter, as under DDP."""
    out, res = uninterrupted[kind]
    assert res["fsdp"] == (kind == "fsdp")
    _assert_reproduces(out / "final", res)


def test_save_model_and_checkpoints_under_fsdp2_full_state_dict(tmp_path) -> None:
    out = tmp_path / "full"
    res = run_ranks(2, train_run, "fsdp", str(out), None, steps=2, limit=None, final=str(out / "final"),
                    state_dict_type="FULL_STATE_DICT", timeout=TIMEOUT)[0]  # fmt: skip
    assert res["fsdp"]
    _assert_reproduces(out / "final", res)
    ckpt = out / "checkpoint-2"
    assert (ckpt / "pytorch_model_fsdp.bin").exists() and (ckpt / "optimizer.bin").exists()  # gathered
    assert ck.inspect(ckpt, world=2) == ("complete", [])


# ------------------------------------------------------------------------------------ frozen rank
def test_a_frozen_rank_ends_the_job_within_ddp_timeout(tmp_path) -> None:
    """Rank 1 SIGSTOPs itself at step 2; rank 0 must raise after ``ddp_timeout`` (20 s) with a message
    that names the call, the group and the timeout, and its process must end by itself."""
    limit = 20.0
    procs = _launch(["freeze", str(tmp_path), str(int(limit))], tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT
        while procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = time.time()
        log = (tmp_path / "rank0.log").read_text()[-4000:]
        assert procs[0].poll() is not None, f"rank 0 did not end\n{log}"
        assert procs[0].returncode != 0 and (tmp_path / "stopped").exists(), log
        stopped = float((tmp_path / "stopped").read_text())
        error = json.loads((tmp_path / "error0.json").read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert error["type"] == "CollectiveTimeout", error
    msg = error["message"]
    assert "rank 0:" in msg and "CP group (ranks [0, 1])" in msg and f"within {limit:g} s (ddp_timeout)" in msg, msg
    assert "another rank of the job stopped responding" in msg and "raise ddp_timeout" in msg, msg
    raised, gone = error["time"] - stopped, ended - stopped
    assert limit - 1 <= raised <= limit + 10, f"raised {raised:.1f} s after the rank froze (ddp_timeout {limit:g})"
    assert gone <= raised + 10, f"rank 0 raised after {raised:.1f} s but its process ended only after {gone:.1f} s"


def test_timeout_message_finds_the_call_by_the_packages_directories(tmp_path) -> None:
    """``timeouts.explain`` names the torch.distributed call and hf_ring's caller from the frames' files inside
    torch.distributed and hf_ring, not from ``/hf_ring/`` or ``/torch/distributed/`` in a path: a checkout in a
    folder named ``hf_ring`` (its own name) has that in every path, its virtual environment's torch too."""
    from hf_ring.ops import comm
    from hf_ring.trainer import timeouts

    def raising(filename: str, name: str, body: str, scope: dict) -> object:
        exec(compile(f"def {name}(group=None):\n    {body}\n", filename, "exec"), scope)
        return scope[name]

    fake_torch = tmp_path / "hf_ring" / ".venv" / "lib" / "torch" / "distributed" / "distributed_c10d.py"
    scope: dict = {}
    raising(str(fake_torch), "all_gather", "raise RuntimeError('Timed out waiting 20000ms for recv')", scope)
    raising(str(tmp_path / "hf_ring" / "tests" / "helper.py"), "helper", "all_gather()", scope)
    raising(comm.__file__, "check_same", "helper()", scope)  # a frame in hf_ring's package
    with pytest.raises(RuntimeError) as err:
        scope["check_same"]()
    assert timeouts._where(err.value, None)[0] == "called from hf_ring check_same (ops/comm.py:2)"
    real = {"all_gather": scope["all_gather"]}
    raising(timeouts._DIST + "/distributed_c10d.py", "all_gather", "raise RuntimeError('timed out')", real)
    with pytest.raises(RuntimeError) as err:
        real["all_gather"]()
    assert timeouts._where(err.value, None)[0] == "all_gather"


def test_load_errors_name_damaged_files_only(tmp_path) -> None:
    """A file that fails to load because it is damaged gets the checkpoint's name and what to do; an
    error of another kind (a model that differs from the checkpoint's) keeps its own message."""
    cut = tmp_path / "optimizer.pt"
    torch.save({"state": torch.zeros(64)}, cut)
    _cut(cut)
    with pytest.raises(CheckpointError, match=f"Checkpoint {tmp_path} could not be loaded: RuntimeError"):
        with ck.load_errors(tmp_path):
            torch.load(cut)
    with pytest.raises(RuntimeError, match="size mismatch") as err:
        with ck.load_errors(tmp_path):
            torch.nn.Linear(2, 2).load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(2)})
    assert not isinstance(err.value, CheckpointError)
