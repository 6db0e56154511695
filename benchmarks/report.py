"""The figures of README.md and docs/*.md, written from the results files, so that none can drift.

A document marks each generated part ``<!-- name:start -->`` ... ``<!-- name:end -->``; ``render(name)``
writes it from its results file (``RENDERERS``): the long tables of ``benchmarks/results/*.jsonl``,
``docs/demo/seeds.json`` and the demo's ``needle.json`` files, ``docs/models.json`` (the model sweep),
and the planner itself. Every measured figure says on which machine it was measured, as its results
file records it ("a machine not recorded" where it does not). ``fill(text)`` renders every region of a
document; ``scripts/render_docs.py`` writes them (``--check``: only compares), and
``tests/test_docs.py`` fails when a committed document differs from what this renders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from .harness import machine_text, versions_text

__all__ = ["DOCUMENTS", "RENDERERS", "documents", "fill", "regions", "render", "update"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "docs" / "demo"
DOCUMENTS = ("README.md", "docs/*.md")
REGION = re.compile(r"<!-- ([\w-]+):start -->\n(.*?)<!-- \1:end -->", re.S)


def _rows(name: str) -> list[dict]:
    with open(RESULTS / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _one(rows: list[dict], **kw: object) -> dict:
    hits = [r for r in rows if all(r.get(k) == v for k, v in kw.items())]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} rows match {kw}")
    return hits[0]


def _measured(rows: list[dict], command: str) -> str:
    """The line under a measured table: the command, the machine, the versions."""
    versions = versions_text(rows[0].get("versions"))
    return f"`{command}`; measured on {machine_text(rows[0].get('machine'))}" + (f"; {versions}." if versions else ".")


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _bytes(b: float) -> str:
    return f"{b / 1024:.3g} KiB" if b < 2**20 else f"{b / 2**20:.3g} MiB"


def _tokens(n: int) -> str:
    if n and n % 2**20 == 0:
        return f"{n >> 20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# ---------------------------------------------------------------------------------------- the demo
def _seeds() -> dict:
    return json.loads((DEMO / "seeds.json").read_text())


def _demo_machine(runs: list[dict]) -> str:
    m = runs[0].get("machine")
    if m:
        return machine_text(m)
    return f"{runs[0]['cpus']} CPUs (CPU model not recorded)"


def demo_summary() -> str:
    runs = _seeds()["runs"]
    ev = runs[0]["eval"]
    seeds = ", ".join(str(r["seed"]) for r in runs)
    before = " / ".join(_pct(r["accuracy_before"]) for r in runs)
    after = " / ".join(_pct(r["accuracy_after"]) for r in runs)
    cpu = [r["cpu_seconds"] for r in runs]
    return (
        f"Passkey retrieval at {_tokens(ev['seq_len'])} tokens ({ev['samples']} held-out samples), seeds {seeds}: "
        f"{before} for the short-context model, **{after}** after ring-attention fine-tuning; "
        f"{min(cpu):.0f}-{max(cpu):.0f} s of CPU time per run, measured on {_demo_machine(runs)}."
    )


def demo_seeds() -> str:
    data = _seeds()
    runs = data["runs"]
    ev = runs[0]["eval"]
    head = ["", *(f"seed {r['seed']}" for r in runs)]
    rows = [
        [f"passkey retrieval at {_tokens(ev['seq_len'])} ({ev['samples']} held-out samples), short-context model "
         f"({runs[0]['pretrain_steps']} steps)", *(_pct(r["accuracy_before"]) for r in runs)],
        [f"after ring-attention fine-tuning ({runs[0]['finetune_steps']} steps)",
         *(f"**{_pct(r['accuracy_after'])}**" for r in runs)],
        ["last logged fine-tuning loss", *(f"{r['final_loss']:.4f}" for r in runs)],
        ["pretraining / fine-tuning, seconds", *(f"{r['pretrain_seconds']:.0f} / {r['finetune_seconds']:.0f}"
                                                 for r in runs)],
        ["whole demo, CPU seconds", *(f"{r['cpu_seconds']:.0f}" for r in runs)],
        ["whole demo, wall seconds (load average at the end)",
         *(f"{r['wall_seconds']:.0f} ({r['load_average_1min_at_end']:g})" for r in runs)],
    ]  # fmt: skip
    return _table(head, rows) + f"\n\n`{data['command']}`; measured on {_demo_machine(runs)}."


def demo_heatmaps() -> str:
    res = {w: json.loads((DEMO / f"needle-{w}" / "needle.json").read_text()) for w in ("before", "after")}
    b = res["before"]
    st = b["settings"]

    def by_length(r: dict) -> str:
        return ", ".join(f"{_tokens(int(n))} {_pct(v)}" for n, v in r["summary"]["accuracy_by_length"].items())

    lengths = b["lengths"]
    return (
        f"{_tokens(lengths[0])} to {_tokens(lengths[-1])} tokens, {len(b['depths'])} depths, {st['samples']} keys per "
        f"cell, CP = {st['cp_size']} prefill. Accuracy by length, short-context model: {by_length(b)}; after "
        f"fine-tuning: {by_length(res['after'])}. Evaluation time {b['seconds']:.0f} s and "
        f"{res['after']['seconds']:.0f} s, measured on {machine_text(b.get('machine'))}."
    )


# ------------------------------------------------------------------------------------- the models
def _models() -> list[dict]:
    return json.loads((ROOT / "docs" / "models.json").read_text())


def models() -> str:
    from testkit.sweep_table import render_table

    return render_table(_models())


def models_summary() -> str:
    from testkit.sweep_table import PATHS, path_record

    records = _models()
    swept = [r for r in records if r["status"] != "skipped"]
    exact = [r for r in swept if all(path_record(r, p)["status"] == "exact" for p in PATHS)]
    refused = [r for r in swept if any(path_record(r, p)["status"] == "refused" for p in PATHS)]
    families = {r["family"] for r in exact}
    return (
        f"{len(exact)} of the {len(swept)} family/variant records the sweep ran ({len(families)} families) are "
        f"exact on every path, {len(refused)} are refused with `RingNotSupported`, none is wrong; "
        f"{len(records) - len(swept)} model types are not swept (why: in the table)."
    )


# ------------------------------------------------------------------------------ memory and planner
def memory_grid() -> str:
    rows = [json.loads(line) for line in (RESULTS / "memory.jsonl").read_text().splitlines() if line.strip()]
    main = [r for r in rows if r["config"] == "ckpt+chunked"]
    ns, ps = sorted({r["N"] for r in main}), sorted({r["P"] for r in main})
    cells = [[str(n), *(f"{(r := _one(main, N=n, P=p))['measured_mib']:.2f} ({r['planned_mib']:.2f})" for p in ps)]
             for n in ns]  # fmt: skip
    return _table(["N", *(f"P = {p}" for p in ps)], cells) + "\n\n" + _measured(main, "python -m benchmarks.memory")


def memory_variants() -> str:
    rows = [json.loads(line) for line in (RESULTS / "memory.jsonl").read_text().splitlines() if line.strip()]
    n, p = 8192, 2
    sel = [r for r in rows if r["N"] == n and r["P"] == p]
    head = ["configuration", "measured MiB", "planned MiB", "measured / planned", "RSS growth MiB",
            "host (offloaded) MiB"]  # fmt: skip
    cells = [[r["config"], f"{r['measured_mib']:.2f}", f"{r['planned_mib']:.2f}", f"{r['ratio']:.3f}",
              f"{r['rss_mib']:.2f}", f"{r['host_mib']:.2f}"] for r in sel]  # fmt: skip
    return _table(head, cells) + "\n\n" + _measured(sel, "python -m benchmarks.memory")


def planner_grid() -> str:
    from .memory import planner_grid as grid

    return grid()


def planner_longest() -> str:
    from .memory import planner_longest as longest

    return longest()


# ------------------------------------------------------------------------------------------ recipes
RECIPES = {  # what each packaged recipe trains, in words; its memory is the recipe's own memory_gb
    "tiny-cpu-demo": ("tiny Llama, full fine-tune", "4 CPU processes", "4 x 1"),
    "llama-3.1-8b-128k": ("Llama-3.1-8B, LoRA r16, FSDP2", "8 x 80 GB", "8 x 1"),
    "qwen2.5-7b-256k": ("Qwen2.5-7B, LoRA r16, YaRN x8, FSDP2", "8 x 80 GB", "8 x 1"),
    "gpt-oss-20b-128k": ("GPT-OSS-20B (MoE, 128-token windows, sinks), LoRA r16 on attention, router loss on, FSDP2",
                         "8 x 80 GB", "8 x 1"),
    "gemma-3-27b-128k": ("Gemma 3 27B language model (1K-token windows on 5 of 6 layers), LoRA r16, FSDP2",
                         "8 x 80 GB", "8 x 1"),
    "llama-3.1-8b-1m": ("Llama-3.1-8B, LoRA r16, YaRN x8, offload, tiled MLP, FSDP2", "2 nodes x 8 x 80 GB",
                        "8 x 2 (ring: `ulysses_size: 1`, the planner's choice)"),
    "qwen3.5-9b-1m": ("Qwen3.5-9B's language model (no vision tower), LoRA r16 on attention, MLP and Gated DeltaNet "
                      "projections, YaRN x4, offload, tiled MLP, FSDP2", "8 x 80 GB", "8 x 1"),
}  # fmt: skip


def recipes() -> str:
    import yaml

    cells = []
    for name, (model, gpus, grid) in RECIPES.items():
        recipe = yaml.safe_load((ROOT / "hf_ring" / "recipes" / f"{name}.yaml").read_text())
        data, mem = recipe["data"], recipe["memory_gb"]
        n = max([data.get("seq_len", 0), *(stage["seq_len"] for stage in data.get("stages", []))])
        gib = f"{mem['total']:.2f}" + (f" (+{mem['host']:.0f} host)" if mem.get("host") else "")
        cells.append([f"`{name}`", model, _tokens(n), gpus, grid, gib])
    head = ["recipe", "model", "tokens per sequence", "GPUs", "CP x DP", "planner: GiB per GPU"]
    return _table(head, cells) + (
        "\n\nThe memory column is `hf-ring plan RECIPE` as each recipe records it in `memory_gb` (a test fails when a "
        "recipe drifts from the planner)."
    )


# --------------------------------------------------------------------------------------- attention
def attention_speed() -> str:
    rows = _rows("attention")
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
        _table(head, cells) + f"\n\nAgainst torch's own ring on the same shards: t_torch / t_hf_ring "
        f"{min(vs):.2f}-{max(vs):.2f}. Other processes used at most {load:.1%} of the machine. "
        + _measured(rows, "python -m benchmarks.bench_attention --wait-idle 120")
    )


def training_step() -> str:
    rows = _rows("model")
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
        _table(head, cells) + f"\n\nTokens per second; P x peak / peak(CP = 1) = {min(scale):.2f}-{max(scale):.2f}. "
        + _measured(rows, "python -m benchmarks.bench_model --wait-idle 120")
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
    rows = _rows("mixers")
    cells = []
    for name, label in MIXER_NAMES.items():
        for n in sorted({r["N"] for r in rows if r["x"] == name and r["name"] == "efficiency"}):
            eff = _one(rows, x=name, N=n, name="efficiency", metric="t_one/(P*t_rank)(cpu)")["median"]
            sent = _one(rows, x=name, N=n, name="comm_bytes", provider="hf_ring", metric="bytes_sent_per_rank.total")
            a2a = _one(rows, x=name, N=n, name="comm_bytes", provider="all_to_all")
            cells.append([label, _tokens(n), f"{eff:.2f}", _bytes(sent["median"]), _bytes(a2a["median"])])
    head = ["mixer", "N", "efficiency (CPU)", "bytes sent per rank per layer", "a head-parallel all-to-all would send"]
    return _table(head, cells) + "\n\n" + _measured(rows, "python -m benchmarks.bench_mixers --max-foreign 1")


def windows() -> str:
    rows = _rows("windows")
    ws = sorted({r["x"] for r in rows if r["name"] == "fwd_bwd_cpu"})
    n = _one(rows, name="fwd_bwd_cpu", provider="cp_border", x=ws[0])["N"]
    big = sorted({r["N"] for r in rows if r["name"] == "bytes_sent"})
    cells = []
    for w in ws:
        border = {_one(rows, name="bytes_sent", provider="border", x=w, N=m)["median"] for m in big[1:]}
        ring = " / ".join(_bytes(_one(rows, name="bytes_sent", provider="ring", x=w, N=m)["median"]) for m in big[::2])
        cells.append([str(w), f"{_one(rows, name='fwd_bwd_cpu', provider='cp_border', x=w)['median']:.2f}",
                      f"{_one(rows, name='fwd_bwd_cpu', provider='one_process_N_over_P', x=w)['median']:.2f}",
                      " / ".join(sorted(_bytes(b) for b in border)), ring])  # fmt: skip
    head = ["W", f"CPU s, busiest of 4 ranks (N = {_tokens(n)})", "CPU s, one process over N / 4",
            f"sent per rank per layer, border route (N >= {_tokens(big[1])})",
            f"ring route (N = {' / '.join(_tokens(m) for m in big[::2])})"]  # fmt: skip
    return _table(head, cells) + "\n\n" + _measured(rows, "python -m benchmarks.bench_windows")


def packed() -> str:
    rows, tput = _rows("packed"), _rows("packed_throughput")
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
    table = _table(["128K-token windows (median of 20)", *(f"P = {p}" for p in ps)], cells)
    speed = "; ".join(
        f"{mix}: " + " / ".join(f"{_one(tput, x=mix, provider=prov)['median'] / 1e3:.2f}K"
                                for prov in ("per_document", "zigzag", "padded_rows"))
        for mix in mixes
    )  # fmt: skip
    return (
        table + "\n\n" + _measured(rows, "python -m benchmarks.bench_packed") + "\n\nAttention forward + backward "
        f"on 2 ranks, 8K-token windows, tokens/s per document / global zigzag / padded rows: {speed}. "
        + _measured(tput, "python -m benchmarks.bench_packed --throughput")
    )


def ulysses() -> str:
    rows = _rows("ulysses")
    ns = sorted({r["N"] for r in rows})
    provs = ("ring", "hybrid_U2", "ulysses")
    cells = [[str(n), *(f"{_one(rows, name='fwd_bwd', provider=pr, N=n)['median']:.2f} s" for pr in provs),
              " / ".join(_bytes(_one(rows, name="comm_bytes", provider=pr, N=n)["median"]) for pr in provs)]
             for n in ns]  # fmt: skip
    p = rows[0]["P"]
    head = ["N", "ring (U=1)", "U=2 x R=2", f"Ulysses (U={p})", "bytes sent per rank (ring / hybrid / Ulysses)"]
    return _table(head, cells) + "\n\n" + _measured(rows, "python -m benchmarks.bench_ulysses")


def gptoss() -> str:
    rows = _rows("gptoss")
    ratios = [r for r in rows if r["name"] == "cpu_ratio"]
    ns = sorted({r["N"] for r in ratios})
    parts = []
    for p in sorted({r["P"] for r in ratios}):
        parts.append(" / ".join(f"{_one(ratios, P=p, N=n)['median']:.2f}" for n in ns) + f" at P = {p}")
    return (
        f"CPU seconds of the busiest rank over one process's, N = {' / '.join(_tokens(n) for n in ns)}: "
        f"{'; '.join(parts)} (1 / P is perfect division). "
        + _measured(rows, "python -m benchmarks.bench_gptoss --Ns 8192 16384 --Ps 2 4")
    )


RENDERERS: dict[str, Callable[[], str]] = {
    "demo-summary": demo_summary,
    "demo-seeds": demo_seeds,
    "demo-heatmaps": demo_heatmaps,
    "models": models,
    "models-summary": models_summary,
    "recipes": recipes,
    "memory-grid": memory_grid,
    "memory-variants": memory_variants,
    "planner-grid": planner_grid,
    "planner-longest": planner_longest,
    "attention-speed": attention_speed,
    "training-step": training_step,
    "mixers": mixers,
    "windows": windows,
    "packed": packed,
    "ulysses": ulysses,
    "gptoss": gptoss,
}


def render(name: str) -> str:
    """The text of region ``name`` (no markers)."""
    if name not in RENDERERS:
        raise KeyError(f"no renderer for region {name!r}; known: {', '.join(RENDERERS)}")
    return RENDERERS[name]().strip() + "\n"


def regions(text: str) -> list[str]:
    """The region names marked in ``text``, in order."""
    return [m.group(1) for m in REGION.finditer(text)]


def fill(text: str, cache: dict[str, str] | None = None) -> str:
    """``text`` with every marked region rendered (``cache``: regions rendered already)."""
    cache = {} if cache is None else cache

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in cache:
            cache[name] = render(name)
        return f"<!-- {name}:start -->\n{cache[name]}<!-- {name}:end -->"

    return REGION.sub(one, text)


def documents() -> list[Path]:
    """README.md and docs/*.md."""
    return sorted(p for pattern in DOCUMENTS for p in ROOT.glob(pattern))


def update(check: bool = False) -> list[Path]:
    """Render every region of every document; write the ones that change (``check``: write none).
    Returns the documents that were (or would be) changed."""
    cache: dict[str, str] = {}
    changed = []
    for path in documents():
        text = path.read_text()
        new = fill(text, cache)
        if new != text:
            changed.append(path)
            if not check:
                path.write_text(new)
    return changed
