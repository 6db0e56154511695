"""The attention benchmark's quick mode produces the long table, and plot.py draws it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"name", "provider", "metric", "x", "P", "N", "median", "p20", "p80", "unit", "machine", "versions",
          "threads", "note"}  # fmt: skip


@pytest.mark.timeout(120)
def test_quick_benchmark_table_and_plots(tmp_path):
    out = tmp_path / "attention.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_attention", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert rows and all(set(r) == FIELDS for r in rows)
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
    times = [r for r in rows if r["unit"] == "s"]
    assert all(r["median"] > 0 for r in times)
    assert all(r["median"] > 0 for r in rows if r["name"] == "peak_memory")
    assert (out.parent / "attention_raw.json").exists()

    from benchmarks.plot import plot_all

    pngs = plot_all(out, tmp_path / "png")
    assert len(pngs) == 6
    for png in pngs:
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
