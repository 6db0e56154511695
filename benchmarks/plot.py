"""Draw every benchmark figure from the long-format JSON-lines tables (one row per measurement).

    python -m benchmarks.plot [TABLE ...] [--outdir DIR]     # default: benchmarks/results/*.jsonl of the benchmarks

The tables are read as one: attention rows (``bench_attention``) give efficiency.png,
vs_torch_ring.png, times.png, load_balance.png, comm_hidden.png and attention_memory.png; model rows
(``bench_model``) model_throughput.png and model_memory.png; GPU rows (``bench_gpu``) gpu_fraction.png
and gpu_overlap.png. Error bars are the p20..p80 range over iterations.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {1: "tab:gray", 2: "tab:blue", 4: "tab:orange", 8: "tab:green"}


def load(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def select(rows, **kw) -> list[dict]:
    return sorted((r for r in rows if all(r.get(k) == v for k, v in kw.items())), key=lambda r: r["x"])


def _series(ax, rows, label, color, style="-o", xkey="x"):
    if not rows:
        return
    xs = [r[xkey] for r in rows]
    med = [r["median"] for r in rows]
    lo = [max(0.0, r["median"] - r["p20"]) for r in rows]
    hi = [max(0.0, r["p80"] - r["median"]) for r in rows]
    ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, color=color, label=label, capsize=3, lw=1.5, ms=5)


def _ps(rows) -> list[int]:
    return sorted({r["P"] for r in rows})


def _subtitle(rows) -> str:
    if not rows:
        return ""
    m, v = rows[0]["machine"], rows[0]["versions"]
    commit = v.get("hf_ring_commit", "?")
    return f"{m['cpu']}, {m['cores']} cores; torch {v['torch']}, hf_ring {v['hf_ring']} ({commit})"


def _log2x(ax, xs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(xs)))
    ax.set_xticklabels([str(x) for x in sorted(set(xs))])


def _finish(fig, ax, rows, title, path, outside=False):
    ax.set_title(title, fontsize=11)
    fig.suptitle(_subtitle(rows), fontsize=7, y=0.995, color="dimgray")
    ax.grid(True, alpha=0.3)
    if outside:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_efficiency(rows, out: Path) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
    eff = [r for r in rows if r["name"] == "efficiency"]
    for p in _ps(eff):
        _series(a1, select(eff, provider="hf_ring", P=p), f"hf_ring P={p}", COLORS.get(p, None))
        _series(a1, select(eff, provider="torch_ring", P=p), f"torch ring P={p}", COLORS.get(p, None), "--s")
    a1.axhline(0.97, color="red", ls=":", lw=1, label="target 0.97")
    a1.set_ylabel("t_sdpa(all threads, 1 process) / t_ring")
    a1.set_title("Efficiency (wall time, same total threads)", fontsize=11)
    ec = [r for r in rows if r["name"] == "efficiency_cpu"]
    for p in _ps(ec):
        _series(a2, select(ec, provider="hf_ring", P=p), f"hf_ring P={p}", COLORS.get(p, None))
        _series(a2, select(ec, provider="torch_ring", P=p), f"torch ring P={p}", COLORS.get(p, None), "--s")
    a2.axhline(1.0, color="black", lw=0.8)
    a2.set_ylabel("CPU s of 1-thread SDPA / (P x max-rank CPU s)")
    a2.set_title("Work efficiency (CPU time; no thread scaling)", fontsize=11)
    for a in (a1, a2):
        if eff:
            _log2x(a, [r["x"] for r in eff])
        a.set_xlabel("total sequence length N")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle("causal, Hq=8, Hkv=2, D=64, fp32, fwd+bwd; " + _subtitle(rows), fontsize=7, y=0.995, color="dimgray")
    fig.tight_layout()
    fig.savefig(out / "efficiency.png", dpi=110)
    plt.close(fig)
    return out / "efficiency.png"


def plot_vs_torch(rows, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    vs = [r for r in rows if r["name"] == "vs_torch_ring"]
    vc = [r for r in rows if r["name"] == "vs_torch_ring_cpu"]
    for p in _ps(vs):
        _series(ax, select(vs, P=p), f"P={p} wall time", COLORS.get(p, None))
        _series(ax, select(vc, P=p), f"P={p} main-thread CPU time", COLORS.get(p, None), "--s")
    ax.axhline(1.10, color="red", ls=":", lw=1, label="target 1.10")
    ax.axhline(1.0, color="black", lw=0.8)
    if vs:
        _log2x(ax, [r["x"] for r in vs])
    ax.set_xlabel("total sequence length N")
    ax.set_ylabel("t_torch_ring / t_hf_ring  (> 1: hf_ring faster)")
    return _finish(fig, ax, rows, "hf_ring vs torch's ring on the same zigzag shards", out / "vs_torch_ring.png")


def plot_times(rows, out: Path) -> Path:
    t = [r for r in rows if r["name"] == "fwd_bwd"]
    ps = _ps(t)
    fig, axes = plt.subplots(1, len(ps), figsize=(4.2 * len(ps), 4.2), squeeze=False, sharey=True)
    styles = {"sdpa": ("k", "-o"), "sdpa_1thread": ("gray", ":o"), "hf_ring": ("tab:blue", "-s"),
              "torch_ring": ("tab:red", "--^"), "hf_ring_contiguous": ("tab:purple", "-.v"),
              "hf_ring_nocomm": ("tab:green", ":x")}  # fmt: skip
    for ax, p in zip(axes[0], ps):
        for prov, (c, st) in styles.items():
            _series(ax, select(t, provider=prov, P=p), prov, c, st)
        _log2x(ax, [r["x"] for r in t])
        ax.set_yscale("log")
        ax.set_xlabel("N")
        th = select(t, provider="hf_ring", P=p)
        ax.set_title(f"P={p}, {th[0]['threads'] if th else '?'} thread(s)/rank", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fwd+bwd seconds (max over ranks)")
    fig.suptitle("fwd+bwd wall time; " + _subtitle(rows), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "times.png", dpi=110)
    plt.close(fig)
    return out / "times.png"


def plot_load_balance(rows, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    lb = [r for r in rows if r["name"] == "load_balance"]
    for p in _ps(lb):
        c = COLORS.get(p, None)
        _series(ax, select(lb, provider="hf_ring", P=p), f"zigzag P={p}", c)
        _series(ax, select(lb, provider="hf_ring_contiguous", P=p), f"contiguous P={p}", c, "--s")
        ax.axhline(2 * p / (p + 1), color=c, ls=":", lw=1, label=f"2P/(P+1) = {2 * p / (p + 1):.2f}")
    ax.axhline(1.03, color="red", ls=":", lw=1, label="target 1.03 (zigzag)")
    if lb:
        _log2x(ax, [r["x"] for r in lb])
    ax.set_xlabel("total sequence length N")
    ax.set_ylabel("max / mean over ranks of per-rank compute")
    return _finish(fig, ax, rows, "Load balance: zigzag vs contiguous (main-thread CPU s)", out / "load_balance.png")


def plot_comm(rows, out: Path) -> Path:
    cm = [r for r in rows if r["name"] == "comm"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
    for p in _ps(cm):
        c = COLORS.get(p, None)
        _series(a1, select(cm, metric="hidden_fraction", P=p), f"P={p}: 1-(t_ring-t_nocomm)/t_comm_alone", c)
        _series(a1, select(cm, metric="hidden_fraction_wait", P=p), f"P={p}: 1-wait/t_comm_alone", c, "--s")
        _series(a2, select(cm, metric="comm_alone_fraction_of_t_ring", P=p), f"P={p}: t_comm_alone/t_ring", c, "-o")
        _series(a2, select(cm, metric="exposed_fraction_of_t_ring", P=p), f"P={p}: (t_ring-t_nocomm)/t_ring", c, "--^")
    a1.axhline(0.95, color="red", ls=":", lw=1, label="target 0.95")
    a1.axhline(1.0, color="black", lw=0.8)
    a1.axhline(0.0, color="black", lw=0.5)
    a1.set_ylabel("hidden fraction of communication")
    a2.set_ylabel("fraction of the ring's fwd+bwd time")
    a2.axhline(0.0, color="black", lw=0.8)
    for a in (a1, a2):
        if cm:
            _log2x(a, [r["x"] for r in cm])
        a.set_xlabel("total sequence length N")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    a1.set_title("Communication hidden behind compute", fontsize=11)
    a2.set_title("What there is to hide vs what shows", fontsize=11)
    fig.suptitle(_subtitle(rows), fontsize=7, y=0.995, color="dimgray")
    fig.tight_layout()
    fig.savefig(out / "comm_hidden.png", dpi=110)
    plt.close(fig)
    return out / "comm_hidden.png"


def plot_memory(rows, out: Path) -> Path:
    mem = [r for r in rows if r["name"] == "peak_memory" and r["metric"] == "rss_growth"]
    ns = sorted({r["N"] for r in mem})
    fig, ax = plt.subplots(figsize=(8.6, 4.6))
    cmap = plt.get_cmap("viridis")
    for i, n in enumerate(ns):
        c = cmap(i / max(1, len(ns) - 1) * 0.85)
        hr = select(mem, provider="hf_ring", N=n)
        _series(ax, hr, f"hf_ring N={n}", c)
        _series(ax, select(mem, provider="torch_ring", N=n), f"torch ring N={n}", c, "--^")
        base = [r for r in hr if r["P"] == 1]
        if base:
            ps = [r["P"] for r in hr]
            ax.plot(ps, [1.1 * base[0]["median"] / p for p in ps], ls=":", color=c, lw=1,
                    label=f"1.1 x peak(P=1)/P, N={n}")  # fmt: skip
        sd = select(mem, provider="sdpa", N=n)
        if sd:
            ax.scatter([1], [sd[0]["median"]], marker="*", s=80, color=c, zorder=5, label=f"SDPA N={n}")
    if mem:
        _log2x(ax, [r["x"] for r in mem])
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("peak RSS growth per rank over one fwd+bwd (MiB)")
    return _finish(
        fig, ax, rows, "Peak memory per rank vs P (excludes q, k, v, dout)", out / "attention_memory.png", outside=True
    )


# ============================================================================ GPU benchmark (bench_gpu.py)
_GPU_MARKERS = {2: "o", 4: "s", 8: "^", 16: "v"}
_LINK_COLORS = ("tab:purple", "tab:red", "tab:brown", "tab:olive", "tab:cyan")


def _gpu_title(rows, what: str) -> str:
    dev = str(rows[0]["machine"].get("gpu", "?"))
    return f"{what} on {'CPU (smoke test)' if dev.startswith('none') else dev}"


def plot_gpu(rows, outdir) -> list[Path]:
    """``gpu_fraction.png`` (fraction of theoretical vs N, per P), ``gpu_overlap.png`` (tokens per rank vs the
    measured overlap threshold, per link) and ``gpu_kernels.png`` (each block kernel's TFLOP/s vs tokens per rank)
    from ``benchmarks.bench_gpu`` rows; [] without them."""
    frac = [r for r in rows if r["name"] == "gpu_fraction_of_theoretical"]
    thr = [r for r in rows if r["name"] == "gpu_overlap_threshold"]
    kern = [r for r in rows if r["name"] == "gpu_kernel_tflops"]
    if not frac and not thr and not kern:
        return []
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if frac:
        # the baseline that uses the ring's own kernel (bench_gpu marks it in the note)
        same = sorted({r["metric"].split(".vs_")[1] for r in frac if "same kernel" in r["note"]}) or sorted(
            {r["metric"].split(".vs_")[1] for r in frac}
        )
        base = same[0]
        fig, ax = plt.subplots(figsize=(6.8, 4.4))
        for p in _ps(frac):
            c = COLORS.get(p, None)
            _series(ax, select(frac, metric=f"max_rank.vs_{base}", P=p), f"P={p}, slowest rank", c)
            _series(ax, select(frac, metric=f"mean_rank.vs_{base}", P=p), f"P={p}, mean over ranks", c, ":s")
        ax.axhline(1.0, color="black", lw=0.8, label="theoretical (t_full / P)")
        _log2x(ax, [r["x"] for r in frac])
        ax.set_xlabel("total sequence length N")
        ax.set_ylabel(f"(t_{base} / P) / t_rank")
        ax.set_ylim(bottom=0)
        paths.append(_finish(fig, ax, frac, _gpu_title(frac, "Emulated zigzag rank vs full attention / P"),
                             out / "gpu_fraction.png", outside=True))  # fmt: skip
    if thr:
        fig, ax = plt.subplots(figsize=(7.4, 4.6))
        meas = [dict(r, T=r["N"] // r["P"]) for r in thr if r["metric"] == "tokens_per_rank"]
        links = sorted({r["provider"] for r in thr})
        ts = [r["T"] for r in meas]
        for i, link in enumerate(links):
            c = _LINK_COLORS[i % len(_LINK_COLORS)]
            for p in _ps(meas):
                pts = sorted((r for r in meas if r["provider"] == link and r["P"] == p), key=lambda r: r["T"])
                _series(ax, pts, f"{link}, P={p}", c, "-" + _GPU_MARKERS.get(p, "o"), xkey="T")
            plan = [r["median"] for r in thr if r["provider"] == link and r["metric"].endswith("planner_default_flops")]
            if plan:
                ax.axhline(max(plan), color=c, ls="--", lw=1, label=f"{link}: plan() at 400 TFLOP/s")
        if ts:
            lo, hi = min(ts) / 2, max(ts) * 2
            ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="threshold = T (hidden below)")
            _log2x(ax, ts)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank T = N / P")
        ax.set_ylabel("overlap threshold T* (tokens per rank)")
        paths.append(_finish(fig, ax, thr, _gpu_title(thr, "Ring overlap: measured threshold vs T"),
                             out / "gpu_overlap.png", outside=True))  # fmt: skip
    if kern:  # each block kernel: a causal block and an emulated rank, TFLOP/s vs tokens per rank
        fig, ax = plt.subplots(figsize=(7.4, 4.6))
        for i, name in enumerate(sorted({r["provider"] for r in kern})):
            c = _LINK_COLORS[i % len(_LINK_COLORS)]
            _series(ax, select(kern, provider=name, metric="block"), f"{name}, causal block", c)
            _series(ax, select(kern, provider=name, metric="rank"), f"{name}, emulated rank", c, ":s")
        _log2x(ax, [r["x"] for r in kern])
        ax.set_xlabel("tokens per rank T")
        ax.set_ylabel("TFLOP/s (fwd + bwd)")
        ax.set_ylim(bottom=0)
        paths.append(_finish(fig, ax, kern, _gpu_title(kern, "Block kernels"), out / "gpu_kernels.png", outside=True))
    return paths


# ============================================================================ model benchmark (bench_model.py)
def plot_model(rows, outdir) -> list[Path]:
    """``model_throughput.png`` (tokens/s, and t_sdpa/t_ring with the speedup over CP=1, vs N per P)
    and ``model_memory.png`` (peak MiB per rank vs N per P) from ``benchmarks.bench_model`` rows;
    [] without them."""
    tp = [r for r in rows if r["name"] == "train_step" and r["metric"] == "tokens_per_s"]
    mem = [r for r in rows if r["name"] == "peak_memory" and r["metric"] in ("live_tensor_bytes", "rss_growth_step")]
    if not tp and not mem:
        return []
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    label = "tiny Llama training step (fwd+bwd+AdamW), checkpointing + chunked loss, fp32"
    if tp:
        eff = [r for r in rows if r["name"] == "efficiency" and r["metric"] == "t_sdpa_step/t_ring_step"]
        spd = [r for r in rows if r["name"] == "speedup_vs_cp1" and r["provider"] == "hf_ring"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
        for p in _ps(tp):
            _series(a1, select(tp, provider="hf_ring", P=p), f"hf_ring CP={p}", COLORS.get(p, None))
        sd = [r for r in tp if r["provider"] == "sdpa"]
        if sd:  # measured in every P's run; the smallest P's (CP=1: the same process layout)
            _series(a1, select(sd, P=min(_ps(sd))), "sdpa, 1 process, all threads", "black", "--^")
        a1.set_yscale("log")
        a1.set_ylabel("tokens / s (N / step time; max over ranks)")
        a1.set_title("Training throughput", fontsize=11)
        for p in _ps(eff):
            _series(a2, select(eff, provider="hf_ring", P=p), f"CP={p}: t_sdpa / t_ring", COLORS.get(p, None))
        for p in _ps(spd):
            _series(a2, select(spd, P=p), f"CP={p}: t(CP=1) / t(CP={p})", COLORS.get(p, None), "--s")
        a2.axhline(1.0, color="black", lw=0.8)
        a2.set_ylabel("ratio of step times (> 1: hf_ring CP=P faster)")
        a2.set_title("vs single-process SDPA (paired) and vs CP=1", fontsize=11)
        for a in (a1, a2):
            _log2x(a, [r["x"] for r in tp])
            a.set_xlabel("sequence length N (tokens)")
            a.grid(True, alpha=0.3, which="both")
            a.legend(fontsize=7)
        fig.suptitle(label + "; " + _subtitle(tp), fontsize=7, y=0.995, color="dimgray")
        fig.tight_layout()
        fig.savefig(out / "model_throughput.png", dpi=110)
        plt.close(fig)
        paths.append(out / "model_throughput.png")
    if mem:
        fig, ax = plt.subplots(figsize=(8.2, 4.6))
        live = [r for r in mem if r["metric"] == "live_tensor_bytes"]
        rss = [r for r in mem if r["metric"] == "rss_growth_step"]
        for p in _ps(mem):
            c = COLORS.get(p, None)
            _series(ax, select(live, provider="hf_ring", P=p), f"hf_ring CP={p}: live tensors", c)
            _series(ax, select(rss, provider="hf_ring", P=p), f"hf_ring CP={p}: RSS growth", c, ":s")
            base = select(live, provider="hf_ring", P=1)
            if p > 1 and base:
                ax.plot([r["x"] for r in base], [r["median"] / p for r in base], ls="--", lw=0.8, color=c,
                        label=f"CP=1 live tensors / {p}")  # fmt: skip
        _series(ax, select(live, provider="sdpa", P=1), "sdpa, 1 process: live tensors", "black", "--^")
        _log2x(ax, [r["x"] for r in mem])
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_ylabel("peak per rank during one step (MiB)")
        state = [r for r in rows if r["name"] == "peak_memory" and r["metric"] == "model_state"]
        extra = f"; + {state[0]['median']:.0f} MiB parameters and AdamW state" if state else ""
        paths.append(_finish(fig, ax, mem, "Peak memory per rank of a training step" + extra,
                             out / "model_memory.png", outside=True))  # fmt: skip
    return paths


ATTENTION_PLOTS = (plot_efficiency, plot_vs_torch, plot_times, plot_load_balance, plot_comm, plot_memory)
DEFAULT_TABLES = ("attention.jsonl", "model.jsonl", "gpu.jsonl")


def plot_all(tables: str | Path | list[str | Path], outdir: str | Path) -> list[Path]:
    """Every figure that the rows of ``tables`` (one or more JSON-lines files, read as one table) give."""
    tables = [tables] if isinstance(tables, (str, Path)) else tables
    rows = [r for t in tables for r in load(t)]
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [f(rows, out) for f in ATTENTION_PLOTS] if select(rows, name="fwd_bwd") else []
    return paths + plot_model(rows, out) + plot_gpu(rows, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="*", help="default: the tables of benchmarks/results that exist")
    ap.add_argument("--outdir", default=None, help="default: the first table's folder")
    args = ap.parse_args(argv)
    tables = args.tables or [p for t in DEFAULT_TABLES if (p := Path("benchmarks/results") / t).exists()]
    if not tables:
        ap.error("no tables given and none in benchmarks/results")
    for p in plot_all(tables, args.outdir or Path(tables[0]).parent):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
