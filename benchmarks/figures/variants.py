"""Figures of the attention variants and token mixers: sliding windows (``benchmarks.bench_windows``,
``windows.jsonl``), ring vs Ulysses (``bench_ulysses``, ``ulysses.jsonl``), packed documents
(``bench_packed``, ``packed.jsonl``) and the hybrid models' token mixers (``bench_mixers``,
``mixers.jsonl``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .style import plt, subtitle

__all__ = ["plot_mixers", "plot_packed", "plot_tiled", "plot_ulysses", "plot_windows"]


def _save(fig, path: Path) -> list[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_windows(rows: list[dict], out: Path) -> list[Path]:
    """``windows.png``: the windowed layer's CPU seconds at P ranks against one process over N / P,
    and the bytes a rank sends per layer on the border and ring routes against N; [] without them."""
    from benchmarks.bench_windows import SHAPE

    times = [r for r in rows if r["name"] == "fwd_bwd_cpu"]  # the work: wall time here is the CPU share
    sent = [r for r in rows if r["name"] == "bytes_sent"]
    if not times and not sent:
        return []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ws = sorted({r["x"] for r in times})
    for i, prov in enumerate(("cp_border", "one_process_N_over_P")):
        sel = [next(r for r in times if r["provider"] == prov and r["x"] == w) for w in ws]
        xs = [j + (i - 0.5) * 0.35 for j in range(len(ws))]
        err = [[r["median"] - r["p20"] for r in sel], [r["p80"] - r["median"] for r in sel]]
        a1.bar(xs, [r["median"] for r in sel], 0.35, label=prov, yerr=err, capsize=3)
    if times:
        a1.set_title(f"windowed layer fwd+bwd, N = {times[0]['N']}, P = {times[0]['P']}: CPU s, busiest rank",
                     fontsize=9)  # fmt: skip
    a1.set_xticks(range(len(ws)), [f"W = {w}" for w in ws])
    a1.legend(fontsize=8)
    for prov, style in (("border", "-o"), ("ring", "--s")):
        for w in sorted({r["x"] for r in sent}):
            sel = sorted((r for r in sent if r["provider"] == prov and r["x"] == w), key=lambda r: r["N"])
            a2.plot([r["N"] for r in sel], [r["median"] / 2**20 for r in sel], style, label=f"{prov}, W = {w}")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("N (tokens)")
    a2.set_title("bytes one rank sends per layer, fwd + bwd (MiB)", fontsize=10)
    a2.legend(fontsize=7)
    for ax in (a1, a2):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Hq {SHAPE['Hq']}, Hkv {SHAPE['Hkv']}, D {SHAPE['D']}, fp32, gloo, 1 thread per rank; "
                 + subtitle(times or sent), fontsize=7, color="dimgray")  # fmt: skip
    return _save(fig, out / "windows.png")


ULYSSES_LABELS = {"ring": "ring (U=1)", "hybrid_U2": "hybrid U=2 x R=2", "ulysses": "Ulysses (U=P)"}


def plot_ulysses(rows: list[dict], out: Path) -> list[Path]:
    """``ulysses.png``: the median fwd+bwd seconds per provider and N (p20..p80 bars) and the bytes a rank
    sends per layer (one P); [] without them."""
    from benchmarks.bench_ulysses import PROVIDERS, SHAPE

    times = [r for r in rows if r["name"] == "fwd_bwd"]
    sent = [r for r in rows if r["name"] == "comm_bytes"]
    if not times:
        return []
    ns = sorted({r["N"] for r in times})
    (p,) = {r["P"] for r in times}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(PROVIDERS)
    for i, name in enumerate(PROVIDERS):
        x = [j + (i - (len(PROVIDERS) - 1) / 2) * width for j in range(len(ns))]
        t = [next(r for r in times if r["provider"] == name and r["N"] == n) for n in ns]
        a1.bar(x, [r["median"] for r in t], width, label=ULYSSES_LABELS[name],
               yerr=[[r["median"] - r["p20"] for r in t], [r["p80"] - r["median"] for r in t]], capsize=3)  # fmt: skip
        b = [next(r for r in sent if r["provider"] == name and r["N"] == n) for n in ns]
        a2.bar(x, [r["median"] / 2**20 for r in b], width, label=ULYSSES_LABELS[name])
    for ax, title in ((a1, f"attention fwd+bwd per layer, P = {p} (s, slowest rank)"),
                      (a2, "bytes sent per rank per layer (MiB, planner)")):  # fmt: skip
        ax.set_xticks(range(len(ns)), [f"N = {n}" for n in ns])
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    a1.legend(fontsize=8)
    shape = f"causal, Hq {SHAPE['Hq']}, Hkv {SHAPE['Hkv']}, D {SHAPE['D']}, fp32, gloo"
    threads = f"{times[0].get('threads', 1)} thread per rank"
    fig.suptitle(f"{shape}, {threads}; {subtitle(times)}", fontsize=7, color="dimgray")
    return _save(fig, out / "ulysses.png")


def plot_packed(rows: list[dict], out: Path) -> list[Path]:
    """``packed.png``: max/mean attention work per rank of each placement of packed documents, per
    document-length mix and P; [] without them."""
    bal = [r for r in rows if r["name"] == "packed_balance"]
    if not bal:
        return []
    mixes = list(dict.fromkeys(r["x"] for r in bal))  # the benchmark's order of document-length mixes
    sizes = sorted({r["P"] for r in bal})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.6), sharey=True)
    names = ("zigzag", "contiguous", "per_document")
    for ax, p in zip(np.atleast_1d(axes), sizes):
        for i, name in enumerate(names):
            sel = [next(r for r in bal if r["P"] == p and r["x"] == m and r["provider"] == name) for m in mixes]
            x = np.arange(len(mixes)) + (i - 1) * 0.27
            ax.bar(x, [r["median"] for r in sel], 0.27, label=name,
                   yerr=[[r["median"] - r["p20"] for r in sel], [r["p80"] - r["median"] for r in sel]])
        ax.axhline(1.05, color="k", ls="--", lw=1)
        ax.set_xticks(np.arange(len(mixes)), mixes, fontsize=8)
        ax.set_title(f"P = {p}: max/mean attention work per rank")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.suptitle("from the ring schedules (no timing); " + subtitle(bal), fontsize=7, color="dimgray")
    return _save(fig, out / "packed.png")


def plot_mixers(rows: list[dict], out: Path) -> list[Path]:
    """``mixers.png``: per mixer, the efficiency against N (wall and CPU) and the bytes a rank sends per
    layer against N (hf_ring counted, all-to-all computed), P = max; [] without them."""
    rows = [r for r in rows if r["name"] in ("efficiency", "comm_bytes", "fwd_bwd", "fwd_bwd_cpu")]
    if not rows:
        return []
    names = list(dict.fromkeys(r["x"] for r in rows))
    p = max(r["P"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 6))
    for j, name in enumerate(names):
        color = f"C{j}"
        for metric, style in (("t_one/(P*t_rank)", "-o"), ("t_one/(P*t_rank)(cpu)", "--s")):
            sel = sorted((r for r in rows if r["name"] == "efficiency" and r["x"] == name and r["P"] == p
                          and r["metric"] == metric), key=lambda r: r["N"])  # fmt: skip
            if sel:
                axes[0].errorbar([r["N"] for r in sel], [r["median"] for r in sel], fmt=style, color=color,
                                 yerr=[[r["median"] - r["p20"] for r in sel], [r["p80"] - r["median"] for r in sel]],
                                 label=f"{name} ({'CPU' if 'cpu' in metric else 'wall'})", capsize=3)  # fmt: skip
        for prov, style in (("hf_ring", "-o"), ("all_to_all", ":x")):
            sel = sorted((r for r in rows if r["name"] == "comm_bytes" and r["x"] == name and r["P"] == p
                          and r["provider"] == prov and r["metric"].endswith("total")),
                         key=lambda r: r["N"])  # fmt: skip
            if sel:
                label = f"{name}: {'state passing + halo (counted)' if prov == 'hf_ring' else 'all-to-all (computed)'}"
                axes[1].plot([r["N"] for r in sel], [r["median"] / 2**20 for r in sel], style, color=color, label=label)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_title(f"efficiency t_one / (P x t_rank), P = {p}", fontsize=10)
    axes[1].set_title("bytes sent per rank per layer, fwd + bwd (MiB)", fontsize=10)
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    commits = ", ".join(dict.fromkeys(str(r["versions"].get("hf_ring_commit", "?")) for r in rows))
    fig.suptitle(f"fp32, gloo, 1 thread per rank; {subtitle(rows).rsplit(' (', 1)[0]} ({commits})",
                 fontsize=7, color="dimgray")  # fmt: skip
    return _save(fig, out / "mixers.png")


def plot_tiled(rows: list[dict], out: Path) -> list[Path]:
    """``tiled.png``: step time of head groups, tiled layers and both over the plain ring step of the same
    round (left) and the peak per rank (right), against N; [] without rows."""
    from benchmarks.bench_tiled import SHAPE

    ratio = [r for r in rows if r["name"] == "step_ratio"]
    peak = [r for r in rows if r["name"] == "peak_memory"]
    if not ratio:
        return []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for prov, style in (("base", ":"), ("head_groups", "-o"), ("tiled_layers", "-s"), ("both", "-^")):
        sel = sorted((r for r in ratio if r["provider"] == prov), key=lambda r: r["N"])
        err = [[r["median"] - r["p20"] for r in sel], [r["p80"] - r["median"] for r in sel]]
        a1.errorbar([r["N"] for r in sel], [r["median"] for r in sel], yerr=err, fmt=style, capsize=3, label=prov)
        sel = sorted((r for r in peak if r["provider"] == prov), key=lambda r: r["N"])
        a2.plot([r["N"] for r in sel], [r["median"] for r in sel], style, label=prov)
    a1.set_title("step time / plain ring step of the same round", fontsize=10)
    a2.set_title("peak MiB per rank (LiveTensorBytes)", fontsize=10)
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    a2.set_yscale("log")
    fig.suptitle(f"Llama {SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, "
                 f"{SHAPE['num_attention_heads']}/{SHAPE['num_key_value_heads']} heads, fp32, P = {ratio[0]['P']}, "
                 "checkpointing + chunked loss; " + subtitle(ratio), fontsize=7, color="dimgray")  # fmt: skip
    return _save(fig, out / "tiled.png")
