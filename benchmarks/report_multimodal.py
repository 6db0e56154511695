"""Vision-language models, as docs/multimodal.md shows them: their exactness under CP
(``benchmarks/results/multimodal_exactness.jsonl``, ``scripts/multimodal_exactness.py``), a run of the
``tiny-cpu-vlm`` recipe (``recipe_tiny-cpu-vlm.jsonl``, ``scripts/recipe_run.py``), and the planner's
figures for long video: the vision tower's cost with and without spreading its frames over the CP group,
and the long-video recipe's plan. Measured figures end with the command that wrote their rows and the
machine; ``benchmarks.report`` puts them in the documents' marked regions.
"""

from __future__ import annotations

from unittest import mock

from .harness import gib, machine_text, measured_line, one_row, read_rows, tokens, versions_text
from .harness import markdown_table as table

FAMILIES = {"qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE", "qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE",
            "llama4": "Llama 4", "gemma3": "Gemma 3"}  # fmt: skip
WORST = "; worst parameter: "  # how a gradient row's note names its parameter
EXACTNESS = "PYTHONPATH=. python scripts/multimodal_exactness.py --out benchmarks/results/multimodal_exactness.jsonl"


def _sci(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}".replace("e-0", "e-")


# ------------------------------------------------------------------------------------------ measured
def multimodal_exactness() -> str:
    """Per family and CP size, the worst relative error of the loss and of any gradient (the parameter
    of the worst cell named)."""
    rows = read_rows("multimodal_exactness")
    errs = [r for r in rows if r["name"] == "multimodal_exactness"]
    cps = sorted({r["P"] for r in errs})

    def err(family: str, cp: int, metric: str) -> dict:
        return one_row(errs, provider=family, P=cp, metric=metric)

    worst = max((r for r in errs if r["metric"] == "grad_rel"), key=lambda r: r["median"])

    def grad(r: dict) -> str:
        name = f" (`{r['note'].split(WORST)[1].rsplit('.', 1)[-1]}`)" if r is worst else ""
        return _sci(r["median"]) + name

    cells = [[label, " / ".join(_sci(err(f, c, "loss_rel")["median"]) for c in cps),
              " / ".join(grad(err(f, c, "grad_rel")) for c in cps)] for f, label in FAMILIES.items()]  # fmt: skip
    cp = " / ".join(map(str, cps))
    first, seconds = next(iter(FAMILIES)), one_row(rows, name="run_time")["median"]
    floor, rel = err(first, cps[0], "loss_abs")["median"], err(first, cps[0], "loss_rel")["median"]
    versions = versions_text(rows[0].get("versions"))
    return (
        table(["family", f"loss, CP = {cp}", f"gradients, CP = {cp}"], cells)
        + f"\n\n`{EXACTNESS}`: {seconds:.0f} s, measured on {machine_text(rows[0].get('machine'))}"
        + (f"; {versions}" if versions else "")
        + f". The loss's floor, {FAMILIES[first]} at CP = {cps[0]}: {_sci(floor)} absolute on a loss of "
        f"{floor / rel:.1f}."
    )


def recipe_vlm() -> str:
    """The ``tiny-cpu-vlm`` recipe's run: its launch command, steps, seconds and losses."""
    recipe = "tiny-cpu-vlm"
    rows = read_rows(f"recipe_{recipe}")

    def val(metric: str) -> float:
        return one_row(rows, metric=metric)["median"]

    losses = ", ".join(f"{r['median']:.2f}" for r in sorted(rows, key=lambda r: r["x"]) if r["metric"] == "loss")
    nproc = rows[0]["P"]
    return (
        f"`torchrun --nproc_per_node {nproc} -m hf_ring.cli train {recipe}`: {val('steps'):.0f} steps in "
        f"{val('train_seconds'):.1f} s of training ({val('wall_seconds'):.1f} s wall), losses "
        f"{losses}. "
        + measured_line(rows, f"PYTHONPATH=. python scripts/recipe_run.py {recipe} --nproc {nproc} --out "
                        f"benchmarks/results/recipe_{recipe}.jsonl")
    )


# ------------------------------------------------------------------------------------------- planned
VIDEO = "Qwen3.5-9B"
VIDEO_CMD = (f"hf-ring plan {VIDEO} --seq-len 256K --gpus 8 --cp 8 --sharding fsdp --offload --tiled-mlp 8K "
             "--visual-fraction 0.9")  # fmt: skip


def _every_rank(visual_tokens: float, cp: int) -> float:
    """``hf_ring.planner.vision.encoded_tokens`` as it was before the encoder was spread: every frame."""
    return visual_tokens


def vision_spread() -> str:
    """Qwen3.5-9B on 256K tokens of long video: the tower encoded on every rank or spread over the CP group."""
    from hf_ring.planner import PlanSettings, model_shape, plan

    m = model_shape(VIDEO)
    v = m.vision
    assert v is not None
    n, frac, cp = 2**18, 0.9, 8
    visual = frac * n
    base = dict(seq_len=n, gpus=8, cp=cp, sharding="fsdp", offload=True, tiled_mlp=8192, visual_fraction=frac)
    rows = []
    for what, kw in (("frozen (LoRA on the decoder)", {}), ("trained (full fine-tuning)",
                                                          dict(mode="full", train_vision=True))):
        for where in ("every rank", f"1/{cp} of the frames per rank"):
            s = PlanSettings(**base, **kw)
            if where == "every rank":  # the encoder before it was spread: each rank encodes every frame
                with mock.patch("hf_ring.planner.vision.encoded_tokens", _every_rank), \
                        mock.patch("hf_ring.planner.timing.encoded_tokens", _every_rank):
                    p = plan(m, s)
            else:
                p = plan(m, s)
            assert p.time is not None
            peak = f"{p.peak / 2**30:.2f}" + ("" if p.fits else " (does not fit)")
            rows.append([what, where, peak, f"{p.time.total_s:.2f}", f"{p.time.vision_s:.2f}"])
    features = visual * v.out_hidden * 2 * v.mergers
    intro = (
        f"**Why spread.** {VIDEO}'s encoder has {v.params / 1e9:.2f}B parameters and {v.patches_per_token} patches "
        f"per visual token. On {tokens(n)} tokens of which {frac:.0%} are video ({visual:,.0f} visual tokens, "
        f"{v.patches(visual):,.0f} patches), on 8 x 80 GB at CP = {cp} with FSDP, offload and 8K MLP tiles, the "
        "planner prices:"
    )
    outro = (
        f"Spread, the step's start holds one block's working set over a rank's eighth of the patches plus all the "
        f"visual features (`V x H x 2` bytes: {gib(features)} for {visual:,.0f} tokens at H = {m.hidden} in "
        f"bf16) and the whole merged sequence before its cut ({gib(n * m.hidden * 2)}); trained, the gathered "
        f"features' gradient comes back in backward. (Estimates from `{VIDEO_CMD}`, adding `--mode full "
        "--train-vision` for the trained rows; the \"every rank\" rows are the same plan with every rank encoding "
        "every frame, as before the encoder was spread. No GPU has run this yet.)"
    )
    head = ["vision tower", "encoded on", "peak per GPU (GiB)", "step (s)", "of which the tower (s)"]
    return intro + "\n\n" + table(head, rows) + "\n\n" + outro


VIDEO_RECIPE = "qwen3.5-9b-video-256k"


def vision_recipe_plan() -> str:
    """The planner's figures for the long-video recipe (what ``hf-ring plan RECIPE`` prints, condensed), and
    its peak with every rank encoding every frame."""
    from dataclasses import replace

    from hf_ring.planner import GiB, plan, smallest_cp
    from hf_ring.recipes.reader import recipe_model, recipe_path, recipe_settings

    recipe = recipe_path(VIDEO_RECIPE)
    m, s = recipe_model(recipe), recipe_settings(recipe)
    p = plan(m, s)
    with mock.patch("hf_ring.planner.vision.encoded_tokens", _every_rank), \
            mock.patch("hf_ring.planner.timing.encoded_tokens", _every_rank):
        whole = plan(m, s)
    best = smallest_cp(m, replace(s, cp=None))
    t = p.time
    assert t is not None
    g = GiB
    phases = ", ".join(f"{k.replace('layer backward, ', '')} {v / g:.2f}" + ("  <- peak" if k == p.peak_phase else "")
                       for k, v in p.phases.items())  # fmt: skip
    opts = (f"mode={s.mode}, dtype={s.dtype}, checkpointing={s.checkpointing}, offload={s.offload}, "
            f"sharding={s.sharding}, chunked_loss={s.chunked_loss}, tiled_mlp={s.tiled_mlp}")  # fmt: skip
    lines = [
        f"{m.name}: {p.seq_len:,} tokens on {p.gpus} GPUs, CP={p.cp} (DP={p.gpus // p.cp}), {p.tokens_per_rank:,} "
        f"tokens per rank; {opts}",
        f"  weights {p.rows['weights'] / g:.2f}, gradients {p.rows['gradients'] / g:.2f}, optimizer state "
        f"{p.rows['optimizer state'] / g:.2f} GiB",
        f"  activation peak, by phase: {phases}",
        f"  peak (model states + activation peak + reserve)     {p.peak / g:.2f} of {p.gpu_bytes / g:.2f}: "
        f"{'fits' if p.fits else 'does not fit'}; host {sum(p.host.values()) / g:.2f} GiB per rank (offloaded)",
        f"  step time per micro-batch (estimate): {t.total_s:.2f} s = attention {t.attention_s:.2f} + GEMMs "
        f"{t.gemm_s:.2f} + memory-bound {t.memory_s:.2f} + exposed communication {t.exposed_comm_s:.3f} + vision "
        f"tower {t.vision_s:.2f}; {t.tokens_per_s:,.0f} tokens/s per GPU, MFU {t.mfu:.0%} (estimate)",
        *(f"  {n}" for n in p.notes if n.startswith("vision tower")),
        f"  smallest CP size that fits: {best}",
    ]
    return (
        f"The planner's figures (`hf-ring plan {VIDEO_RECIPE}`; `--write` writes its `memory_gb`), condensed:\n\n"
        "```\n" + "\n".join(lines) + "\n```\n\n"
        f"With the encoder on every rank (before its frames were spread) the peak would be {whole.peak / g:.2f} GiB "
        f"per GPU, in the phase \"{whole.peak_phase}\". The recipe keeps CP = {p.cp} for the step time (the smallest "
        f"CP that fits is {best})."
    )
