"""What things cost in time, as the documents show it: the attention op against SDPA and torch's ring,
the training step, the hybrid models' token mixers, sliding windows, packed documents, ring against
Ulysses, the GPT-OSS-shaped model (docs/performance.md); soft-capping on CPU and the batch check
(docs/transformers.md); sealing and checking checkpoints (docs/trainer.md). One function per region,
each from its benchmark's long table (``benchmarks/results/*.jsonl``), ending with the command that
wrote the rows and the machine they were measured on; ``benchmarks.report`` puts them in the regions.
"""

from __future__ import annotations

import math

from .harness import markdown_table as table
from .harness import measured_line, one_row, read_rows, size, tokens


# --------------------------------------------------------------------------------------- attention
def attention_speed() -> str:
    rows = read_rows("attention")
    ns = sorted({r["N"] for r in rows if r["name"] == "efficiency"})

    def eff(p: int, n: int) -> str:
        return f"{one_row(rows, name='efficiency', provider='hf_ring', P=p, N=n)['median']:.2f}"

    def balance(prov: str, n: int) -> str:
        return " / ".join(f"{one_row(rows, name='load_balance', provider=prov, P=p, N=n)['median']:.3f}"
                          for p in (2, 4))

    cells = [[str(n), eff(2, n), eff(4, n), balance("hf_ring", n), balance("hf_ring_contiguous", n)] for n in ns]
    vs = [r["median"] for r in rows if r["name"] == "vs_torch_ring"]
    load = max(r["median"] for r in rows if r["metric"] == "foreign_cpu_fraction")
    head = ["N", "efficiency P = 2", "P = 4 (4 processes)", "zigzag max/mean rank time (P = 2 / 4)",
            "contiguous max/mean"]  # fmt: skip
    return (
        table(head, cells) + f"\n\nAgainst torch's own ring on the same shards: t_torch / t_hf_ring "
        f"{min(vs):.2f}-{max(vs):.2f}. Other processes used at most {load:.1%} of the machine. "
        + measured_line(rows, "python -m benchmarks.bench_attention --wait-idle 120")
    )


def training_step() -> str:
    rows = read_rows("model")
    ns = sorted({r["N"] for r in rows if r["name"] == "train_step"})

    def tps(prov: str, p: int, n: int) -> str:
        return f"{one_row(rows, name='train_step', provider=prov, metric='tokens_per_s', P=p, N=n)['median']:.0f}"

    def peak(p: int, n: int) -> str:
        row = one_row(rows, name="peak_memory", provider="hf_ring", metric="live_tensor_bytes", P=p, N=n)
        return f"{row['median']:.1f}"

    cells = [[str(n), tps("sdpa", 1, n), *(tps("hf_ring", p, n) for p in (1, 2, 4)),
              " / ".join(peak(p, n) for p in (1, 2, 4))] for n in ns]  # fmt: skip
    scale = [r["median"] for r in rows if r["name"] == "memory_scaling" and r["metric"] == "P*peak_P/peak_1"]
    head = ["N", "SDPA, 1 process", "CP = 1", "CP = 2", "CP = 4", "peak MiB per rank, CP = 1 / 2 / 4"]
    return (
        table(head, cells) + f"\n\nTokens per second; P x peak / peak(CP = 1) = {min(scale):.2f}-{max(scale):.2f}. "
        + measured_line(rows, "python -m benchmarks.bench_model --wait-idle 120")
    )


# ------------------------------------------------------------------- variants of the attention layer
MIXER_NAMES = {
    "gated_deltanet": "Gated DeltaNet",
    "short_conv": "short convolution",
    "mamba2_ssd": "Mamba2 SSD",
    "lightning": "lightning attention",
    "mamba_selective": "Mamba selective scan",
    "rg_lru": "RG-LRU",
}


def mixers() -> str:
    rows = read_rows("mixers")
    cells = []
    for name, label in MIXER_NAMES.items():
        for n in sorted({r["N"] for r in rows if r["x"] == name and r["name"] == "efficiency"}):
            eff = one_row(rows, x=name, N=n, name="efficiency", metric="t_one/(P*t_rank)(cpu)")["median"]
            sent = one_row(rows, x=name, N=n, name="comm_bytes", provider="hf_ring", metric="bytes_sent_per_rank.total")
            a2a = one_row(rows, x=name, N=n, name="comm_bytes", provider="all_to_all")
            cells.append([label, tokens(n), f"{eff:.2f}", size(sent["median"]), size(a2a["median"])])
    head = ["mixer", "N", "efficiency (CPU)", "bytes sent per rank per layer", "a head-parallel all-to-all would send"]
    return table(head, cells) + "\n\n" + measured_line(rows, "python -m benchmarks.bench_mixers --max-foreign 1")


def windows() -> str:
    rows = read_rows("windows")
    ws = sorted({r["x"] for r in rows if r["name"] == "fwd_bwd_cpu"})
    n = one_row(rows, name="fwd_bwd_cpu", provider="cp_border", x=ws[0])["N"]
    big = sorted({r["N"] for r in rows if r["name"] == "bytes_sent"})
    cells = []
    for w in ws:
        border = {one_row(rows, name="bytes_sent", provider="border", x=w, N=m)["median"] for m in big[1:]}
        ring = " / ".join(size(one_row(rows, name="bytes_sent", provider="ring", x=w, N=m)["median"]) for m in big[::2])
        cells.append([str(w), f"{one_row(rows, name='fwd_bwd_cpu', provider='cp_border', x=w)['median']:.2f}",
                      f"{one_row(rows, name='fwd_bwd_cpu', provider='one_process_N_over_P', x=w)['median']:.2f}",
                      " / ".join(sorted(size(b) for b in border)), ring])  # fmt: skip
    head = ["W", f"CPU s, busiest of 4 ranks (N = {tokens(n)})", "CPU s, one process over N / 4",
            f"sent per rank per layer, border route (N >= {tokens(big[1])})",
            f"ring route (N = {' / '.join(tokens(m) for m in big[::2])})"]  # fmt: skip
    return table(head, cells) + "\n\n" + measured_line(rows, "python -m benchmarks.bench_windows")


def packed() -> str:
    rows, tput = read_rows("packed"), read_rows("packed_throughput")
    mixes = list(dict.fromkeys(r["x"] for r in rows))
    ps = sorted({r["P"] for r in rows})

    def val(name: str, prov: str, mix: str, p: int, fmt: str) -> str:
        return format(one_row(rows, name=name, provider=prov, x=mix, P=p)["median"], fmt)

    def balance(mix: str, p: int) -> str:
        ours = val("packed_balance", "per_document", mix, p, ".3f")
        return f"**{ours}** / {val('packed_balance', 'zigzag', mix, p, '.2f')} / " + val(
            "packed_balance", "contiguous", mix, p, ".2f"
        )

    cells = [[f"max/mean attention work, {mix}: per document / global zigzag / contiguous",
              *(balance(mix, p) for p in ps)] for mix in mixes]  # fmt: skip
    for name, what in (("packed_calls", "kernel calls"), ("packed_varlen_calls", "varlen kernel calls (flash-attn)")):
        cells.append([f"{what} per rank per layer, per document", *(
            "-".join(f"{v:.0f}" for v in sorted({one_row(rows, name=name, provider="per_document", x=m, P=p)["median"]
                                                 for m in mixes})) for p in ps)])  # fmt: skip
    grid = table(["128K-token windows (median of 20)", *(f"P = {p}" for p in ps)], cells)
    speed = "; ".join(
        f"{mix}: " + " / ".join(f"{one_row(tput, x=mix, provider=prov)['median'] / 1e3:.2f}K"
                                for prov in ("per_document", "zigzag", "padded_rows"))
        for mix in mixes
    )  # fmt: skip
    return (
        grid + "\n\n" + measured_line(rows, "python -m benchmarks.bench_packed") + "\n\nAttention forward + backward "
        f"on 2 ranks, 8K-token windows, tokens/s per document / global zigzag / padded rows: {speed}. "
        + measured_line(tput, "python -m benchmarks.bench_packed --throughput")
    )


def ulysses() -> str:
    rows = read_rows("ulysses")
    ns = sorted({r["N"] for r in rows})
    provs = ("ring", "hybrid_U2", "ulysses")
    cells = [[str(n), *(f"{one_row(rows, name='fwd_bwd', provider=pr, N=n)['median']:.2f} s" for pr in provs),
              " / ".join(size(one_row(rows, name="comm_bytes", provider=pr, N=n)["median"]) for pr in provs)]
             for n in ns]  # fmt: skip
    p = rows[0]["P"]
    head = ["N", "ring (U=1)", "U=2 x R=2", f"Ulysses (U={p})", "bytes sent per rank (ring / hybrid / Ulysses)"]
    return table(head, cells) + "\n\n" + measured_line(rows, "python -m benchmarks.bench_ulysses")


def softcap() -> str:
    """What soft-capping costs on CPU: the reference kernel with the cap against the fused op without."""
    rows = read_rows("softcap")
    ratios = sorted((r for r in rows if r["metric"] == "ratio_to_fused"), key=lambda r: r["N"])
    said = " and ".join(f"{r['median']:.1f}x (N = {tokens(r['N'])})" for r in ratios)
    return (
        "On CPU a soft-capped layer runs the reference kernel: forward + backward of one layer's attention (B = 1, "
        f"Hq = 8, Hkv = 2, D = 64, fp32) takes {said} the time of torch's fused op without a cap. "
        + measured_line(rows, "python -m benchmarks.bench_softcap --N 1024 2048 --out benchmarks/results/softcap.jsonl")
    )


# ------------------------------------------------------------------------------------------- models
def gptoss() -> str:
    rows = read_rows("gptoss")
    ratios = [r for r in rows if r["name"] == "cpu_ratio"]
    ns = sorted({r["N"] for r in ratios})
    parts = []
    for p in sorted({r["P"] for r in ratios}):
        parts.append(" / ".join(f"{one_row(ratios, P=p, N=n)['median']:.2f}" for n in ns) + f" at P = {p}")
    return (
        f"CPU seconds of the busiest rank over one process's, N = {' / '.join(tokens(n) for n in ns)}: "
        f"{'; '.join(parts)} (1 / P is perfect division). "
        + measured_line(rows, "python -m benchmarks.bench_gptoss --Ns 8192 16384 --Ps 2 4")
    )


# ----------------------------------------------------------------------------- the batch, checkpoints
def batch_check() -> str:
    """What ``check_same_batch`` costs against ``shard_batch`` and an embedding lookup."""
    rows = read_rows("batch_check")

    def ms(provider: str) -> str:
        mine = sorted((r for r in rows if r["provider"] == provider and r["metric"] == "time"), key=lambda r: r["N"])
        return ", ".join(f"{1e3 * r['median']:.0f}" for r in mine)

    ns = sorted({r["N"] for r in rows if r["name"] == "batch_check"})
    return (
        f"What the batch check costs on {rows[0]['P']} gloo ranks, at {', '.join(tokens(n) for n in ns)} "
        f"tokens: {ms('check_same_batch')} ms (all of `shard_batch`, the check included: {ms('shard_batch')} ms; "
        f"looking the rank's tokens up in a 4096-wide bf16 embedding: {ms('embedding')} ms). "
        + measured_line(rows, "python -m benchmarks.bench_batch_check --out benchmarks/results/batch_check.jsonl")
    )


def checkpoints() -> str:
    """The cost of sealing a checkpoint and of checking it at resume, with and without checksums."""
    rows = read_rows("checkpoints")

    def vals(provider: str, metric: str) -> dict[int, float]:  # checkpoint MiB -> median
        return {r["x"]: r["median"] for r in rows if r["provider"] == provider and r["metric"] == metric}

    seal, seal_ratio = vals("seal", "seconds").values(), vals("seal", "ratio_to_write").values()
    inspect, inspect_sums = vals("inspect", "seconds"), vals("inspect_checksums", "seconds")
    sums = [*vals("seal_checksums", "ratio_to_write").values(), *vals("inspect_checksums", "ratio_to_write").values()]
    rate = [x * 2**20 / 1e9 / (inspect_sums[x] - inspect[x]) for x in inspect]  # hashing alone, GB/s
    sizes = sorted(inspect)
    return (
        f"Cost (one process, local disk, {sizes[0]} MiB to {sizes[-1] // 1024} GiB checkpoints, "
        "`benchmarks/results/checkpoints.jsonl`): the seal is a directory listing, one small JSON file with an "
        f"`fsync`, and two barriers: {1e3 * min(seal):.0f}-{1e3 * max(seal):.0f} ms per save, "
        f"{100 * min(seal_ratio):.1f}-{100 * max(seal_ratio):.1f}% of writing the files; the check at resume is under "
        f"{math.ceil(1e3 * max(inspect.values()))} ms. Checksums read every file once more at each save and at "
        f"resume (split over the ranks of a job): {min(sums):.1f}-{max(sums):.1f} times the time of writing the "
        f"checkpoint (SHA-256 at {min(rate):.1f}-{max(rate):.1f} GB/s per core here), hence off by default. "
        + measured_line(rows, "python -m benchmarks.bench_checkpoints")
    )
