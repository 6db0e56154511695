"""Figures of the model benchmarks: the training step (``benchmarks.bench_model``, ``model.jsonl``) and
the measured peak memory against the planner (``benchmarks.bench_memory``, ``memory.jsonl``)."""

from __future__ import annotations

from pathlib import Path

from .style import COLORS, finish, log2x, p_values, plt, select, series, subtitle

__all__ = ["plot_memory_vs_planner", "plot_model"]


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
        for p in p_values(tp):
            series(a1, select(tp, provider="hf_ring", P=p), f"hf_ring CP={p}", COLORS.get(p, None))
        sd = [r for r in tp if r["provider"] == "sdpa"]
        if sd:  # measured in every P's run; the smallest P's (CP=1: the same process layout)
            series(a1, select(sd, P=min(p_values(sd))), "sdpa, 1 process, all threads", "black", "--^")
        a1.set_yscale("log")
        a1.set_ylabel("tokens / s (N / step time; max over ranks)")
        a1.set_title("Training throughput", fontsize=11)
        for p in p_values(eff):
            series(a2, select(eff, provider="hf_ring", P=p), f"CP={p}: t_sdpa / t_ring", COLORS.get(p, None))
        for p in p_values(spd):
            series(a2, select(spd, P=p), f"CP={p}: t(CP=1) / t(CP={p})", COLORS.get(p, None), "--s")
        a2.axhline(1.0, color="black", lw=0.8)
        a2.set_ylabel("ratio of step times (> 1: hf_ring CP=P faster)")
        a2.set_title("vs single-process SDPA (paired) and vs CP=1", fontsize=11)
        for a in (a1, a2):
            log2x(a, [r["x"] for r in tp])
            a.set_xlabel("sequence length N (tokens)")
            a.grid(True, alpha=0.3, which="both")
            a.legend(fontsize=7)
        fig.suptitle(label + "; " + subtitle(tp), fontsize=7, y=0.995, color="dimgray")
        fig.tight_layout()
        fig.savefig(out / "model_throughput.png", dpi=110)
        plt.close(fig)
        paths.append(out / "model_throughput.png")
    if mem:
        fig, ax = plt.subplots(figsize=(8.2, 4.6))
        live = [r for r in mem if r["metric"] == "live_tensor_bytes"]
        rss = [r for r in mem if r["metric"] == "rss_growth_step"]
        for p in p_values(mem):
            c = COLORS.get(p, None)
            series(ax, select(live, provider="hf_ring", P=p), f"hf_ring CP={p}: live tensors", c)
            series(ax, select(rss, provider="hf_ring", P=p), f"hf_ring CP={p}: RSS growth", c, ":s")
            base = select(live, provider="hf_ring", P=1)
            if p > 1 and base:
                ax.plot([r["x"] for r in base], [r["median"] / p for r in base], ls="--", lw=0.8, color=c,
                        label=f"CP=1 live tensors / {p}")  # fmt: skip
        series(ax, select(live, provider="sdpa", P=1), "sdpa, 1 process: live tensors", "black", "--^")
        log2x(ax, [r["x"] for r in mem])
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_ylabel("peak per rank during one step (MiB)")
        state = [r for r in rows if r["name"] == "peak_memory" and r["metric"] == "model_state"]
        extra = f"; + {state[0]['median']:.0f} MiB parameters and AdamW state" if state else ""
        paths.append(finish(fig, ax, mem, "Peak memory per rank of a training step" + extra,
                             out / "model_memory.png", outside=True))  # fmt: skip
    return paths


def plot_memory_vs_planner(rows: list[dict], out: Path) -> list[Path]:
    """``memory.png``: measured peak memory per rank of one training step against the planner's, vs N
    and vs N / P (``benchmarks.bench_memory`` rows, configuration ``ckpt+chunked``); [] without them."""
    main = [r for r in rows if r["name"] == "peak_memory" and r["provider"] == "ckpt+chunked"]
    if not main:
        return []
    mib = {(r["N"], r["P"], r["metric"]): r["median"] for r in main}
    main = [{"N": r["N"], "P": r["P"], "tokens_per_rank": r["N"] // r["P"], "measured_mib": r["median"],
             "planned_mib": mib[r["N"], r["P"], "planned"], "machine": r["machine"], "versions": r["versions"]}
            for r in main if r["metric"] == "measured"]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for p, marker in zip(sorted({r["P"] for r in main}), "osD^"):
        rs = sorted((r for r in main if r["P"] == p), key=lambda r: r["N"])
        ax.plot([r["N"] for r in rs], [r["measured_mib"] for r in rs], marker=marker, label=f"P={p} measured")
        ax.plot([r["N"] for r in rs], [r["planned_mib"] for r in rs], ls=":", color=ax.lines[-1].get_color(),
                label=f"P={p} planned")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="sequence length N (tokens)", ylabel="peak per rank (MiB)",
           title="peak memory per rank vs N")  # fmt: skip
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    ax = axes[1]
    for p, marker in zip(sorted({r["P"] for r in main}), "osD^"):
        rs = sorted((r for r in main if r["P"] == p), key=lambda r: r["N"])
        ax.plot([r["tokens_per_rank"] for r in rs], [r["measured_mib"] for r in rs], marker=marker, ls="",
                label=f"P={p}")  # fmt: skip
    xs = sorted({r["tokens_per_rank"] for r in main})
    by_t = {r["tokens_per_rank"]: r["planned_mib"] for r in main}
    ax.plot(xs, [by_t[x] for x in xs], color="gray", ls=":", label="planner")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank N/P", ylabel="peak per rank (MiB)",
           title="the same points against N/P")  # fmt: skip
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.suptitle("one training step, 4-layer Llama (hidden 64), ring attention, checkpointing + chunked loss, fp32; "
                 + subtitle(main), fontsize=8)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)
    plt.close(fig)
    return [out / "memory.png"]
