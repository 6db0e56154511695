"""Exactness of the vision-language models under CP: per family and CP size, the worst relative error of
the loss and of any gradient against one process (float64; every case of tests/test_multimodal.py).

    PYTHONPATH=. python scripts/multimodal_exactness.py [--out benchmarks/results/multimodal_exactness.jsonl]

``--out`` writes the long table of ``benchmarks.harness`` (name ``multimodal_exactness``, provider the
family, x = P = the CP size: ``loss_rel``, ``loss_abs``, ``grad_rel``, the worst parameter in the note;
a ``run_time`` row: the seconds of the whole run); ``scripts/render_docs.py`` renders docs/multimodal.md's
table from the committed file.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from testkit.spawn import close_all, run_ranks  # noqa: E402
from tests.test_multimodal import vlm_errors  # noqa: E402

FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "llama4", "gemma3"]


def cases(world: int) -> list[dict]:
    """Every case of one CP size: plain, encoder frozen, packed (and packed M-RoPE for Qwen), and at
    CP = 4 Ulysses 2 x 2; Gemma 3 also with its image blocks (``token_type_ids``), plain and packed."""
    out = []
    for f in FAMILIES:
        out += [dict(family=f), dict(family=f, frozen=True), dict(family=f, packed="text")]
        if f.startswith("qwen"):
            out.append(dict(family=f, packed="rope"))
        if world == 4:
            out.append(dict(family=f, ulysses=2))
        if f == "gemma3":  # with its processor's token_type_ids: each image's tokens see each other both ways
            out += [dict(family=f, blocks=True), dict(family=f, blocks=True, packed="text")]
            if world == 4:
                out.append(dict(family=f, blocks=True, packed="text", ulysses=2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the long table here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    table = H.Table({"machine": H.machine_info(), "versions": H.versions(transformers=True)}, lambda _: 1)
    for world in (2, 3, 4):
        res = run_ranks(world, vlm_errors, cases(world), timeout=500)
        for f in FAMILIES:
            rs = [r for rank in res for r in rank if r["family"] == f]
            worst = max(rs, key=lambda r: r["grad"])
            note = f"{len(rs) // world} cases, worst over them and the ranks, vs one process in float64"
            vals = {"loss_rel": max(r["loss"] for r in rs), "loss_abs": max(r["abs_loss"] for r in rs),
                    "grad_rel": worst["grad"]}  # fmt: skip
            for metric, v in vals.items():
                unit = "abs_err" if metric == "loss_abs" else "rel_err"
                named = f"; worst parameter: {worst['worst']}" if metric == "grad_rel" else ""
                table.add("multimodal_exactness", f, metric, world, 0, (v, v, v), unit, x=world, note=note + named)
            print(f"CP={world} {f:12s} {note.split(',')[0]}: loss rel max {vals['loss_rel']:.1e} abs max "
                  f"{vals['loss_abs']:.1e} grad rel max {vals['grad_rel']:.1e} ({worst['worst']})")  # fmt: skip
    close_all()
    seconds = time.perf_counter() - start
    print(f"{seconds:.0f} s")
    table.add("run_time", "multimodal_exactness", "seconds", 0, 0, (seconds,) * 3, "s", x=0,
              note="the whole run: every family at CP = 2, 3 and 4")
    if args.out:
        H.write_rows(args.out, table.rows)


if __name__ == "__main__":
    main()
