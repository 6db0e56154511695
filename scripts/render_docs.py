"""Write the generated parts of README.md and docs/*.md from the results files.

    python scripts/render_docs.py           # rewrite every marked region that differs
    python scripts/render_docs.py --check   # only say which documents differ (exit 1 if any)

A document marks a generated part ``<!-- name:start -->`` ... ``<!-- name:end -->``; the renderers
(one per name) are ``benchmarks.report.RENDERERS``: the benchmarks' long tables
(``benchmarks/results/*.jsonl``), the demo's ``docs/demo/seeds.json`` and ``needle.json`` files, the
model sweep's ``docs/models.json``, the recipes' ``memory_gb`` and the planner. ``tests/test_docs.py``
fails when a committed document differs from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import ROOT as DOCS_ROOT  # noqa: E402
from benchmarks.report import update  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a document differs")
    args = p.parse_args(argv)
    changed = update(check=args.check)
    for path in changed:
        print(f"{'differs' if args.check else 'rewrote'}: {path.relative_to(DOCS_ROOT)}")
    if not changed:
        print("every generated region is current")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
