"""Train a CPU recipe under torchrun and write what the docs quote of it: every logged loss, the training
and wall seconds (the run's ``summary.json``), the command, the machine, the versions.

    PYTHONPATH=. python scripts/recipe_run.py tiny-cpu-vlm --nproc 2 \\
        --out benchmarks/results/recipe_tiny-cpu-vlm.jsonl      # ~10 s on 2 cores

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

from benchmarks.harness import machine_info, versions  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="a packaged recipe that runs on CPU (tiny-cpu-...)")
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    p.add_argument("--out", type=Path, required=True, help="the JSON-lines file to write (one row)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "-m", "hf_ring.cli",
               "train", args.recipe, "--output_dir", tmp]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(run, check=True, cwd=tmp, env=env)  # this checkout's hf_ring, from the run's folder
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        logged = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    data = {
        "recipe": args.recipe,
        "launch": f"torchrun --nproc_per_node {args.nproc} -m hf_ring.cli train {args.recipe}",
        "command": f"PYTHONPATH=. python scripts/recipe_run.py {args.recipe} --nproc {args.nproc} --out {args.out}",
        "losses": [r["loss"] for r in logged if "loss" in r],
        **{k: summary[k] for k in ("cp_size", "dp_size", "steps", "train_seconds", "wall_seconds")},
        "machine": machine_info(),
        "versions": versions(transformers=True),
    }
    args.out.write_text(json.dumps(data) + "\n")  # one row, as benchmarks/results/*.jsonl
    print(json.dumps(data))


if __name__ == "__main__":
    main()
