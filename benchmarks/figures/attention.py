"""Figures of the attention benchmark (``benchmarks.bench_attention``, ``attention.jsonl``): efficiency,
hf_ring against torch's ring, times, load balance, hidden communication, memory per rank."""

from __future__ import annotations

from pathlib import Path

from .style import COLORS, finish, log2x, p_values, plt, select, series, subtitle

__all__ = ["figures"]


def plot_efficiency(rows, out: Path) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
    eff = [r for r in rows if r["name"] == "efficiency"]
    for p in p_values(eff):
        series(a1, select(eff, provider="hf_ring", P=p), f"hf_ring P={p}", COLORS.get(p, None))
        series(a1, select(eff, provider="torch_ring", P=p), f"torch ring P={p}", COLORS.get(p, None), "--s")
    a1.axhline(0.97, color="red", ls=":", lw=1, label="target 0.97")
    a1.set_ylabel("t_sdpa(all threads, 1 process) / t_ring")
    a1.set_title("Efficiency (wall time, same total threads)", fontsize=11)
    ec = [r for r in rows if r["name"] == "efficiency_cpu"]
    for p in p_values(ec):
        series(a2, select(ec, provider="hf_ring", P=p), f"hf_ring P={p}", COLORS.get(p, None))
        series(a2, select(ec, provider="torch_ring", P=p), f"torch ring P={p}", COLORS.get(p, None), "--s")
    a2.axhline(1.0, color="black", lw=0.8)
    a2.set_ylabel("CPU s of 1-thread SDPA / (P x max-rank CPU s)")
    a2.set_title("Work efficiency (CPU time; no thread scaling)", fontsize=11)
    for a in (a1, a2):
        if eff:
            log2x(a, [r["x"] for r in eff])
        a.set_xlabel("total sequence length N")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle("causal, Hq=8, Hkv=2, D=64, fp32, fwd+bwd; " + subtitle(rows), fontsize=7, y=0.995, color="dimgray")
    fig.tight_layout()
    fig.savefig(out / "efficiency.png", dpi=110)
    plt.close(fig)
    return out / "efficiency.png"


def plot_vs_torch(rows, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    vs = [r for r in rows if r["name"] == "vs_torch_ring"]
    vc = [r for r in rows if r["name"] == "vs_torch_ring_cpu"]
    for p in p_values(vs):
        series(ax, select(vs, P=p), f"P={p} wall time", COLORS.get(p, None))
        series(ax, select(vc, P=p), f"P={p} main-thread CPU time", COLORS.get(p, None), "--s")
    ax.axhline(1.10, color="red", ls=":", lw=1, label="target 1.10")
    ax.axhline(1.0, color="black", lw=0.8)
    if vs:
        log2x(ax, [r["x"] for r in vs])
    ax.set_xlabel("total sequence length N")
    ax.set_ylabel("t_torch_ring / t_hf_ring  (> 1: hf_ring faster)")
    return finish(fig, ax, rows, "hf_ring vs torch's ring on the same zigzag shards", out / "vs_torch_ring.png")


def plot_times(rows, out: Path) -> Path:
    t = [r for r in rows if r["name"] == "fwd_bwd"]
    ps = p_values(t)
    fig, axes = plt.subplots(1, len(ps), figsize=(4.2 * len(ps), 4.2), squeeze=False, sharey=True)
    styles = {"sdpa": ("k", "-o"), "sdpa_1thread": ("gray", ":o"), "hf_ring": ("tab:blue", "-s"),
              "torch_ring": ("tab:red", "--^"), "hf_ring_contiguous": ("tab:purple", "-.v"),
              "hf_ring_nocomm": ("tab:green", ":x")}  # fmt: skip
    for ax, p in zip(axes[0], ps):
        for prov, (c, st) in styles.items():
            series(ax, select(t, provider=prov, P=p), prov, c, st)
        log2x(ax, [r["x"] for r in t])
        ax.set_yscale("log")
        ax.set_xlabel("N")
        th = select(t, provider="hf_ring", P=p)
        ax.set_title(f"P={p}, {th[0]['threads'] if th else '?'} thread(s)/rank", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fwd+bwd seconds (max over ranks)")
    fig.suptitle("fwd+bwd wall time; " + subtitle(rows), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "times.png", dpi=110)
    plt.close(fig)
    return out / "times.png"


def plot_load_balance(rows, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    lb = [r for r in rows if r["name"] == "load_balance"]
    for p in p_values(lb):
        c = COLORS.get(p, None)
        series(ax, select(lb, provider="hf_ring", P=p), f"zigzag P={p}", c)
        series(ax, select(lb, provider="hf_ring_contiguous", P=p), f"contiguous P={p}", c, "--s")
        ax.axhline(2 * p / (p + 1), color=c, ls=":", lw=1, label=f"2P/(P+1) = {2 * p / (p + 1):.2f}")
    ax.axhline(1.03, color="red", ls=":", lw=1, label="target 1.03 (zigzag)")
    if lb:
        log2x(ax, [r["x"] for r in lb])
    ax.set_xlabel("total sequence length N")
    ax.set_ylabel("max / mean over ranks of per-rank compute")
    return finish(fig, ax, rows, "Load balance: zigzag vs contiguous (main-thread CPU s)", out / "load_balance.png")


def plot_comm(rows, out: Path) -> Path:
    cm = [r for r in rows if r["name"] == "comm"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
    for p in p_values(cm):
        c = COLORS.get(p, None)
        series(a1, select(cm, metric="hidden_fraction", P=p), f"P={p}: 1-(t_ring-t_nocomm)/t_comm_alone", c)
        series(a1, select(cm, metric="hidden_fraction_wait", P=p), f"P={p}: 1-wait/t_comm_alone", c, "--s")
        series(a2, select(cm, metric="comm_alone_fraction_of_t_ring", P=p), f"P={p}: t_comm_alone/t_ring", c, "-o")
        series(a2, select(cm, metric="exposed_fraction_of_t_ring", P=p), f"P={p}: (t_ring-t_nocomm)/t_ring", c, "--^")
    a1.axhline(0.95, color="red", ls=":", lw=1, label="target 0.95")
    a1.axhline(1.0, color="black", lw=0.8)
    a1.axhline(0.0, color="black", lw=0.5)
    a1.set_ylabel("hidden fraction of communication")
    a2.set_ylabel("fraction of the ring's fwd+bwd time")
    a2.axhline(0.0, color="black", lw=0.8)
    for a in (a1, a2):
        if cm:
            log2x(a, [r["x"] for r in cm])
        a.set_xlabel("total sequence length N")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    a1.set_title("Communication hidden behind compute", fontsize=11)
    a2.set_title("What there is to hide vs what shows", fontsize=11)
    fig.suptitle(subtitle(rows), fontsize=7, y=0.995, color="dimgray")
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
        series(ax, hr, f"hf_ring N={n}", c)
        series(ax, select(mem, provider="torch_ring", N=n), f"torch ring N={n}", c, "--^")
        base = [r for r in hr if r["P"] == 1]
        if base:
            ps = [r["P"] for r in hr]
            ax.plot(ps, [1.1 * base[0]["median"] / p for p in ps], ls=":", color=c, lw=1,
                    label=f"1.1 x peak(P=1)/P, N={n}")  # fmt: skip
        sd = select(mem, provider="sdpa", N=n)
        if sd:
            ax.scatter([1], [sd[0]["median"]], marker="*", s=80, color=c, zorder=5, label=f"SDPA N={n}")
    if mem:
        log2x(ax, [r["x"] for r in mem])
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("peak RSS growth per rank over one fwd+bwd (MiB)")
    return finish(
        fig, ax, rows, "Peak memory per rank vs P (excludes q, k, v, dout)", out / "attention_memory.png", outside=True
    )


def figures(rows: list[dict], out: Path) -> list[Path]:
    """The six figures of ``attention.jsonl`` rows in ``out``; [] without them."""
    if not select(rows, name="fwd_bwd"):
        return []
    out.mkdir(parents=True, exist_ok=True)
    plots = (plot_efficiency, plot_vs_torch, plot_times, plot_load_balance, plot_comm, plot_memory)
    return [f(rows, out) for f in plots]
