"""Head groups, tiled layers and eight million tokens, as docs/memory.md shows them (issue 38):
the memory benchmark's tiled cases against the planner (``memory.jsonl``, ``benchmarks.bench_memory``), the
speed ratios (``tiled.jsonl``, ``benchmarks.bench_tiled``), and the planner's 8M-token recipes, the longest
sequences next to published ones, Llama-3.1-70B on 32 GPUs and Qwen3.5-9B on 8. The rows are read by
``harness.read_rows``; ``benchmarks.report`` puts each renderer's text in its marked region.
"""

from __future__ import annotations

from dataclasses import replace

from .harness import markdown_table as table
from .harness import measured_line, one_row, read_rows, tokens
from .report_memory import MEMORY, tiled

GiB = 2**30
LLAMA = "Llama-3.1-8B"
RECIPES = ("llama-3.1-8b-8m-lora", "llama-3.1-8b-8m-full")


def tiled_memory() -> str:
    """Measured (planned) peaks per rank with head groups and tiled layers: the grid, then the variants."""
    rows = [r for r in read_rows("memory") if tiled(r)]
    main = [r for r in rows if r["provider"] == "tiled+groups"]

    def mib(rs: list[dict], config: str, n: int, p: int, metric: str = "measured") -> float:
        return one_row(rs, provider=config, N=n, P=p, metric=metric)["median"]

    ns, ps = sorted({r["N"] for r in main}), sorted({r["P"] for r in main})
    cells = [[str(n), *(f"{mib(main, 'tiled+groups', n, p):.2f} ({mib(main, 'tiled+groups', n, p, 'planned'):.2f})"
                        for p in ps)] for n in ns]  # fmt: skip
    grid = table(["N", *(f"P = {p}" for p in ps)], cells)
    var = [r for r in rows if r["provider"] != "tiled+groups"]
    head = ["configuration (N = 8192, P = 2)", "measured MiB", "planned MiB", "measured / planned",
            "host (offloaded) MiB", "planned host MiB"]  # fmt: skip
    metrics = (("measured", ".2f"), ("planned", ".2f"), ("measured/planned", ".3f"), ("host", ".2f"),
               ("planned_host", ".2f"))  # fmt: skip
    vcells = [[c, *(format(mib(var, c, 8192, 2, metric), fmt) for metric, fmt in metrics)]
              for c in dict.fromkeys(r["provider"] for r in var)]  # fmt: skip
    worst = max(abs(1 - r["median"]) for r in rows if r["metric"] == "measured/planned")
    closing = f"Every case within {worst:.1%} of the planner. " + measured_line(rows, MEMORY)
    return "\n\n".join([grid, table(head, vcells), closing])


def tiled_speed() -> str:
    """Step time of each option over the plain ring step of the same round, and the peaks, from ``tiled.jsonl``."""
    from benchmarks.bench_tiled import SHAPE

    rows = read_rows("tiled")
    ns = sorted({r["N"] for r in rows})
    names = ("head_groups", "tiled_layers", "both")

    def ratio(name: str, n: int) -> str:
        r = one_row(rows, name="step_ratio", provider=name, N=n)
        return f"{r['median']:.2f} ({r['p20']:.2f}-{r['p80']:.2f})"

    def peak(name: str, n: int) -> float:
        return one_row(rows, name="peak_memory", provider=name, N=n)["median"]

    cells = [[tokens(n), f"{one_row(rows, name='step_time', provider='base', N=n)['median']:.1f}",
              *(ratio(k, n) for k in names), f"{peak('base', n):.0f} / {peak('both', n):.0f}"] for n in ns]  # fmt: skip
    head = ["N", "plain ring step, s", "head groups", "tiled layers", "both", "peak MiB per rank, plain / both"]
    loss = max(r["median"] for r in rows if r["name"] == "loss_difference")
    return (
        table(head, cells) + f"\n\nA {SHAPE['num_hidden_layers']}-layer Llama (hidden {SHAPE['hidden_size']}, "
        f"{SHAPE['num_attention_heads']}/{SHAPE['num_key_value_heads']} heads of 64, fp32) at P = 2, checkpointing and "
        "the chunked loss on, 2 head groups, tiles of 2048 tokens; step time over the plain ring step of the same "
        f"round, median (p20-p80). The losses agree within {loss:.0e}. "
        + measured_line(rows, "python -m benchmarks.bench_tiled")
    )


# ------------------------------------------------------------------------------------------ planned
def _recipe_plans() -> list:
    from hf_ring.recipes import recipe_plan

    return [(name, recipe_plan(name)) for name in RECIPES]


def eight_million() -> str:
    """The 8M-token recipes as the planner sees them: memory per GPU, host per node, the step estimate."""
    cells = []
    for name, p in _recipe_plans():
        t = p.time
        cells.append([
            f"`{name}`", f"{p.seq_len:,}", f"{p.peak / GiB:.1f} of {p.gpu_bytes / GiB:.0f}", p.peak_phase,
            f"{p.host_per_rank / GiB:.0f} / {p.host_per_node / GiB:,.0f}", f"{t.total_s / 3600:.1f} h",
            f"{t.tokens_per_s * p.gpus:,.0f}", f"{t.mfu:.0%}",
        ])  # fmt: skip
    head = ["recipe", "tokens", "GiB per GPU (peak)", "peak phase", "host GiB per GPU / per node",
            "step (estimate)", "tokens/s per node (estimate)", "MFU (estimate)"]  # fmt: skip
    return table(head, cells) + (
        "\n\n`hf-ring plan RECIPE` (8 GPUs of 80 GiB, CP = 8, FSDP, bf16, checkpointing with offload of every other "
        "layer's input, tiles of 8192 tokens, 8 head groups; no runtime reserve: a recipe's figures; the host memory "
        "checked against a node's 2 TB, 1,862 GiB). The step time is an estimate: default kernel "
        "rates on H100 (attention 55% of the bf16 peak with flash-attn 3), not measured; at 8M tokens attention is "
        "more than 99% of the FLOPs. These recipes have not been run on GPUs."
    )


def _longest(model: str, gpus: int, **kw: object) -> int:
    from hf_ring.planner import PlanSettings, max_seq_len, model_shape

    return max_seq_len(model_shape(model), PlanSettings(seq_len=0, gpus=gpus, sharding="fsdp", offload=True, **kw))


def _m(n: int) -> str:
    return f"{n / 2**20:.2f}M"


def eight_million_anchors() -> str:
    """The issue's table: longest sequence on 8 x 80 GB for Llama-3.1-8B, published systems and hf_ring."""
    new = dict(tiled_layers=8192, head_groups=8, offload_every=2, host_gib=1862)
    every = dict(tiled_layers=8192, head_groups=8, host_gib=1862)
    old = dict(tiled_mlp=8192)
    lora_old, full_old = (_longest(LLAMA, 8, mode=m, **old) for m in ("lora", "full"))
    lora_new, full_new = (_longest(LLAMA, 8, mode=m, **new) for m in ("lora", "full"))
    lora_all, full_all = (_longest(LLAMA, 8, mode=m, **every) for m in ("lora", "full"))
    rows = [
        ["UPipe (arXiv 2602.21196)", "Llama3-8B, full", "5M, measured",
         "head-wise chunked Ulysses, FA3, offload, tiled MLP"],
        ["ALST (arXiv 2506.13996)", "Llama-3.1-8B, full", "3.7-3.8M, measured", "Ulysses, tiled MLP and loss, "
         "checkpoint offload"],
        ["hf_ring before (planner)", f"{LLAMA}, LoRA / full", f"{_m(lora_old)} / {_m(full_old)}",
         "ring, offload, tiled MLP (8K)"],
        ["hf_ring now (planner)", f"{LLAMA}, LoRA / full", f"{_m(lora_new)} / {_m(full_new)}",
         "ring, tiled layers (8K), 8 head groups, offload of every other layer's input; the recipes: 8M "
         "(8,388,608)"],
        ["hf_ring now, every layer's input offloaded (planner)", f"{LLAMA}, LoRA / full",
         f"{_m(lora_all)} / {_m(full_all)}", "the same with `offload_every: 1`: the host memory is the limit"],
    ]  # fmt: skip
    return table(["system", "model, mode", "longest sequence on 8 x 80 GB", "how"], rows) + (
        "\n\nThe planner's rows are `hf-ring plan Llama-3.1-8B --max-len --gpus 8 --sharding fsdp --offload` with "
        "`--tiled-mlp 8K` (before) or `--tiled-layers 8K --head-groups 8 --offload-every 2 --host-mem 1862` (now; "
        "the host memory of a node with 2 TB), `--mode full` for full fine-tuning. The published rows are "
        "measured on GPUs; hf_ring's are planned, each term measured on CPU at small scale."
    )


def eight_million_more() -> str:
    """Llama-3.1-70B on 32 GPUs (against ALST's 4M) and Qwen3.5-9B (hybrid) on 8, as the planner sees them."""
    from hf_ring.planner import PlanSettings, model_shape, plan

    cases = [
        ("Llama-3.1-70B", 32, "full", dict(tiled_mlp=8192), "ring, offload, tiled MLP (before)"),
        ("Llama-3.1-70B", 32, "full", dict(tiled_layers=8192, head_groups=4, offload_every=2, host_gib=1862),
         "+ tiled layers, 4 head groups, offload of every other layer's input, 2 TB host per node"),
        ("Qwen/Qwen3.5-9B", 8, "lora", dict(tiled_mlp=8192), "offload, tiled MLP"),
        ("Qwen/Qwen3.5-9B", 8, "lora", dict(tiled_mlp=8192, head_groups=4), "+ 4 head groups"),
        ("Qwen/Qwen3.5-9B", 8, "full", dict(tiled_mlp=8192, head_groups=4), "full FT, 4 head groups"),
    ]  # fmt: skip
    cells = []
    for model, gpus, mode, kw, what in cases:
        n = _longest(model, gpus, mode=mode, **kw)
        p = plan(model_shape(model), replace(PlanSettings(seq_len=n, gpus=gpus, sharding="fsdp", offload=True,
                                                          mode=mode), **kw))  # fmt: skip
        cells.append([model.split("/")[-1], f"{gpus} ({p.cp})", mode, what, f"{_m(n)} ({n:,})", p.peak_phase,
                      f"{p.host_per_node / GiB:,.0f}"])  # fmt: skip
    head = ["model", "GPUs (CP)", "mode", "setup", "longest (planner)", "peak phase", "host GiB per node"]
    return table(head, cells) + (
        "\n\nALST reports 4M tokens for Llama-3.1-70B on 32 H100s. Qwen3.5-9B is limited by its 24 Gated DeltaNet "
        "layers, whose backward working set the tiled layers do not cover (they compute Llama, Qwen2, Qwen3 and "
        "Mistral layers): head groups shrink only its 8 attention layers."
    )
