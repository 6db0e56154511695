"""The figures of README.md and docs/*.md, written from the results files, so that none can drift.

A document marks each generated part ``<!-- name:start -->`` ... ``<!-- name:end -->``; ``render(name)``
writes it from its results file (``RENDERERS``, one function per region, split by what it shows):
the long tables of ``benchmarks/results/*.jsonl`` (what things cost in time: ``benchmarks.report_speed``;
memory and the planner's figures: ``benchmarks.report_memory``; head groups, tiled layers and the 8M-token
recipes: ``benchmarks.report_tiled``; vision-language models: ``benchmarks.report_multimodal``),
``docs/demo/seeds.json`` and the demo's ``needle.json`` files, ``docs/models.json`` (the model sweep) and
the recipes' ``memory_gb`` (here). Every measured figure says
on which machine it was measured, as its results file records it ("a machine not recorded" where it does
not). ``fill(text)`` renders every region of a document; ``scripts/render_docs.py`` writes them
(``--check``: only compares), and ``tests/test_docs.py`` fails when a committed document differs from
what this renders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from . import report_memory as memory
from . import report_multimodal as multimodal
from . import report_speed as speed
from . import report_tiled as tiled
from .harness import machine_text, pct, tokens
from .harness import markdown_table as table

__all__ = ["DOCUMENTS", "RENDERERS", "documents", "fill", "regions", "render", "update"]

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "docs" / "demo"
DOCUMENTS = ("README.md", "docs/*.md")
REGION = re.compile(r"<!-- ([\w-]+):start -->\n(.*?)<!-- \1:end -->", re.S)


# ---------------------------------------------------------------------------------------- the demo
def _seeds() -> dict:
    return json.loads((DEMO / "seeds.json").read_text())


def _demo_machine(runs: list[dict]) -> str:
    m = runs[0].get("machine")
    if m:
        return machine_text(m)
    return f"{runs[0]['cpus']} CPUs (CPU model not recorded)"


SPLIT = ("startup", "pretraining", "evaluations", "finetuning", "other")  # a run's split, in the demo's clock


def _baseline() -> dict | None:
    """The demo as it was before it was made faster, run on the same machine (``docs/demo/baseline.json``)."""
    path = DEMO / "baseline.json"
    return json.loads(path.read_text()) if path.exists() else None


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


def demo_summary() -> str:
    runs = _seeds()["runs"]
    ev = runs[0]["eval"]
    seeds = ", ".join(str(r["seed"]) for r in runs)
    before = " / ".join(pct(r["accuracy_before"]) for r in runs)
    after = " / ".join(pct(r["accuracy_after"]) for r in runs)
    load = max(r["load_average_1min"]["setup"] for r in runs)
    text = (
        f"Passkey retrieval at {tokens(ev['seq_len'])} tokens ({ev['samples']} held-out samples), seeds {seeds}: "
        f"{before} for the short-context model, **{after}** after ring-attention fine-tuning; "
        f"{_span([r['wall_seconds'] for r in runs])} s per run (load average at most {load:g} at the start; "
        f"{_span([r['cpu_seconds'] for r in runs])} s of CPU time), measured on {_demo_machine(runs)}."
    )
    base = _baseline()
    if base and base.get("other_machine"):  # the same demo, seeds and held-out samples on two CPUs
        here, there = base["runs"], base["other_machine"]["runs"]
        mine, theirs = (" / ".join(pct(r["accuracy_before"]) for r in rs) for rs in (here, there))
        text += (
            f" The short-context model's accuracy varies with the CPU's floating-point kernels: the earlier demo's "
            f"({here[0]['eval']['samples']} held-out samples) was {mine} on {_demo_machine(here)} and {theirs} on "
            f"{_demo_machine(there)}."
        )
    return text


def _split_row(label: str, runs: list[dict], clock: str) -> list[str]:
    return [label, *("/".join(f"{r['split'][clock][k]:.0f}" for k in SPLIT) for r in runs)]


def demo_seeds() -> str:
    data = _seeds()
    runs = data["runs"]
    ev = runs[0]["eval"]
    head = ["", *(f"seed {r['seed']}" for r in runs)]
    rows = [
        [f"passkey retrieval at {tokens(ev['seq_len'])} ({ev['samples']} held-out samples), short-context model "
         f"({runs[0]['pretrain_steps']} steps)", *(pct(r["accuracy_before"]) for r in runs)],
        [f"after ring-attention fine-tuning ({runs[0]['finetune_steps']} steps)",
         *(f"**{pct(r['accuracy_after'])}**" for r in runs)],
        ["last logged fine-tuning loss", *(f"{r['final_loss']:.4f}" for r in runs)],
        ["whole demo, wall seconds (load average at the start, at the end)",
         *(f"{r['wall_seconds']:.0f} ({r['load_average_1min']['setup']:g}, {r['load_average_1min']['finetune']:g})"
           for r in runs)],
        ["whole demo, CPU seconds", *(f"{r['cpu_seconds']:.0f}" for r in runs)],
        _split_row("start-up/pretraining/evaluations/fine-tuning/other, wall seconds", runs, "wall_seconds"),
        _split_row("the same, CPU seconds", runs, "cpu_seconds"),
        ["set-up (`scripts/setup_env.sh`, not in the demo's time), wall seconds",
         *(f"{r['split']['wall_seconds']['setup']:.0f}" for r in runs)],
    ]  # fmt: skip
    base = _baseline()
    if base:
        old = base["runs"]
        rows += [
            [f"**the earlier demo** ({old[0]['finetune_steps']} fine-tuning steps; commit {base['commit']}): "
             "whole demo, wall seconds (load average at the start, at the end)",
             *(f"{r['wall_seconds']:.0f} ({r['load_average_1min']['setup']:g}, {r['load_average_1min']['finetune']:g})"
               for r in old)],
            ["the earlier demo: whole demo, CPU seconds", *(f"{r['cpu_seconds']:.0f}" for r in old)],
            _split_row("the earlier demo: start-up/pretraining/evaluations/fine-tuning/other, wall seconds", old,
                       "wall_seconds"),
            _split_row("the earlier demo: the same, CPU seconds", old, "cpu_seconds"),
            ["the earlier demo: accuracy, short-context model → after fine-tuning",
             *(f"{pct(r['accuracy_before'])} → {pct(r['accuracy_after'])}" for r in old)],
        ]  # fmt: skip
    text = table(head, rows) + f"\n\n`{data['command']}`; measured on {_demo_machine(runs)}."
    if base:
        text += f" The earlier demo: {base['how']}, on {_demo_machine(base['runs'])}."
    return text


def demo_heatmaps() -> str:
    res = {w: json.loads((DEMO / f"needle-{w}" / "needle.json").read_text()) for w in ("before", "after")}
    b = res["before"]
    st = b["settings"]

    def by_length(r: dict) -> str:
        return ", ".join(f"{tokens(int(n))} {pct(v)}" for n, v in r["summary"]["accuracy_by_length"].items())

    lengths = b["lengths"]
    return (
        f"{tokens(lengths[0])} to {tokens(lengths[-1])} tokens, {len(b['depths'])} depths, {st['samples']} keys per "
        f"cell, CP = {st['cp_size']} prefill. Accuracy by length, short-context model: {by_length(b)}; after "
        f"fine-tuning: {by_length(res['after'])}. Evaluation time {b['seconds']:.0f} s and "
        f"{res['after']['seconds']:.0f} s, measured on {machine_text(b.get('machine'))}."
    )


def demo_ruler() -> str:
    res = {w: json.loads((DEMO / f"ruler-{w}" / "ruler.json").read_text()) for w in ("before", "after")}
    b, a = res["before"], res["after"]
    st = b["settings"]
    task = b["tasks"][0]
    head = ["length (tokens)", "short-context model", "after ring-attention fine-tuning", "seconds per sample"]
    rows = [
        [tokens(n), f"{b['summary']['table'][task][str(n)]:.1f}", f"**{a['summary']['table'][task][str(n)]:.1f}**",
         f"{b['summary']['seconds_per_sample'][str(n)]:.2f} / {a['summary']['seconds_per_sample'][str(n)]:.2f}"]
        for n in b["lengths"]
    ]  # fmt: skip
    return table(head, rows) + (
        f"\n\nRULER's `{task}` (score: the share of samples whose generated digits hold the key, in %), "
        f"{st['samples']} samples per length, greedy decoding with CP = {st['cp_size']} prefill and the KV cache "
        f"sharded over the {st['cp_size']} processes; `bash scripts/demo_ruler.sh`, {b['seconds']:.0f} s and "
        f"{a['seconds']:.0f} s, measured on {machine_text(b.get('machine'))}."
    )


def ruler_lm_eval() -> str:
    from testkit.ruler_harness import table as lm_eval_table

    data = json.loads((ROOT / "docs" / "ruler-lm-eval.json").read_text())
    return lm_eval_table(data["samples"]) + (
        f"\n\nlm-evaluation-harness {data['lm_eval']}, {tokens(data['length'])} tokens, the first "
        f"{len(data['samples']) // len({r['task'] for r in data['samples']})} samples of each task; "
        f"`HF_RING_RULER_RESULTS=docs/ruler-lm-eval.json pytest tests/test_ruler_lm_eval.py`, measured on "
        f"{machine_text(data.get('machine'))}."
    )


def decode_memory() -> str:
    from hf_ring.planner.decode import decode_cache_bytes
    from hf_ring.planner.models import model_shape

    gib = 2**30
    head = ["model", "tokens", "one process, GiB", "CP = 8, GiB per rank", "CP = 16", "CP = 32"]
    rows = []
    for name in ("Llama-3.1-8B", "Qwen3.5-9B"):
        shape = model_shape(name)
        for n in (2**17, 2**18, 2**19, 2**20):
            per = [decode_cache_bytes(shape, n, cp)["total"] / gib for cp in (8, 16, 32)]
            whole = decode_cache_bytes(shape, n, 1)["one_process"] / gib
            rows.append([name, tokens(n), f"{whole:.1f}", *(f"{v:.2f}" for v in per)])
    return table(head, rows) + (
        "\n\nbf16 keys and values, batch 1, 128 generated tokens: each rank's shard of the prompt plus the "
        "replicated tail (Qwen3.5-9B: 8 of its 32 layers attend; its Gated DeltaNet states, 49 MiB, are "
        "replicated). `hf_ring.planner.decode.decode_cache_bytes`; `hf-ring plan MODEL --decode` prints it."
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
    "llama-3.1-8b-8m-lora": ("Llama-3.1-8B, LoRA r16, YaRN x64, tiled layers, 8 head groups, offload of every other "
                             "layer's input, FSDP2", "8 x 80 GB (one node)", "8 x 1"),
    "llama-3.1-8b-8m-full": ("Llama-3.1-8B, full fine-tuning, YaRN x64, tiled layers, 8 head groups, offload of every "
                             "other layer's input, FSDP2", "8 x 80 GB (one node)", "8 x 1"),
    "qwen3.5-9b-1m": ("Qwen3.5-9B's language model (no vision tower), LoRA r16 on attention, MLP and Gated DeltaNet "
                      "projections, YaRN x4, offload, tiled MLP, FSDP2", "8 x 80 GB", "8 x 1"),
    "tiny-cpu-dpo": ("tiny Llama, DPO, LoRA r8", "2 CPU processes", "2 x 1"),
    "tiny-cpu-grpo": ("tiny Llama, GRPO, full fine-tune, built-in rewards", "2 CPU processes", "2 x 1"),
    "llama-3.1-8b-dpo-128k": ("Llama-3.1-8B, DPO (pairs: 2 sequences per micro-batch; reference: the adapter "
                              "disabled), LoRA r16, FSDP2", "8 x 80 GB", "8 x 1"),
    "qwen3-8b-grpo-64k": ("Qwen3-8B, GRPO (prompt + completion; generation's KV cache not included), LoRA r16, "
                          "FSDP2", "8 x 80 GB", "4 x 2"),
    "tiny-cpu-vlm": ("tiny Qwen3-VL with its vision tower (frozen), images and video packed as documents, LoRA r8 "
                     "on the decoder", "2 CPU processes", "2 x 1"),
    "qwen3.5-9b-video-256k": ("Qwen3.5-9B with its vision tower (frozen) on long video (90 % visual tokens), LoRA "
                              "r16 on the language model, offload, tiled MLP, FSDP2", "8 x 80 GB", "8 x 1"),
}  # fmt: skip


def recipes() -> str:
    import yaml

    cells = []
    for name, (model, gpus, grid) in RECIPES.items():
        recipe = yaml.safe_load((ROOT / "hf_ring" / "recipes" / f"{name}.yaml").read_text())
        data, mem = recipe["data"], recipe["memory_gb"]
        n = max([data.get("seq_len", 0), *(stage["seq_len"] for stage in data.get("stages", []))])
        gib = f"{mem['total']:.2f}" + (f" (+{mem['host']:.0f} host)" if mem.get("host") else "")
        cells.append([f"`{name}`", model, tokens(n), gpus, grid, gib])
    head = ["recipe", "model", "tokens per sequence", "GPUs", "CP x DP", "planner: GiB per GPU"]
    return table(head, cells) + (
        "\n\nThe memory column is `hf-ring plan RECIPE` as each recipe records it in `memory_gb` (a test fails when a "
        "recipe drifts from the planner)."
    )


def layer_changes() -> str:
    from hf_ring.transformers.layers import markdown

    return markdown()


RENDERERS: dict[str, Callable[[], str]] = {
    "demo-summary": demo_summary,
    "demo-seeds": demo_seeds,
    "demo-heatmaps": demo_heatmaps,
    "demo-ruler": demo_ruler,
    "decode-memory": decode_memory,
    "ruler-lm-eval": ruler_lm_eval,
    "models": models,
    "models-summary": models_summary,
    "recipes": recipes,
    "attention-speed": speed.attention_speed,
    "training-step": speed.training_step,
    "mixers": speed.mixers,
    "windows": speed.windows,
    "packed": speed.packed,
    "ulysses": speed.ulysses,
    "gptoss": speed.gptoss,
    "softcap": speed.softcap,
    "batch-check": speed.batch_check,
    "checkpoint-cost": speed.checkpoints,
    "memory-grid": memory.memory_grid,
    "memory-variants": memory.memory_variants,
    "memory-fit": memory.memory_fit,
    "chunked-loss-autocast": memory.autocast_errors,
    "memory-tools": memory.memory_tools,
    "mlp-recompute": memory.mlp_recompute,
    "ring-overlap": memory.ring_overlap,
    "planner-findings": memory.lora_fp32,
    "planner-host": memory.planner_host,
    "planner-published": memory.planner_published,
    "planner-grid": memory.planner_grid,
    "planner-longest": memory.planner_longest,
    "tiled-memory": tiled.tiled_memory,
    "tiled-speed": tiled.tiled_speed,
    "eight-million": tiled.eight_million,
    "eight-million-anchors": tiled.eight_million_anchors,
    "eight-million-more": tiled.eight_million_more,
    "layer-changes": layer_changes,
    "multimodal-exactness": multimodal.multimodal_exactness,
    "recipe-vlm": multimodal.recipe_vlm,
    "vision-spread": multimodal.vision_spread,
    "vision-recipe-plan": multimodal.vision_recipe_plan,
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
