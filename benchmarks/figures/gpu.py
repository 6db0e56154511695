"""Figures of the GPU benchmark (``benchmarks.bench_gpu``, ``gpu.jsonl``): the emulated zigzag rank
against full attention / P, the measured ring overlap threshold, and each block kernel's rate."""

from __future__ import annotations

from pathlib import Path

from .style import COLORS, finish, log2x, p_values, plt, select, series

__all__ = ["plot_gpu"]

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
        for p in p_values(frac):
            c = COLORS.get(p, None)
            series(ax, select(frac, metric=f"max_rank.vs_{base}", P=p), f"P={p}, slowest rank", c)
            series(ax, select(frac, metric=f"mean_rank.vs_{base}", P=p), f"P={p}, mean over ranks", c, ":s")
        ax.axhline(1.0, color="black", lw=0.8, label="theoretical (t_full / P)")
        log2x(ax, [r["x"] for r in frac])
        ax.set_xlabel("total sequence length N")
        ax.set_ylabel(f"(t_{base} / P) / t_rank")
        ax.set_ylim(bottom=0)
        paths.append(finish(fig, ax, frac, _gpu_title(frac, "Emulated zigzag rank vs full attention / P"),
                             out / "gpu_fraction.png", outside=True))  # fmt: skip
    if thr:
        fig, ax = plt.subplots(figsize=(7.4, 4.6))
        meas = [dict(r, T=r["N"] // r["P"]) for r in thr if r["metric"] == "tokens_per_rank"]
        links = sorted({r["provider"] for r in thr})
        ts = [r["T"] for r in meas]
        for i, link in enumerate(links):
            c = _LINK_COLORS[i % len(_LINK_COLORS)]
            for p in p_values(meas):
                pts = sorted((r for r in meas if r["provider"] == link and r["P"] == p), key=lambda r: r["T"])
                series(ax, pts, f"{link}, P={p}", c, "-" + _GPU_MARKERS.get(p, "o"), xkey="T")
            plan = [r["median"] for r in thr if r["provider"] == link and r["metric"].endswith("planner_default_flops")]
            if plan:
                ax.axhline(max(plan), color=c, ls="--", lw=1, label=f"{link}: plan() at 400 TFLOP/s")
        if ts:
            lo, hi = min(ts) / 2, max(ts) * 2
            ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="threshold = T (hidden below)")
            log2x(ax, ts)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank T = N / P")
        ax.set_ylabel("overlap threshold T* (tokens per rank)")
        paths.append(finish(fig, ax, thr, _gpu_title(thr, "Ring overlap: measured threshold vs T"),
                             out / "gpu_overlap.png", outside=True))  # fmt: skip
    if kern:  # each block kernel: a causal block and an emulated rank, TFLOP/s vs tokens per rank
        fig, ax = plt.subplots(figsize=(7.4, 4.6))
        for i, name in enumerate(sorted({r["provider"] for r in kern})):
            c = _LINK_COLORS[i % len(_LINK_COLORS)]
            series(ax, select(kern, provider=name, metric="block"), f"{name}, causal block", c)
            series(ax, select(kern, provider=name, metric="rank"), f"{name}, emulated rank", c, ":s")
        log2x(ax, [r["x"] for r in kern])
        ax.set_xlabel("tokens per rank T")
        ax.set_ylabel("TFLOP/s (fwd + bwd)")
        ax.set_ylim(bottom=0)
        paths.append(finish(fig, ax, kern, _gpu_title(kern, "Block kernels"), out / "gpu_kernels.png", outside=True))
    return paths
