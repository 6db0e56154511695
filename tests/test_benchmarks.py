"""The attention benchmark's quick mode produces the long table, and plot.py draws it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"name", "provider", "metric", "x", "P", "N", "median", "p20", "p80", "unit", "machine", "versions",
          "threads", "note"}  # fmt: skip


def run_quick(module: str, out: Path, timeout: float) -> list[dict]:
    """``python -m benchmarks.<module> --quick --out <out>``: its rows, each with exactly ``FIELDS``."""
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert rows and all(set(r) == FIELDS for r in rows)
    return rows


@pytest.mark.timeout(120)
def test_quick_benchmark_table_and_plots(tmp_path):
    out = tmp_path / "attention.jsonl"
    rows = run_quick("bench_attention", out, timeout=110)
    for r in rows:
        assert r["p20"] <= r["median"] + 1e-12 <= r["p80"] + 2e-12 or r["unit"] == "fraction", r
        assert r["machine"]["cores"] >= 1 and r["versions"]["torch"]
    keys = {(r["name"], r["provider"], r["metric"], r["P"], r["N"]) for r in rows}
    for p in (1, 2):
        for prov in ("sdpa", "hf_ring"):
            assert ("fwd_bwd", prov, "time", p, 512) in keys
        assert ("efficiency", "hf_ring", "t_sdpa/t_ring", p, 512) in keys
        assert ("peak_memory", "hf_ring", "rss_growth", p, 512) in keys
    for key in [
        ("fwd_bwd", "torch_ring", "time"),
        ("fwd_bwd", "hf_ring_contiguous", "time"),
        ("fwd_bwd", "hf_ring_nocomm", "time"),
        ("vs_torch_ring", "hf_ring", "t_torch_ring/t_hf_ring"),
        ("load_balance", "hf_ring", "max/mean rank compute"),
        ("load_balance", "hf_ring_contiguous", "max/mean rank compute"),
        ("comm", "hf_ring", "t_comm_alone"),
        ("comm", "hf_ring", "hidden_fraction"),
        ("memory_scaling", "hf_ring", "peak_P*P/peak_1(hf_ring)"),
    ]:
        assert (*key, 2, 512) in keys, key
    # "exposed" is t_ring - t_nocomm, a paired difference: on a noisy machine it may be <= 0 (all hidden)
    times = [r for r in rows if r["unit"] == "s" and r["metric"] != "exposed"]
    assert all(r["median"] > 0 for r in times), [r for r in times if r["median"] <= 0]
    assert all(math.isfinite(r["median"]) for r in rows if r["metric"] == "exposed")
    assert all(r["median"] > 0 for r in rows if r["name"] == "peak_memory")
    assert (out.parent / "attention_raw.json").exists()

    from benchmarks.plot import plot_all

    pngs = plot_all(out, tmp_path / "png")
    assert len(pngs) == 6
    for png in pngs:
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ============================================================================ model benchmark (bench_model.py)
@pytest.mark.timeout(150)
def test_quick_model_benchmark(tmp_path):
    """A tiny Llama training step, CP=2 against CP=1 and single-process SDPA: the long table and its plots."""
    out = tmp_path / "model.jsonl"
    rows = run_quick("bench_model", out, timeout=140)
    for r in rows:
        assert r["p20"] <= r["median"] + 1e-12 <= r["p80"] + 2e-12, r
        assert r["machine"]["cores"] >= 1 and r["versions"]["torch"] and r["versions"]["transformers"]
    by_key = {(r["name"], r["provider"], r["metric"], r["P"], r["N"]): r for r in rows}
    n = 512
    for p in (1, 2):
        for prov in ("hf_ring", "sdpa"):
            for metric in ("time", "tokens_per_s", "time_forward", "time_backward", "time_optimizer"):
                assert by_key[("train_step", prov, metric, p, n)]["median"] > 0, (prov, metric, p)
        assert by_key[("efficiency", "hf_ring", "t_sdpa_step/t_ring_step", p, n)]["median"] > 0
        for metric in ("live_tensor_bytes", "rss_growth_step", "model_state"):
            assert by_key[("peak_memory", "hf_ring", metric, p, n)]["median"] > 0, (metric, p)
            assert by_key[("peak_memory", "hf_ring", metric, p, n)]["unit"] == "MiB"
        assert "checkpointing on" in by_key[("train_step", "hf_ring", "time", p, n)]["note"]
        assert "chunked loss on" in by_key[("train_step", "hf_ring", "time", p, n)]["note"]
    assert by_key[("peak_memory", "sdpa", "live_tensor_bytes", 1, n)]["median"] > 0
    t = by_key[("train_step", "hf_ring", "time", 2, n)]["median"]
    tps = by_key[("train_step", "hf_ring", "tokens_per_s", 2, n)]["median"]
    assert tps == pytest.approx(n / t, rel=1e-9)  # one iteration in quick mode
    assert by_key[("speedup_vs_cp1", "hf_ring", "t_cp1/t_cpP", 2, n)]["median"] > 0
    # the step's memory per rank shrinks with CP (the gradients, a full copy per rank, do not)
    peak = {p: by_key[("peak_memory", "hf_ring", "live_tensor_bytes", p, n)]["median"] for p in (1, 2)}
    assert peak[2] < peak[1], peak
    scaling = by_key[("memory_scaling", "hf_ring", "P*peak_P/peak_1", 2, n)]["median"]
    assert scaling == pytest.approx(2 * peak[2] / peak[1])
    assert by_key[("peak_memory", "hf_ring", "model_state", 2, n)]["median"] == pytest.approx(
        by_key[("peak_memory", "hf_ring", "model_state", 1, n)]["median"]
    )
    assert (tmp_path / "model_raw.json").exists()

    from benchmarks.plot import plot_model

    assert plot_model([r for r in rows if r["name"] not in ("train_step", "peak_memory")], tmp_path / "none") == []
    pngs = plot_model(rows, tmp_path / "png")
    assert [p.name for p in pngs] == ["model_throughput.png", "model_memory.png"]
    for png in pngs:
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ============================================================================ GPU benchmark (bench_gpu.py), CPU mode
GPU_NAMES = {"gpu_fwd_bwd", "gpu_fwd", "gpu_bwd", "gpu_tflops", "gpu_fraction_of_theoretical", "gpu_load_balance",
             "gpu_overlap_threshold", "gpu_overlap_hidden", "gpu_emulation_check"}  # fmt: skip


@pytest.mark.timeout(120)
def test_gpu_benchmark_cpu_mode(tmp_path):
    out = tmp_path / "gpu.jsonl"
    rows = run_quick("bench_gpu", out, timeout=300)
    assert GPU_NAMES <= {r["name"] for r in rows}
    assert rows[0]["machine"]["gpu"] and rows[0]["versions"]["torch"]
    keys = {(r["name"], r["provider"], r["metric"], r["P"], r["N"]) for r in rows}
    for n in (1024, 2048):
        assert ("gpu_fwd_bwd", "sdpa_full", "time", 1, n) in keys
        assert ("gpu_tflops", "sdpa_full", "fwd_bwd", 1, n) in keys
        for p in (2, 4):
            assert ("gpu_fwd_bwd", "hf_ring_emulated", "time", p, n) in keys
            assert ("gpu_fraction_of_theoretical", "hf_ring_emulated", "max_rank.vs_sdpa_full", p, n) in keys
            for link in ("nvlink_450GBps", "ib_50GBps"):
                for metric in ("tokens_per_rank", "tokens_per_rank.planner_default_flops"):
                    assert ("gpu_overlap_threshold", link, metric, p, n) in keys
                assert ("gpu_overlap_hidden", link, "T>=threshold", p, n) in keys
    for r in rows:
        assert r["p20"] <= r["median"] + 1e-12 <= r["p80"] + 2e-12, r
    assert all(r["median"] > 0 for r in rows if r["unit"] in ("s", "TFLOP/s"))
    frac = [r for r in rows if r["name"] == "gpu_fraction_of_theoretical"]
    assert frac and all(0 < r["median"] < 3 for r in frac)
    assert all(r["median"] > 0 for r in rows if r["name"] == "gpu_overlap_threshold")
    assert all(r["median"] in (0.0, 1.0) for r in rows if r["name"] == "gpu_overlap_hidden")
    assert all(r["median"] < 1e-4 for r in rows if r["name"] == "gpu_emulation_check")  # fp32 on CPU
    offload = {(r["name"], r["provider"], r["metric"]): r["median"] for r in rows if "offload" in r["name"]}
    for mode in ("checkpointing", "offload_compute_stream", "offload_side_stream"):
        assert offload[("gpu_offload_step", mode, "time")] > 0
        assert offload[("gpu_offload_step", mode, "ratio_to_checkpointing")] > 0
    assert offload[("gpu_offload_check", "offload_side_stream", "max_rel_diff_vs_checkpointing")] == 0
    assert offload[("gpu_offload_bytes", "offload", "bytes_per_direction")] > 0
    for name in ("torch", "reference"):  # every block kernel of the device, as a block and as an emulated rank
        for metric, p in (("block", 1), ("rank", 2)):
            assert ("gpu_kernel", name, metric, p, 256) in keys and ("gpu_kernel_tflops", name, metric, p, 256) in keys
    assert {"gpu_gemm_tflops", "gpu_memory_GBps", "gpu_model_estimate"} <= {r["name"] for r in rows}
    step = {r["metric"]: r["median"] for r in rows if r["name"] == "gpu_model_step"}
    assert step["time"] > 0 and step["tokens_per_s"] == pytest.approx(1024 / step["time"])

    from benchmarks.plot import plot_gpu

    assert plot_gpu([r for r in rows if not r["name"].startswith("gpu_")], tmp_path / "none") == []
    pngs = plot_gpu(rows, tmp_path / "png")
    assert [p.name for p in pngs] == ["gpu_fraction.png", "gpu_overlap.png", "gpu_kernels.png"]
    for png in pngs:
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.timeout(60)
def test_gpu_benchmark_emulated_rank_runs_the_schedule():
    """An emulated rank makes exactly its schedule's kernel calls (zigzag: one per step, forward and
    backward), leaves hf_ring.ring as it found it, and, fed the right K/V blocks, is exact."""
    import torch

    import hf_ring.ops.comm as hcomm
    import hf_ring.ops.ring as hring
    from benchmarks import gpu_timing as G
    from hf_ring.ops.kernels import get_kernel
    from hf_ring.ops.schedule import make_schedule
    from hf_ring.ops.zigzag import zigzag

    calls = {"forward": 0, "backward": 0}
    untouched = {m: dict(vars(m)) for m in (hring, hcomm, hcomm.RingComm, hcomm.Ring)}

    class Counting:
        def __init__(self, inner):
            self.inner, self.name, self.heads_major = inner, inner.name, inner.heads_major

        def forward(self, *a, **kw):
            calls["forward"] += 1
            return self.inner.forward(*a, **kw)

        def backward(self, *a, **kw):
            calls["backward"] += 1
            return self.inner.backward(*a, **kw)

    kernel = Counting(get_kernel("auto", torch.device("cpu"), torch.float32))
    g = torch.Generator().manual_seed(0)
    for p in (2, 3, 4):
        q, k, v, do = (torch.randn(1, 16 * p, h, 8, generator=g) for h in (4, 2, 2, 4))
        for r in range(p):
            calls.update(forward=0, backward=0)
            sh = [zigzag(t, 1, p, r) for t in (q, k, v, do)]
            t = G.fwd_bwd(G.emulated_rank(r, p, kernel), sh[:3], sh[3], G.Clock(False))
            expected = sum(len(step) for step in make_schedule("zigzag", True, r, p))
            assert expected == p
            assert calls == {"forward": expected, "backward": expected}, (p, r)
            assert t["total"] >= t["fwd"] > 0
    assert all(dict(vars(m)) == d for m, d in untouched.items())
    err = G.emulation_error(q, k, v, do, 4)
    assert err["out"] < 1e-5 and err["dq"] < 1e-5, err


# ============================================================================ gradient errors under autocast
@pytest.mark.timeout(180)
def test_autocast_errors_quick(tmp_path):
    rows = run_quick("bench_autocast", tmp_path / "autocast.jsonl", timeout=170)
    got = {(r["provider"], r["metric"]): r["median"] for r in rows}
    for prov in ("plain", "chunked", "tiled", "chunked_fp32_logits", "chunked_fp32_out"):
        for metric in ("worst_param", "lm_head", "loss", "max_ratio_to_plain"):
            assert (prov, metric) in got
    assert got[("plain", "max_ratio_to_plain")] == 1.0
    assert got[("chunked", "max_ratio_to_plain")] <= 2 and got[("tiled", "max_ratio_to_plain")] <= 2
    before = [p for p, m in got if p.startswith("chunked@") and m == "max_ratio_to_plain"]
    assert all(got[(p, "max_ratio_to_plain")] > 2 for p in before)  # the recompute outside autocast


# ============================================================================ sliding windows
@pytest.mark.timeout(300)
def test_windows_quick(tmp_path):
    """Both tables: times of the windowed layer at P = 4 and one process over N / P; bytes per rank
    per layer flat in N on the border route, growing with N on the ring route."""
    rows = run_quick("bench_windows", tmp_path / "windows.jsonl", timeout=290)
    times = {(r["provider"], r["x"]) for r in rows if r["name"] == "fwd_bwd"}
    assert times == {(p, w) for p in ("cp_border", "one_process_N_over_P") for w in (64, 256)}
    assert all(r["median"] > 0 for r in rows if r["name"] == "fwd_bwd")
    sent = [r for r in rows if r["name"] == "bytes_sent"]
    for w in (64, 256):
        border = [r["median"] for r in sorted(sent, key=lambda r: r["N"]) if r["provider"] == "border" and r["x"] == w]
        ring = [r["median"] for r in sorted(sent, key=lambda r: r["N"]) if r["provider"] == "ring" and r["x"] == w]
        assert len(set(border)) == 1 and ring == sorted(ring) and ring[-1] > ring[0] > border[0]
    assert (tmp_path / "windows.png").exists()


# ============================================================================ hybrid token mixers (bench_mixers.py)
@pytest.mark.timeout(120)
def test_quick_mixer_benchmark(tmp_path):
    """Every mixer family at P = 2: times, efficiency, and the bytes counted from the collectives equal
    the state passing's and the halos' sizes (one (map, state) slot, K - 1 rows per border)."""
    from benchmarks import mixer_cases as B

    out = tmp_path / "mixers.jsonl"
    rows = run_quick("bench_mixers", out, timeout=110)
    got = {(r["x"], r["name"], r["provider"], r["metric"], r["P"], r["N"]): r["median"] for r in rows}
    n = 512
    for name in B.MIXERS:
        for prov in ("hf_ring", "one_process"):
            assert got[(name, "fwd_bwd", prov, "time", 2, n)] > 0
            assert got[(name, "fwd_bwd", prov, "cpu_time", 2, n)] > 0
        assert got[(name, "efficiency", "hf_ring", "t_one/(P*t_rank)", 2, n)] > 0
        sent = got[(name, "comm_bytes", "hf_ring", "bytes_sent_per_rank.total", 2, n)]
        assert 0 < sent < got[(name, "comm_bytes", "all_to_all", "bytes_sent_per_rank.total", 2, n)]
    # P = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (one run); each rank sends one
    # border of K - 1 rows forward and gets its gradient back; rank 0 sends one state slot
    border = (B.CONV["K"] - 1) * B.CONV["C"] * 4
    assert got[("short_conv", "comm_bytes", "hf_ring", "bytes_sent_per_rank.forward", 2, n)] == border
    assert got[("short_conv", "comm_bytes", "hf_ring", "bytes_sent_per_rank.backward", 2, n)] == border
    s = B.GDN
    halo = (s["K"] - 1) * (2 * s["Hk"] * s["Dk"] + s["Hv"] * s["Dv"]) * 4
    slot = s["Hv"] * s["Dk"] * (s["Dk"] + s["Dv"]) * 4  # M [Hv, Dk, Dk] and E [Hv, Dk, Dv], float32
    assert got[("gated_deltanet", "comm_bytes", "hf_ring", "bytes_sent_per_rank.forward", 2, n)] == slot + halo
    assert got[("gated_deltanet", "comm_bytes", "hf_ring", "bytes_sent_per_rank.backward", 2, n)] == 2 * slot + halo
    # the scans pass one slot of (map, state) forward and all-reduce the gathered [P, slots] backward
    ssd, sel, light, lru = B.SSD, B.SEL, B.LIGHT, B.LRU
    for name, slot in (
        ("mamba2_ssd", ssd["H"] * (1 + ssd["P"] * ssd["Nst"])),  # m [H], E [H, P, Nst]
        ("mamba_selective", 2 * sel["D"] * sel["Nst"]),  # m and E [D, Nst]
        ("lightning", light["H"] * (1 + light["Dh"] ** 2)),  # m [H], E [H, Dh, Dh]
        ("rg_lru", 2 * lru["D"]),  # m and E [D]
    ):
        assert got[(name, "comm_bytes", "hf_ring", "bytes_sent_per_rank.forward", 2, n)] == 4 * slot, name
        assert got[(name, "comm_bytes", "hf_ring", "bytes_sent_per_rank.backward", 2, n)] == 2 * 4 * slot, name
    assert (tmp_path / "mixers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn by benchmarks.plot


# ============================================================ GPT-OSS-shaped model step (bench_gptoss.py)
@pytest.mark.timeout(180)
def test_gptoss_quick(tmp_path):
    """CPU seconds of the busiest of 2 ranks and of one process, and their ratio, for one N."""
    rows = run_quick("bench_gptoss", tmp_path / "gptoss.jsonl", timeout=170)
    got = {(r["name"], r["provider"], r["P"]): r["median"] for r in rows}
    assert set(got) == {("fwd_bwd_cpu", "hf_ring", 2), ("fwd_bwd", "hf_ring", 2), ("cpu_ratio", "hf_ring", 2),
                        ("fwd_bwd_cpu", "one_process", 1), ("fwd_bwd", "one_process", 1)}  # fmt: skip
    assert all(v > 0 for v in got.values())
    ratio = got[("fwd_bwd_cpu", "hf_ring", 2)] / got[("fwd_bwd_cpu", "one_process", 1)]
    assert abs(got[("cpu_ratio", "hf_ring", 2)] - ratio) <= 0.2 * ratio


# ================================================================ head groups and tiled layers (bench_tiled.py)
@pytest.mark.timeout(300)
def test_tiled_quick(tmp_path):
    """Every configuration's step time, ratio to the plain step, peak and loss difference; the figure."""
    rows = run_quick("bench_tiled", tmp_path / "tiled.jsonl", timeout=290)
    names = {"base", "head_groups", "tiled_layers", "both"}
    for metric in ("step_time", "step_ratio", "peak_memory", "loss_difference"):
        assert {r["provider"] for r in rows if r["name"] == metric} == names, metric
    assert all(r["median"] > 0 for r in rows if r["name"] in ("step_time", "step_ratio", "peak_memory"))
    assert all(r["median"] < 1e-5 for r in rows if r["name"] == "loss_difference")
    peak = {r["provider"]: r["median"] for r in rows if r["name"] == "peak_memory"}
    assert peak["both"] < peak["base"]
    assert (tmp_path / "tiled.png").exists()
