"""Train a CPU recipe under torchrun and write what the docs quote of it: every logged loss, the steps, the
training and wall seconds (the run's ``summary.json``), the machine, the versions.

    PYTHONPATH=. python scripts/recipe_run.py tiny-cpu-vlm --nproc 2 \\
        --out benchmarks/results/recipe_tiny-cpu-vlm.jsonl      # ~10 s on 2 cores

``--out`` gets the long table of ``benchmarks.harness`` (name ``recipe_run``, provider the recipe, P the
processes: ``loss`` at x = its step, ``steps``, ``train_seconds``, ``wall_seconds``);
``scripts/render_docs.py`` renders docs/multimodal.md's sentence on ``tiny-cpu-vlm`` from the file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import harness as H  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="a packaged recipe that runs on CPU (tiny-cpu-...)")
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    p.add_argument("--out", type=Path, required=True, help="the long table to write")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "-m", "hf_ring.cli",
               "train", args.recipe, "--output_dir", tmp]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(run, check=True, cwd=tmp, env=env)  # this checkout's hf_ring, from the run's folder
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        logged = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    table = H.Table({"machine": H.machine_info(), "versions": H.versions(transformers=True)}, lambda _: 1)
    note = f"CP {summary['cp_size']} x DP {summary['dp_size']}"
    for r in logged:
        if "loss" in r:
            table.add("recipe_run", args.recipe, "loss", args.nproc, 0, (r["loss"],) * 3, "loss", x=r["step"],
                      note=note + "; logged at this step")  # fmt: skip
    table.add("recipe_run", args.recipe, "steps", args.nproc, 0, (summary["steps"],) * 3, "steps", x=0, note=note)
    for key in ("train_seconds", "wall_seconds"):
        table.add("recipe_run", args.recipe, key, args.nproc, 0, (summary[key],) * 3, "s", x=0,
                  note=note + "; summary.json")  # fmt: skip
    H.write_rows(args.out, table.rows)
    print("".join(f"{r['metric']} {r['x']}: {r['median']}\n" for r in table.rows), end="")


if __name__ == "__main__":
    main()
