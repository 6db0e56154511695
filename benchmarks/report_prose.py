"""The measured figures in the prose of docs/multimodal.md, docs/transformers.md and docs/trainer.md, from
their results files: the vision-language models' exactness (``multimodal_exactness.jsonl``), the cost of
the batch check (``batch_check.jsonl``), of soft-capping on CPU (``softcap.jsonl``) and of sealing and
checking checkpoints (``checkpoints.jsonl``), and a run of the ``tiny-cpu-vlm`` recipe
(``recipe_tiny-cpu-vlm.jsonl``). Each ends with the command that wrote the file and the
machine it was measured on; ``benchmarks.report`` puts them in the documents' marked regions.
"""

from __future__ import annotations

import math

from .harness import machine_text, versions_text
from .report_measured import measured_line, read_rows, table, tokens

FAMILIES = {"qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE", "qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE",
            "llama4": "Llama 4", "gemma3": "Gemma 3"}  # fmt: skip


def _sci(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}".replace("e-0", "e-")


def multimodal_exactness() -> str:
    """Per family and CP size, the worst relative error of the loss and of any gradient (the parameter
    of the worst cell named)."""
    rows = read_rows("multimodal_exactness")
    data = rows[0]  # command, machine, versions, seconds: the same on every row
    cps = sorted({r["cp"] for r in rows})
    worst = max(rows, key=lambda r: r["grad_rel"])
    by = {(r["family"], r["cp"]): r for r in rows}

    def grad(r: dict) -> str:
        name = f" (`{r['worst'].rsplit('.', 1)[-1]}`)" if r is worst else ""
        return _sci(r["grad_rel"]) + name

    cells = [[label, " / ".join(_sci(by[f, c]["loss_rel"]) for c in cps), " / ".join(grad(by[f, c]) for c in cps)]
             for f, label in FAMILIES.items()]  # fmt: skip
    cp = " / ".join(map(str, cps))
    first = rows[0]
    versions = versions_text(data.get("versions"))
    return (
        table(["family", f"loss, CP = {cp}", f"gradients, CP = {cp}"], cells)
        + f"\n\n`{data['command']}`: {data['seconds']:.0f} s, measured on {machine_text(data.get('machine'))}"
        + (f"; {versions}" if versions else "")
        + f". The loss's floor, {FAMILIES[first['family']]} at CP = {first['cp']}: {_sci(first['loss_abs'])} "
        f"absolute on a loss of {first['loss_abs'] / first['loss_rel']:.1f}."
    )


def batch_check() -> str:
    """What ``check_same_batch`` costs against ``shard_batch`` and an embedding lookup."""
    rows = read_rows("batch_check")
    def ms(key: str) -> str:
        return ", ".join(f"{1e3 * r[key]:.0f}" for r in rows)

    return (
        f"What the batch check costs on {rows[0]['P']} gloo ranks, at {', '.join(tokens(r['N']) for r in rows)} "
        f"tokens: {ms('check_s')} ms (all of `shard_batch`, the check included: {ms('shard_s')} ms; looking the "
        f"rank's tokens up in a 4096-wide bf16 embedding: {ms('embed_s')} ms). "
        + measured_line(rows, "python -m benchmarks.bench_batch_check --out benchmarks/results/batch_check.jsonl")
    )


def softcap() -> str:
    """What soft-capping costs on CPU: the reference kernel with the cap against the fused op without."""
    rows = read_rows("softcap")
    ratios = " and ".join(f"{r['capped_over_fused']:.1f}x (N = {tokens(r['N'])})" for r in rows)
    return (
        "On CPU a soft-capped layer runs the reference kernel: forward + backward of one layer's attention (B = 1, "
        f"Hq = 8, Hkv = 2, D = 64, fp32) takes {ratios} the time of torch's fused op without a cap. "
        + measured_line(rows, rows[0]["command"])
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


def recipe_vlm() -> str:
    """The ``tiny-cpu-vlm`` recipe's run: its launch command, steps, seconds and losses."""
    r = read_rows("recipe_tiny-cpu-vlm")[0]
    versions = versions_text(r.get("versions"))
    return (
        f"`{r['launch']}`: {r['steps']} steps in {r['train_seconds']:.1f} s of training ({r['wall_seconds']:.1f} s "
        f"wall), losses {', '.join(f'{x:.2f}' for x in r['losses'])}. `{r['command']}`; measured on "
        f"{machine_text(r.get('machine'))}" + (f"; {versions}." if versions else ".")
    )
