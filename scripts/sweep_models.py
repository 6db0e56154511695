"""Sweep every causal-LM family of the installed transformers: is it exact at CP=2, on every path?

    python scripts/sweep_models.py                      # all families x variants -> docs/models.json
    python scripts/sweep_models.py --families llama,qwen3_next --json /tmp/some.json
    python scripts/sweep_models.py --from-json --update-docs     # docs/models.md from docs/models.json

Multimodal families run with image inputs (``testkit.sweep_images``: exact, or refused).
Each family (and each of its variants: router_aux, sliding, mla, temperature) runs on CP=2 gloo
ranks against one process with sdpa (``testkit.sweep.check_family``), on three paths: a training
step with labels, a prefill without labels (the logits), and the training step with the chunked
loss. The records go to ``docs/models.json``, a markdown table and a summary to stdout; ``--update-docs``
renders the documents' generated regions from them (docs/models.md's table, the README's summary line:
``scripts/render_docs.py``, the one writer of those tables).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.families import skipped, variants  # noqa: E402
from testkit.sweep import STATUSES, check_family  # noqa: E402
from testkit.sweep_images import check_images  # noqa: E402
from testkit.sweep_table import PATHS, path_record, render_table  # noqa: E402


def _multimodal() -> set[str]:
    return {name for name, why in skipped().items() if why.startswith("multimodal")}


IMAGES = _multimodal()


def run_sweep(names: list[str], n: int, cp: int, timeout: float, log=print) -> list[dict]:
    """Records of every family in ``names`` x its variants, and of every skipped model type."""
    records = []
    skips = skipped()
    for name in names:
        if name in skips and name in IMAGES:  # multimodal: run with image inputs (exact or refused)
            r = check_images(name, cp=cp, timeout=timeout)
            records.append(r)
            statuses = "/".join(path_record(r, p)["status"] for p in PATHS)
            log(f"{r['seconds']:6.1f}s  {statuses:24s} {name} (images)  {r.get('detail', '')[:90]}")
            continue
        if name in skips:
            records.append(
                {
                    "family": name,
                    "variant": None,
                    "status": "skipped",
                    "detail": skips[name],
                    "why": skips[name],
                    "seconds": 0.0,
                }
            )
            continue
        for variant in (None, *variants(name)):
            r = check_family(name, variant, n=n, cp=cp, timeout=timeout)
            records.append(r)
            statuses = "/".join(path_record(r, p)["status"] for p in PATHS)
            label = name + (f" ({variant})" if variant else "")
            log(f"{r['seconds']:6.1f}s  {statuses:24s} {label}  {r.get('detail', '')[:90]}")
    return records


def summary(records: list[dict], wall: float | None) -> str:
    lines = [""]
    for path in PATHS:
        counts = Counter(path_record(r, path)["status"] for r in records)
        shown = ", ".join(f"{s} {counts.get(s, 0)}" for s in STATUSES)
        lines.append(f"{path}: {shown} (records {len(records)})")
    timed = sorted((r for r in records if r.get("seconds")), key=lambda r: -r["seconds"])
    if timed:
        total = sum(r["seconds"] for r in timed)
        lines.append(
            f"time: {total:.0f} s over {len(timed)} runs, median "
            f"{timed[len(timed) // 2]['seconds']:.2f} s; slowest: "
            + ", ".join(
                f"{r['family']}{'/' + r['variant'] if r.get('variant') else ''} {r['seconds']:.1f} s" for r in timed[:5]
            )
        )
    if wall is not None:
        lines.append(f"whole sweep: {wall:.0f} s wall")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", help="comma-separated model types (default: every causal-LM model type)")
    p.add_argument("--n", type=int, default=61, help="sequence length (default 61, not a multiple of 2 * cp)")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per family before the ranks count as hung")
    p.add_argument("--json", default=str(ROOT / "docs" / "models.json"), help="records file (written, or read)")
    p.add_argument("--from-json", action="store_true", help="do not run: read the records from --json")
    p.add_argument("--update-docs", action="store_true", help="render docs/models.md and the README's summary")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    wall = None
    if args.from_json:
        records = json.loads(Path(args.json).read_text())
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        from testkit.spawn import close_all

        names = args.families.split(",") if args.families else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        unknown = [f for f in names if f not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        if unknown:
            raise SystemExit(f"not causal-LM model types of this transformers: {unknown}")
        t0 = time.perf_counter()
        try:
            records = run_sweep(names, args.n, args.cp, args.timeout)
        finally:
            close_all()
        wall = time.perf_counter() - t0
        records.sort(key=lambda r: (r["family"], r.get("variant") or ""))
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    table = render_table(records)
    print(table + summary(records, wall))
    if args.update_docs:
        from benchmarks.report import update

        for path in update():
            print(f"rewrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
