"""Model-level benchmark of hf_ring on CPU/gloo: one training step of a tiny Llama, CP=P against CP=1.

    python -m benchmarks.bench_model --out benchmarks/results/model.jsonl        # full grid: ~6-7 min on 2 idle cores
    python -m benchmarks.bench_model --out /tmp/model.jsonl --quick              # N=512, P in {1,2}: < 30 s
    python -m benchmarks.bench_model --out /tmp/model_4k.jsonl --Ns 4096         # one N of the full grid

The step is what ``RingTrainer`` runs per optimizer step: forward + backward + gradient clipping (max norm 1)
+ AdamW (lr 1e-3) + ``zero_grad(set_to_none=True)``, on one sequence of N tokens (batch 1; labels
from ``testkit.models.tiny_batch``, the first fifth masked), with activation checkpointing of every
decoder layer (``hf_ring.enable_activation_checkpointing``) and the chunked loss
(``hf_ring.enable_chunked_loss``) on. Model: ``transformers.LlamaConfig`` built from ``MODEL`` (hidden
256, MLP 688, 2 layers, 8 query / 2 K/V heads of dim 32, vocabulary 1024, default rope, untied
embeddings, float32), random weights from the same seed on every rank (``testkit.models.tiny_model``);
nothing is downloaded.

Providers (the rows' ``provider``):
  * ``hf_ring``: attn_implementation="ring" on P gloo ranks (spawned processes; P in {1, 2, 4}), the
    batch through ``hf_ring.shard_batch`` (zigzag shards of N/P tokens); for P > 1 the model is wrapped
    in torch's DistributedDataParallel over the CP group (the gradient all-reduce that the trainer's
    DDP does), for P = 1 it is not (as the trainer on one process).
  * ``sdpa``: attn_implementation="sdpa", one process, the whole sequence, all the threads: the
    baseline. It runs on rank 0 of every P's group, interleaved with the ring steps (one sdpa step,
    then one ring step, per iteration), while the other ranks wait in a barrier, so that both see
    the same machine; its batch also goes through ``shard_batch`` (a 1-rank group), so that it gets
    the same chunked loss.

Threads: every configuration uses the same total (``--threads``, default: all cores); P ranks get
``max(1, threads // P)`` each; when P exceeds the cores the ranks are oversubscribed and the rows
say so in ``note`` (as ``benchmarks.bench_attention``; both use ``benchmarks.harness``'s launcher and
load control).

Measured, per (P, N):
  * ``train_step``/``time``: wall seconds of one step, each rank timing itself from a barrier, the
    max over ranks per iteration; median/p20/p80 over iterations (after ``warmup`` untimed ones).
    ``time_forward``/``time_backward``/``time_optimizer``: the same for the step's phases (clip +
    AdamW + zero_grad in the last; each phase's max over ranks, so they need not add up to ``time``).
  * ``train_step``/``tokens_per_s``: N / step time, per iteration.
  * ``efficiency``/``t_sdpa_step/t_ring_step``: the sdpa step time over the ring step time, paired
    per iteration.
  * ``speedup_vs_cp1``/``t_cp1/t_cpP`` (P > 1): median step time of CP=1 (its own run) over the CP=P
    step time of each iteration.
  * ``peak_memory``/``live_tensor_bytes``: peak of the tensor storage created during one extra step
    (forward + backward + optimizer; activations, gradients, optimizer temporaries) counted by
    ``testkit.live_tensors.LiveTensorBytes``, max over ranks; exact and repeatable. The note says in which
    phase the peak was.
  * ``peak_memory``/``rss_growth_step``: in the same step, growth of the resident set (VmHWM after
    resetting it, minus VmRSS before) while glibc returns every allocation >= 64 KiB to the OS, max
    over ranks: a cross-check that includes what the tracker cannot see (gloo and DDP buffers,
    allocator overhead).
  * ``peak_memory``/``model_state``: parameters + AdamW state, resident on every rank throughout (not
    in the two figures above).
  * ``memory_scaling``/``P*peak_P/peak_1`` (P > 1): P x the CP=P peak per rank / the CP=1 peak (1.0:
    the step's memory divides perfectly over the ranks; the gradients, a full copy of the parameters
    on every rank, do not divide). ``P*rss_P/rss_1``: the same with the resident-set growth.
  * ``machine_load``: CPU used by processes outside the benchmark. An iteration during which they used
    > 10% of the machine is run again (at most ``iters`` times per N). ``--wait-idle S`` waits up to
    S s for a quiet machine before each P.

Output: one JSON object per line with the fields of ``benchmarks.harness.FIELDS`` (name,
provider, metric, x, P, N, median, p20, p80, unit, machine, versions, threads, note), x = N except
for the per-P machine load (x = P); and ``<out stem>_raw.json`` with every per-rank sample.
Memory in MiB. The metric names differ from the attention benchmark's wherever its row names recur
(``efficiency``, ``peak_memory``, ``memory_scaling``), so the two tables can be concatenated.
``benchmarks.plot.plot_model`` draws model_throughput.png and model_memory.png.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness as H

MODEL: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,  # 4 layers would take the full run to ~12 min on 2 cores
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=16384,
)
LR, MAX_GRAD_NORM = 1e-3, 1.0

FULL: dict[str, Any] = {
    "Ns": [4096, 8192, 16384],
    "Ps": [1, 2, 4],
    "iters": {4096: 5, 8192: 3, 16384: 3},
    "warmup": 1,
    "max_foreign": 0.10,  # redo an iteration when other processes used > 10% of the machine during it
    "max_redo": 1,  # ... at most iters times per N
}
QUICK: dict[str, Any] = {
    "Ns": [512],
    "Ps": [1, 2],
    "iters": {512: 1},
    "warmup": 1,
    "max_foreign": 1.0,  # never redo
    "max_redo": 0,
}
SETTINGS = ("activation checkpointing on (every decoder layer), chunked loss on; AdamW lr 1e-3, grad clip 1.0, "
            "zero_grad(set_to_none=True)")  # fmt: skip


# ============================================================================ worker side
class _Trainee:
    """A model, its optimizer and this rank's batch: one trainer-style step at a time."""

    def __init__(self, attn: str, n: int, cfg: dict, group, ddp: bool) -> None:
        import torch

        import hf_ring
        from testkit.models import tiny_batch, tiny_model

        self.model = tiny_model("llama", attn, seed=cfg["seed"], **cfg["model"])
        hf_ring.enable_activation_checkpointing(self.model)
        hf_ring.enable_chunked_loss(self.model)
        self.model.train()
        self.wrapped = (torch.nn.parallel.DistributedDataParallel(self.model, process_group=group) if ddp
                        else self.model)  # fmt: skip
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.0)
        batch = tiny_batch(1, n, vocab=cfg["model"]["vocab_size"], seed=cfg["seed"] + 1)
        self.kwargs = hf_ring.shard_batch(batch, group=group)

    def step(self, mem=None) -> dict[str, float]:
        """One step; with a ``LiveTensorBytes`` ``mem``, also the peak of each phase."""
        import torch

        peaks = {}
        t0 = time.perf_counter()
        out = self.wrapped(**self.kwargs)
        loss = out.loss
        del out
        t1 = time.perf_counter()
        if mem is not None:
            peaks["peak_fwd"] = mem.peak
            mem.reset_peak()
        loss.backward()
        del loss
        t2 = time.perf_counter()
        if mem is not None:
            peaks["peak_bwd"] = mem.peak
            mem.reset_peak()
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if mem is not None:
            peaks["peak_opt"] = mem.peak
        return {"total": t3 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, **peaks}

    def state_bytes(self) -> int:
        """Parameters + optimizer state."""
        import torch

        n = sum(p.numel() * p.element_size() for p in self.params)
        for st in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        return n


def _memory_step(t: _Trainee, group) -> dict:
    """One untimed step under ``LiveTensorBytes`` (peak of the tensor storage it creates, per phase),
    with the resident-set growth across it while glibc returns allocations to the OS."""
    import torch.distributed as dist

    from testkit.live_tensors import LiveTensorBytes

    with H.allocations_to_os():
        gc.collect()
        if group is not None:
            dist.barrier(group=group)
        rss0 = H.status_kib("VmRSS")
        ok = H.reset_hwm()
        with LiveTensorBytes() as mem:
            rec = t.step(mem)
        hwm = H.status_kib("VmHWM")
    peaks = {k: rec[k] for k in ("peak_fwd", "peak_bwd", "peak_opt")}
    return {"peak": max(peaks.values()), **peaks, "rss_growth_kib": hwm - rss0, "hwm_reset": ok,
            "state_bytes": t.state_bytes()}  # fmt: skip


def _iteration(ring: _Trainee, sdpa_step, group, with_sdpa: bool) -> dict:
    """One sdpa step on rank 0 (the others wait in the barrier), then one ring step on every rank."""
    import torch.distributed as dist

    rec: dict = {}
    if with_sdpa:
        dist.barrier(group=group)
        rec["sdpa"] = sdpa_step()
    dist.barrier(group=group)
    rec["hf_ring"] = ring.step()
    return rec


def _run_n(n: int, rank: int, size: int, group, solo, cfg: dict) -> dict:
    """Timings (``harness.measure``: sdpa on rank 0 then the ring, per iteration) and the memory step."""
    import torch

    meter = H.GroupLoad(group, rank, H.machine_info()["cores"])
    ring = _Trainee("ring", n, cfg, group, ddp=size > 1)
    sdpa = _Trainee("sdpa", n, cfg, solo, ddp=False) if rank == 0 and cfg["sdpa"] else None

    def sdpa_step() -> dict:
        if sdpa is None:
            return {}
        torch.set_num_threads(cfg["total_threads"])
        try:
            return sdpa.step()
        finally:
            torch.set_num_threads(cfg["threads"])

    kept, loads, redone = H.measure(lambda: _iteration(ring, sdpa_step, group, cfg["sdpa"]), meter,
                                    warmup=cfg["warmup"], iters=cfg["iters"][str(n)],
                                    max_foreign=cfg["max_foreign"], max_redo=cfg["max_redo"])  # fmt: skip
    samples: dict = {"hf_ring": [], "sdpa": []}
    for rec in kept:
        for k, v in rec.items():
            samples[k].append(v)
    samples["_foreign"], samples["_redone"] = loads, redone
    # the memory step, after the timings: the optimizer state exists, the gradients do not
    samples["memory"] = {"hf_ring": _memory_step(ring, group)}
    if sdpa is not None and size == 1:
        torch.set_num_threads(cfg["total_threads"])
        samples["memory"]["sdpa"] = _memory_step(sdpa, None)
    return samples


def _worker(rank: int, size: int, cfg: dict) -> dict:
    """One rank of a P-rank group: every N in turn."""
    import torch.distributed as dist

    group = dist.group.WORLD
    # the sdpa baseline's shard_batch needs a 1-rank group; every rank must create it
    solo = dist.new_group([0]) if size > 1 else group
    res = {}
    for n in cfg["Ns"]:
        res[str(n)] = _run_n(n, rank, size, group, solo, cfg)
        gc.collect()
    return res


# ============================================================================ driver side
def build_rows(raw: dict, cfg: dict, meta: dict) -> list[dict]:
    """``raw[p][rank][n]`` samples -> the long table."""
    total = cfg["total_threads"]
    tab = H.Table(meta, lambda p: H.threads_per_rank(total, p))
    add, note_of, per_iter_max = tab.add, tab.note, H.per_iter_max
    t_cp1: dict[int, float] = {}
    mem_cp1: dict[tuple[str, int], float] = {}

    for p in cfg["Ps"]:
        ring_note = f"P={p} ranks, DDP over the CP group" if p > 1 else "1 process, no DDP"
        for n in cfg["Ns"]:
            ranks = [raw[p][r][str(n)] for r in range(p)]
            r0 = ranks[0]
            fk = r0["_foreign"]
            nt = (f"iters={len(r0['hf_ring'])}; foreign CPU load in kept iterations median "
                  f"{100 * float(np.median(fk)):.0f}% max {100 * max(fk):.0f}%, "
                  f"{r0['_redone']} iteration(s) redone")  # fmt: skip
            add("machine_load", "other_processes", "foreign_cpu_fraction_kept_iters", p, n, H.stats(fk), "fraction",
                note="CPU used by other processes / (wall x cores), per kept iteration; "
                     f"{r0['_redone']} iteration(s) redone")  # fmt: skip
            t: dict[str, list[float]] = {}
            for prov in ("sdpa", "hf_ring"):
                if not r0[prov]:
                    continue
                per_rank = [r0[prov]] if prov == "sdpa" else [r[prov] for r in ranks]
                if prov == "sdpa":
                    thr = total
                    note = (f"attn_implementation='sdpa', one process, whole sequence, {total} thread(s), run on "
                            f"rank 0 between the P={p} ring steps; {SETTINGS}; {nt}")  # fmt: skip
                else:
                    thr = None
                    note = note_of(p, f"attn_implementation='ring', {ring_note}, max over ranks; {SETTINGS}; {nt}")
                t[prov] = per_iter_max(per_rank, "total")
                add("train_step", prov, "time", p, n, H.stats(t[prov]), "s", threads=thr, note=note)
                add("train_step", prov, "tokens_per_s", p, n, H.stats([n / s for s in t[prov]]), "tokens/s",
                    threads=thr, note="N / step time, per iteration; " + note)  # fmt: skip
                for phase, metric in (("fwd", "time_forward"), ("bwd", "time_backward"), ("opt", "time_optimizer")):
                    add("train_step", prov, metric, p, n, H.stats(per_iter_max(per_rank, phase)), "s", threads=thr,
                        note=note)  # fmt: skip
            if "sdpa" in t:
                eff = [a / b for a, b in zip(t["sdpa"], t["hf_ring"])]
                add("efficiency", "hf_ring", "t_sdpa_step/t_ring_step", p, n, H.stats(eff), "ratio",
                    note=note_of(p, f"t_sdpa: one process, whole sequence, {total} threads; paired per iteration; "
                                    f"{SETTINGS}; {nt}"))  # fmt: skip
            if p == 1:
                t_cp1[n] = float(np.median(t["hf_ring"]))
            elif n in t_cp1:
                add("speedup_vs_cp1", "hf_ring", "t_cp1/t_cpP", p, n, H.stats([t_cp1[n] / s for s in t["hf_ring"]]),
                    "ratio", note=note_of(p, f"median CP=1 step time (its own run) / CP={p} step time per iteration; "
                                             f"{nt}"))  # fmt: skip
            # memory: one extra step per rank after the timings
            for prov in ("hf_ring", "sdpa"):
                if prov not in r0["memory"]:
                    continue
                ms = [r["memory"][prov] for r in ranks if prov in r["memory"]]
                worst = max(ms, key=lambda m: m["peak"])
                phase = {"peak_fwd": "forward", "peak_bwd": "backward", "peak_opt": "optimizer step"}[
                    max(("peak_fwd", "peak_bwd", "peak_opt"), key=lambda k: worst[k])]  # fmt: skip
                peak = max(m["peak"] for m in ms) / 2**20
                rss = max(m["rss_growth_kib"] for m in ms) / 1024
                state = max(m["state_bytes"] for m in ms) / 2**20
                where = "one process, whole sequence" if prov == "sdpa" else f"{ring_note}, max over ranks"
                thr = total if prov == "sdpa" else None
                mnote = f"one step (fwd+bwd+optimizer) after the timings; {where}; {SETTINGS}"
                add("peak_memory", prov, "live_tensor_bytes", p, n, (peak, peak, peak), "MiB", threads=thr,
                    note=note_of(p, "peak of the tensor storage created during the step (activations, gradients, "
                                    f"optimizer temporaries; testkit.live_tensors.LiveTensorBytes), in the {phase}; "
                                    + mnote))  # fmt: skip
                ok = all(m["hwm_reset"] for m in ms)
                add("peak_memory", prov, "rss_growth_step", p, n, (rss, rss, rss), "MiB", threads=thr,
                    note=note_of(p, "peak resident-set growth across the step, glibc mmap threshold 64 KiB; "
                                    + mnote + ("" if ok else "; WARNING: VmHWM reset failed")))  # fmt: skip
                add("peak_memory", prov, "model_state", p, n, (state, state, state), "MiB", threads=thr,
                    note=note_of(p, "parameters + AdamW state, on every rank; not in "
                                    "live_tensor_bytes/rss_growth_step"))  # fmt: skip
                if p == 1:
                    mem_cp1[(prov, n)] = peak
                    mem_cp1[(prov + "_rss", n)] = rss
                elif prov == "hf_ring" and (prov, n) in mem_cp1:
                    for metric, key, v in (("P*peak_P/peak_1", prov, peak), ("P*rss_P/rss_1", prov + "_rss", rss)):
                        r = p * v / mem_cp1[(key, n)]
                        add("memory_scaling", prov, metric, p, n, (r, r, r), "ratio",
                            note=note_of(p, "1.0: the step's memory divides over the ranks; the gradients (a full "
                                            "copy of the parameters per rank) do not"))  # fmt: skip
    for p in cfg["Ps"]:
        v = meta["load"].get(p)
        if v is not None:
            add("machine_load", "other_processes", "foreign_cpu_fraction", p, 0, (v, v, v), "fraction", x=p,
                note="CPU used by processes outside this benchmark during the P run / (wall x cores)")  # fmt: skip
    return tab.rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    H.add_grid_args(ap, "benchmarks/results/model.jsonl")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the single-process sdpa baseline")
    args = ap.parse_args(argv)

    meta: dict[str, Any] = {"machine": H.machine_info(), "versions": H.versions(transformers=True), "load": {}}
    cfg = H.grid_config(args, FULL, QUICK, meta["machine"]["cores"])
    cfg["sdpa"] = not args.no_sdpa
    cfg["model"] = {**MODEL, "max_position_embeddings": max(MODEL["max_position_embeddings"], *cfg["Ns"])}
    cfg["seed"] = 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw_path = out.with_name(out.stem + "_raw.json")

    t_start = time.monotonic()
    raw: dict[int, list] = {}
    walls: dict[int, float] = {}
    for p, per_rank, wall in H.each_p(_worker, cfg, meta, timeout=args.timeout, wait_idle_s=args.wait_idle,
                                      tag="bench_model"):  # fmt: skip
        raw[p], walls[p] = per_rank, wall
    rows = build_rows(raw, cfg, meta)
    H.write_rows(out, rows)
    with open(raw_path, "w") as f:
        json.dump({"config": cfg, "meta": meta, "samples": {str(p): v for p, v in raw.items()},
                   "walls": {str(p): v for p, v in walls.items()}}, f)  # fmt: skip
    for r in rows:
        if (r["name"], r["metric"]) in SUMMARY:
            print(f"  {r['name']:<15} {r['provider']:<8} {r['metric']:<24} P={r['P']} N={r['N']:<6} "
                  f"{r['median']:12.3f} {r['unit']}")  # fmt: skip
    print(f"[bench_model] {len(rows)} rows -> {out} (raw samples: {raw_path}); "
          f"total {time.monotonic() - t_start:.1f} s")  # fmt: skip
    return 0


SUMMARY = {("train_step", "tokens_per_s"), ("efficiency", "t_sdpa_step/t_ring_step"), ("speedup_vs_cp1", "t_cp1/t_cpP"),
           ("peak_memory", "live_tensor_bytes"), ("memory_scaling", "P*peak_P/peak_1")}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
