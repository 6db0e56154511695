"""The measured tables of the documents, from the benchmarks' long tables (``benchmarks/results/*.jsonl``):
one function per table, each ending with the command that wrote its rows and the machine they were
measured on. ``benchmarks.report`` puts them in the documents' marked regions; the formatting helpers
(``table``, ``pct``, ``size``, ``tokens``) are shared with it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .harness import machine_text, versions_text

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def read_rows(name: str) -> list[dict]:
    with open(RESULTS / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _one(rows: list[dict], **kw: object) -> dict:
    hits = [r for r in rows if all(r.get(k) == v for k, v in kw.items())]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} rows match {kw}")
    return hits[0]


def measured_line(rows: list[dict], command: str) -> str:
    """The line under a measured table: the command, the machine, the versions."""
    versions = versions_text(rows[0].get("versions"))
    return f"`{command}`; measured on {machine_text(rows[0].get('machine'))}" + (f"; {versions}." if versions else ".")


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def pct(x: float) -> str:
    return f"{x:.0%}"


def size(b: float) -> str:
    return f"{b / 1024:.3g} KiB" if b < 2**20 else f"{b / 2**20:.3g} MiB"


def tokens(n: int) -> str:
    if n and n % 2**20 == 0:
        return f"{n >> 20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# ------------------------------------------------------------------------------------------- memory
def memory_grid() -> str:
    rows = [json.loads(line) for line in (RESULTS / "memory.jsonl").read_text().splitlines() if line.strip()]
    main = [r for r in rows if r["config"] == "ckpt+chunked"]
    ns, ps = sorted({r["N"] for r in main}), sorted({r["P"] for r in main})
    cells = [[str(n), *(f"{(r := _one(main, N=n, P=p))['measured_mib']:.2f} ({r['planned_mib']:.2f})" for p in ps)]
             for n in ns]  # fmt: skip
    return table(["N", *(f"P = {p}" for p in ps)], cells) + "\n\n" + measured_line(main, "python -m benchmarks.memory")


def memory_variants() -> str:
    rows = [json.loads(line) for line in (RESULTS / "memory.jsonl").read_text().splitlines() if line.strip()]
    n, p = 8192, 2
    plain = [r for r in rows if not r.get("tiled_layers") and (r.get("head_groups") or 1) == 1]  # tiled: their own
    sel = [r for r in plain if r["N"] == n and r["P"] == p]
    head = ["configuration", "measured MiB", "planned MiB", "measured / planned", "RSS growth MiB",
            "host (offloaded) MiB"]  # fmt: skip
    cells = [[r["config"], f"{r['measured_mib']:.2f}", f"{r['planned_mib']:.2f}", f"{r['ratio']:.3f}",
              f"{r['rss_mib']:.2f}", f"{r['host_mib']:.2f}"] for r in sel]  # fmt: skip
    return table(head, cells) + "\n\n" + measured_line(sel, "python -m benchmarks.memory")


# --------------------------------------------------------------------------------------- attention
def attention_speed() -> str:
    rows = read_rows("attention")
    ns = sorted({r["N"] for r in rows if r["name"] == "efficiency"})

    def eff(p: int, n: int) -> str:
        return f"{_one(rows, name='efficiency', provider='hf_ring', P=p, N=n)['median']:.2f}"

    def balance(prov: str, n: int) -> str:
        return " / ".join(f"{_one(rows, name='load_balance', provider=prov, P=p, N=n)['median']:.3f}" for p in (2, 4))

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
        return f"{_one(rows, name='train_step', provider=prov, metric='tokens_per_s', P=p, N=n)['median']:.0f}"

    def peak(p: int, n: int) -> str:
        row = _one(rows, name="peak_memory", provider="hf_ring", metric="live_tensor_bytes", P=p, N=n)
        return f"{row['median']:.1f}"

    cells = [[str(n), tps("sdpa", 1, n), *(tps("hf_ring", p, n) for p in (1, 2, 4)),
              " / ".join(peak(p, n) for p in (1, 2, 4))] for n in ns]  # fmt: skip
    scale = [r["median"] for r in rows if r["name"] == "memory_scaling" and r["metric"] == "P*peak_P/peak_1"]
    head = ["N", "SDPA, 1 process", "CP = 1", "CP = 2", "CP = 4", "peak MiB per rank, CP = 1 / 2 / 4"]
    return (
        table(head, cells) + f"\n\nTokens per second; P x peak / peak(CP = 1) = {min(scale):.2f}-{max(scale):.2f}. "
        + measured_line(rows, "python -m benchmarks.bench_model --wait-idle 120")
    )


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
            eff = _one(rows, x=name, N=n, name="efficiency", metric="t_one/(P*t_rank)(cpu)")["median"]
            sent = _one(rows, x=name, N=n, name="comm_bytes", provider="hf_ring", metric="bytes_sent_per_rank.total")
            a2a = _one(rows, x=name, N=n, name="comm_bytes", provider="all_to_all")
            cells.append([label, tokens(n), f"{eff:.2f}", size(sent["median"]), size(a2a["median"])])
    head = ["mixer", "N", "efficiency (CPU)", "bytes sent per rank per layer", "a head-parallel all-to-all would send"]
    return table(head, cells) + "\n\n" + measured_line(rows, "python -m benchmarks.bench_mixers --max-foreign 1")


def windows() -> str:
    rows = read_rows("windows")
    ws = sorted({r["x"] for r in rows if r["name"] == "fwd_bwd_cpu"})
    n = _one(rows, name="fwd_bwd_cpu", provider="cp_border", x=ws[0])["N"]
    big = sorted({r["N"] for r in rows if r["name"] == "bytes_sent"})
    cells = []
    for w in ws:
        border = {_one(rows, name="bytes_sent", provider="border", x=w, N=m)["median"] for m in big[1:]}
        ring = " / ".join(size(_one(rows, name="bytes_sent", provider="ring", x=w, N=m)["median"]) for m in big[::2])
        cells.append([str(w), f"{_one(rows, name='fwd_bwd_cpu', provider='cp_border', x=w)['median']:.2f}",
                      f"{_one(rows, name='fwd_bwd_cpu', provider='one_process_N_over_P', x=w)['median']:.2f}",
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
        return format(_one(rows, name=name, provider=prov, x=mix, P=p)["median"], fmt)

    def balance(mix: str, p: int) -> str:
        ours = val("packed_balance", "per_document", mix, p, ".3f")
        return f"**{ours}** / {val('packed_balance', 'zigzag', mix, p, '.2f')} / " + val(
            "packed_balance", "contiguous", mix, p, ".2f"
        )

    cells = [[f"max/mean attention work, {mix}: per document / global zigzag / contiguous",
              *(balance(mix, p) for p in ps)] for mix in mixes]  # fmt: skip
    for name, what in (("packed_calls", "kernel calls"), ("packed_varlen_calls", "varlen kernel calls (flash-attn)")):
        cells.append([f"{what} per rank per layer, per document", *(
            "-".join(f"{v:.0f}" for v in sorted({_one(rows, name=name, provider="per_document", x=m, P=p)["median"]
                                                 for m in mixes})) for p in ps)])  # fmt: skip
    grid = table(["128K-token windows (median of 20)", *(f"P = {p}" for p in ps)], cells)
    speed = "; ".join(
        f"{mix}: " + " / ".join(f"{_one(tput, x=mix, provider=prov)['median'] / 1e3:.2f}K"
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
    cells = [[str(n), *(f"{_one(rows, name='fwd_bwd', provider=pr, N=n)['median']:.2f} s" for pr in provs),
              " / ".join(size(_one(rows, name="comm_bytes", provider=pr, N=n)["median"]) for pr in provs)]
             for n in ns]  # fmt: skip
    p = rows[0]["P"]
    head = ["N", "ring (U=1)", "U=2 x R=2", f"Ulysses (U={p})", "bytes sent per rank (ring / hybrid / Ulysses)"]
    return table(head, cells) + "\n\n" + measured_line(rows, "python -m benchmarks.bench_ulysses")


def gptoss() -> str:
    rows = read_rows("gptoss")
    ratios = [r for r in rows if r["name"] == "cpu_ratio"]
    ns = sorted({r["N"] for r in ratios})
    parts = []
    for p in sorted({r["P"] for r in ratios}):
        parts.append(" / ".join(f"{_one(ratios, P=p, N=n)['median']:.2f}" for n in ns) + f" at P = {p}")
    return (
        f"CPU seconds of the busiest rank over one process's, N = {' / '.join(tokens(n) for n in ns)}: "
        f"{'; '.join(parts)} (1 / P is perfect division). "
        + measured_line(rows, "python -m benchmarks.bench_gptoss --Ns 8192 16384 --Ps 2 4")
    )


def _memory_rows() -> list[dict]:
    return read_rows("memory")


def lora_ratio() -> float:
    """Measured / planned peak of the small model's ``LoRA r16 bf16 ckpt+chunked`` variant."""
    return _one(_memory_rows(), config="LoRA r16 bf16 ckpt+chunked")["ratio"]


def memory_fit() -> str:
    """The grid's scaling in N / P and how close the planner comes, from ``memory.jsonl``."""
    rows = _memory_rows()
    main = [r for r in rows if r["config"] == "ckpt+chunked"]
    same = [_one(main, N=2048 * p, P=p) for p in (1, 2, 4)]
    halves = [_one(main, N=r["N"], P=r["P"] // 2)["measured_mib"] / r["measured_mib"] for r in main if r["P"] > 1]
    worst = max(abs(1 - r["ratio"]) for r in rows)
    worst_main = max(abs(1 - r["ratio"]) for r in main)
    where = ", ".join(f"({r['N']}, {r['P']})" for r in same)
    peaks = sorted({f"{r['measured_mib']:.1f}" for r in same})
    factor = sorted({f"{h:.2f}" for h in halves})
    return (
        f"Peak memory per rank is a function of N / P alone: {'the same ' if len(peaks) == 1 else ''}"
        f"{' / '.join(peaks)} MiB at (N, P) = {where}, and at a fixed N doubling P divides it by "
        f"{factor[0] if len(factor) == 1 else factor[0] + '-' + factor[-1]}. The planner predicts every case within "
        f"{worst:.0%} ({worst_main:.1%} for the main grid). " + measured_line(rows, "python -m benchmarks.memory")
    )


def autocast_errors() -> str:
    """The chunked loss's default chunk and its errors under bf16 autocast, from ``autocast_errors.jsonl``."""
    from hf_ring.ops.cross_entropy import LOGITS_CHUNK_BYTES, default_chunk_size

    rows = read_rows("autocast_errors")

    def err(provider: str, metric: str = "worst_param") -> float:
        return _one(rows, provider=provider, metric=metric)["median"]

    before = next(r["provider"] for r in rows if r["provider"].startswith("chunked@")).split("@")[1]
    prob = float(re.search(r"median target probability ([\d.]+)", rows[0]["note"]).group(1))  # type: ignore[union-attr]
    vocab = 128_256
    return (
        f"The chunk size defaults to {LOGITS_CHUNK_BYTES >> 20} MiB of float32 logits ({default_chunk_size(vocab)} "
        f"tokens for Llama 3's vocabulary of {vocab:,}). `python -m benchmarks.autocast_errors` measures the autocast "
        f"path on a tiny Llama that predicts its targets with median probability {prob:.2f}: "
        f"worst parameter-gradient error against float64 {err('chunked'):.3f} for the chunked loss and "
        f"{err('plain'):.3f} for transformers' loss ({err('chunked@' + before):.2f} at commit {before}, when the "
        f"recompute ran in float32 against a bf16 log-sum-exp). Logits kept in float32 in both passes would be closer "
        f"still ({err('chunked_fp32_logits'):.3f}, the head's gradient "
        f"{err('chunked', 'lm_head') / err('chunked_fp32_logits', 'lm_head'):.0f}x closer) at the price of float32 "
        "GEMMs. "
        + measured_line(rows, "python -m benchmarks.autocast_errors --out benchmarks/results/autocast_errors.jsonl")
    )
