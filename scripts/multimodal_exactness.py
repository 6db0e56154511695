"""Exactness of the vision-language models under CP: per family and CP size, the worst relative error of
the loss and of any gradient against one process (float64; every case of tests/test_multimodal.py).

    PYTHONPATH=. python scripts/multimodal_exactness.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit.spawn import close_all, run_ranks  # noqa: E402
from tests.test_multimodal import vlm_errors  # noqa: E402

if __name__ == "__main__":
    fams = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "llama4", "gemma3"]
    for world in (2, 3, 4):
        cases = []
        for f in fams:
            cases += [dict(family=f), dict(family=f, frozen=True), dict(family=f, packed="text")]
            if f.startswith("qwen"):
                cases.append(dict(family=f, packed="rope"))
            if world == 4:
                cases.append(dict(family=f, ulysses=2))
        res = run_ranks(world, vlm_errors, cases, timeout=500)
        for f in fams:
            rs = [r for rank in res for r in rank if r["family"] == f]
            worst = max(rs, key=lambda r: r["grad"])
            print(
                f"CP={world} {f:12s} cases={len(rs) // world} loss rel max {max(r['loss'] for r in rs):.1e} "
                f"abs max {max(r['abs_loss'] for r in rs):.1e} grad rel max {worst['grad']:.1e} ({worst['worst']})"
            )
    close_all()
