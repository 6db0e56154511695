"""Draw every benchmark figure from the long-format JSON-lines tables (one row per measurement).

    python -m benchmarks.plot [TABLE ...] [--outdir DIR]     # default: every table of benchmarks/results

Each table is drawn by the figures of the benchmark that wrote it, found by the table's name
(``FIGURES``): ``attention.jsonl`` (``bench_attention``) gives efficiency.png, vs_torch_ring.png,
times.png, load_balance.png, comm_hidden.png and attention_memory.png; ``model.jsonl``
(``bench_model``) model_throughput.png and model_memory.png; ``gpu.jsonl`` (``bench_gpu``)
gpu_fraction.png, gpu_overlap.png and gpu_kernels.png; ``memory.jsonl`` (``bench_memory``)
memory.png; ``windows.jsonl``, ``ulysses.jsonl``, ``packed.jsonl``, ``mixers.jsonl`` and ``tiled.jsonl``
(``bench_tiled``) the figure of the same name. A benchmark draws its own table's figures after writing it
(``harness.draw`` runs this command). Error bars are the p20..p80 range over iterations; every figure names
the machine its rows were measured on. The figure code is in ``benchmarks/figures/``; the rows are read by
``benchmarks.harness.read_rows``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .figures.attention import figures as attention_figures
from .figures.gpu import plot_gpu
from .figures.model import plot_memory_vs_planner, plot_model
from .figures.style import select
from .figures.variants import plot_mixers, plot_packed, plot_tiled, plot_ulysses, plot_windows
from .harness import read_rows

__all__ = ["FIGURES", "plot_all", "plot_gpu", "plot_model", "select"]

RESULTS = Path(__file__).resolve().parent / "results"
FIGURES: dict[str, Callable[[list[dict], Path], list[Path]]] = {
    "attention": attention_figures,
    "model": plot_model,
    "gpu": plot_gpu,
    "memory": plot_memory_vs_planner,
    "windows": plot_windows,
    "ulysses": plot_ulysses,
    "packed": plot_packed,
    "mixers": plot_mixers,
    "tiled": plot_tiled,
}


def plot_all(tables: str | Path | list[str | Path], outdir: str | Path) -> list[Path]:
    """Every figure of ``tables`` (JSON-lines files, each drawn by ``FIGURES[its name]``) in ``outdir``."""
    tables = [tables] if isinstance(tables, (str, Path)) else tables
    out = Path(outdir)
    paths: list[Path] = []
    for table in map(Path, tables):
        figures = FIGURES.get(table.stem)
        if figures is not None:
            paths += figures(read_rows(table), out)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="*", help="default: the tables of benchmarks/results that have figures")
    ap.add_argument("--outdir", default=None, help="default: each table's folder")
    args = ap.parse_args(argv)
    tables = [Path(t) for t in args.tables] or [p for name in FIGURES if (p := RESULTS / f"{name}.jsonl").exists()]
    if not tables:
        ap.error("no tables given and none in benchmarks/results")
    for table in tables:
        for p in plot_all(table, args.outdir or table.parent):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
