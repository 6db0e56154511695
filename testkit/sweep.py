"""Is a causal-LM family exact under context parallelism? Three paths at CP = ``cp`` against one process.

``check_family(model_type, variant)`` runs ``rank_check`` (``testkit.sweep_rank``) on ``cp`` gloo ranks
(``testkit.spawn``): rank 0 builds the family's tiny model (``testkit.families.tiny_config``) with sdpa attention (eager
where the model has no sdpa), runs the whole batch and keeps the loss, every parameter gradient and
the logits of a prefill without labels; every rank then builds the same model with
``attn_implementation="ring"`` (the weights copied from rank 0's reference) and runs its
``hf_ring.shard_batch`` shard on three paths:

- ``labelled``: one training step; the gradients are summed over the ranks and divided by ``cp``
  (what DDP/FSDP averaging does);
- ``unlabelled``: a prefill without labels (evaluation mode, no gradients), its logits gathered
  from the CP group (``RingContext.unshard``);
- ``chunked``: the training step again with ``hf_ring.enable_chunked_loss`` (the default of
  ``RingTrainingArguments``).

Each path gets a status:

- ``exact``: the loss on every rank and every gradient (or the logits) within ``TOL`` (relative; a
  tensor whose true gradient is ~0 is judged against ``FLOOR`` x the largest gradient norm; a float32
  miss below ``BORDERLINE`` is decided by the same check in float64, where rounding is out of the way);
- ``refused``: hf_ring raised its own error (``RingNotSupported``, a ValueError/TypeError/
  RuntimeError that names ``attn_implementation="ring"`` or hf_ring, or a ValueError raised by an
  argument check inside the hf_ring package);
- ``wrong``: it ran and differs (the worst case);
- ``broken``: any other exception (from inside transformers, say), or the ranks hung;
- ``skipped``: the single-process reference itself fails from ``input_ids`` alone.

The record's own fields are the labelled path's; ``record["unlabelled"]`` and ``record["chunked"]``
hold the others. Families whose transformers kernels compute in float32 whatever the input (the
Gated DeltaNet ones: ``testkit.mixers.judged_in_float64``) are judged in float64, those float32
casts widened (``testkit.mixers.float64_kernels``, ``widened_casts``), in the reference and the ring.

No tensor crosses processes: each rank returns plain values, and also writes its record to a file
after every path, so that a rank that raised is still heard when another one hangs in a collective
(the pool is then killed by ``run_ranks``' timeout and restarted by the next call).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from .sweep_rank import FLOOR, TOL, classify, rank_check, variant_kwargs
from .sweep_table import _DIAGNOSTICS, NO_EFFECT, PATHS, explain, path_record

__all__ = ["FLOOR", "PATHS", "STATUSES", "TOL", "check_family", "classify", "rank_check", "variant_kwargs"]

BORDERLINE = 1e-3  # a float32 "wrong" below this is checked again in float64
STATUSES = ("exact", "refused", "wrong", "broken", "skipped")


def check_family(
    model_type: str,
    variant: str | None = None,
    n: int = 61,
    cp: int = 2,
    timeout: float = 120.0,
    dtype: str | None = None,
) -> dict:
    """One record: ``{"family", "variant", "status", "detail", "seconds", "unlabelled", "chunked", ...}``
    (see the module). ``dtype``: float32, or float64 for the families ``judged_in_float64`` (default)."""
    from .mixers import judged_in_float64
    from .spawn import run_ranks

    if dtype is None:
        dtype = "float64" if judged_in_float64(model_type) else "float32"
    t0 = time.perf_counter()
    record: dict[str, Any] = {"family": model_type, "variant": variant}
    with tempfile.TemporaryDirectory(prefix="hf_ring_sweep_") as tmp:
        report = os.path.join(tmp, "rank")
        hung = ""
        try:
            per_rank = run_ranks(cp, rank_check, model_type, variant, n, report=report, dtype=dtype, timeout=timeout)
        except TimeoutError as e:
            per_rank, hung = _read_reports(report, cp), f"hung: {str(e).splitlines()[0]}"
        except RuntimeError as e:  # a rank died outside rank_check's own handling
            failure = {"status": "broken", "detail": str(e).strip().splitlines()[-1][:300]}
            per_rank = [{p: failure for p in PATHS}]
    rank0 = next((r for r in per_rank if r and r.get("rank") == 0), {})
    record.update({k: rank0[k] for k in _DIAGNOSTICS if k in rank0})
    paths = {p: _merge([r.get(p) if r else None for r in per_rank], variant, record, hung) for p in PATHS}
    if dtype == "float32":
        again = None
        for path, result in paths.items():
            errors = [result.get(k, 1.0) for k in ("loss_rel_err", "grad_rel_err", "logits_rel_err") if k in result]
            if result["status"] == "wrong" and errors and max(errors) < BORDERLINE:
                # float32 rounding can reach TOL where gradients cancel (q/k norms, say): ask float64
                again = again or check_family(model_type, variant, n=n, cp=cp, timeout=timeout, dtype="float64")
                redo = path_record(again, path)
                if redo["status"] == "exact":
                    detail = f"float32: {result['detail']}; float64: {redo['detail']}"
                    paths[path] = {"status": "exact", "detail": detail}
    record.update(paths["labelled"])
    for path in PATHS[1:]:
        record[path] = paths[path]
    record["why"] = explain(record)
    for path in PATHS[1:]:
        record[path]["why"] = explain(path_record(record, path))
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record


def _read_reports(report: str, cp: int) -> list[dict | None]:
    out: list[dict | None] = []
    for r in range(cp):
        try:
            with open(f"{report}.{r}") as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            out.append(None)
    return out


def _merge(per_rank: list[dict | None], variant: str | None, record: dict, hung: str) -> dict:
    """One path's status over the ranks: broken, refused or skipped when any rank says so, else rank
    0's comparison; with ``hung``, what the ranks that were heard said, else broken."""
    ranks = len(per_rank)
    out: dict[str, Any] | None = None
    for status in ("broken", "refused", "skipped"):
        same = [(i, r) for i, r in enumerate(per_rank) if r and r.get("status") == status]
        if same:
            first = next((r for _, r in same if r.get("detail")), same[0][1])
            out = {"status": status, "detail": first.get("detail", "")}
            if status != "skipped" and len(same) < ranks:
                which = ", ".join(str(i) for i, _ in same)
                out["detail"] += f" (rank {which} only" + ("; the others hung)" if hung else ")")
            break
    if out is None:
        rank0 = per_rank[0] if per_rank and per_rank[0] else {}
        if hung or rank0.get("status") not in ("exact", "wrong"):
            return {"status": "broken", "detail": hung or "no result"}
        out = dict(rank0)
    effect = record.get("variant_effect")
    if variant is not None and effect is not None and effect < NO_EFFECT:
        if out["status"] == "exact":
            out = {
                "status": "skipped",
                "detail": f"the {variant} variant changes nothing in this family (same reference loss as without it)",
            }
        else:
            out["detail"] += f" (the {variant} variant does not change the single-process reference)"
    return out
