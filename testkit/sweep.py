"""Is ring attention exact for a causal-LM family? One training step at CP = ``cp`` against one process.

``check_family(model_type, variant)`` runs ``rank_check`` on ``cp`` gloo ranks (``testkit.spawn``):
rank 0 builds the family's tiny model (``testkit.families.tiny_config``) with sdpa attention (eager
where the model has no sdpa), runs the whole batch and keeps the loss and every parameter gradient;
every rank then builds the same model with ``attn_implementation="ring"`` (the weights copied from
rank 0's reference), runs its ``hf_ring.shard_batch`` shard, and the gradients are summed over the
ranks and divided by ``cp`` (what DDP/FSDP averaging does). The result is one record:

- ``exact``: the loss on every rank and every gradient within ``TOL`` (relative, float32; a tensor
  whose true gradient is ~0 is judged against ``FLOOR`` x the largest gradient norm; a float32
  miss below ``BORDERLINE`` is decided by the same check in float64, where rounding is out of the way);
- ``refused``: hf_ring raised its own error (``RingNotSupported``, a ValueError/TypeError/
  RuntimeError that names ``attn_implementation="ring"`` or hf_ring, or a ValueError raised by an
  argument check inside the hf_ring package);
- ``wrong``: it ran and differs (the worst case);
- ``broken``: any other exception (from inside transformers, say), or the ranks hung;
- ``skipped``: the single-process reference itself fails from ``input_ids`` alone.

No tensor crosses processes: each rank returns plain values, and also writes its record to a file
so that a rank that raised is still heard when another one hangs in a collective (the pool is then
killed by ``run_ranks``' timeout and restarted by the next call).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import traceback
from typing import Any

from .families import causal_lm_class, tiny_config

__all__ = [
    "FLOOR",
    "README_END",
    "README_START",
    "TOL",
    "check_family",
    "classify",
    "explain",
    "rank_check",
    "render_table",
    "variant_kwargs",
]

TOL = 1e-5
BORDERLINE = 1e-3  # a float32 "wrong" below this is checked again in float64
FLOOR = 1e-3  # near-zero gradients: error relative to FLOOR x the largest gradient norm
STATUSES = ("exact", "refused", "wrong", "broken", "skipped")


def variant_kwargs(variant: str | None, n: int) -> dict[str, Any]:
    """``tiny_config`` keywords of a variant for sequences of ``n`` tokens."""
    if variant is None:
        return {}
    if variant == "sliding":
        return {"sliding": max(2, n // 4)}  # shorter than the sequence, longer than one token
    if variant == "router_aux":
        return {"router_aux": True}
    if variant == "mla":
        return {"mla": True}
    if variant == "temperature":
        return {"temperature": True}
    raise ValueError(f"unknown variant {variant!r}")


def classify(exc: BaseException) -> tuple[str, str]:
    """``(status, detail)`` of an exception raised by the ring run: refused or broken."""
    msg = str(exc).strip()
    first = msg.splitlines()[0] if msg else ""
    detail = f"{type(exc).__name__}: {first}"[:300]
    try:
        from hf_ring.transformers.support import RingNotSupported  # type: ignore[import-not-found]
    except ImportError:
        RingNotSupported = None  # noqa: N806 - the class, when hf_ring has it
    if RingNotSupported is not None and isinstance(exc, RingNotSupported):
        return "refused", detail
    if isinstance(exc, (ValueError, TypeError, RuntimeError)) and (
        'attn_implementation="ring"' in msg or "hf_ring" in msg
    ):
        return "refused", detail
    frame = _innermost(exc)
    if isinstance(exc, ValueError) and frame.startswith("hf_ring/"):
        return "refused", f"{detail} (at {frame})"  # an argument check of hf_ring's own
    return "broken", f"{detail} (at {frame})" if frame else detail


def _innermost(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    parts = f.filename.replace("\\", "/").split("/")
    for package in ("hf_ring", "transformers", "torch"):
        if package in parts:
            start = len(parts) - 1 - parts[::-1].index(package)
            return f"{'/'.join(parts[start:])}:{f.lineno}"
    return f"{parts[-1]}:{f.lineno}"


# ------------------------------------------------------------------------------------------------
# on every rank


def _batch(config: Any, b: int, n: int, seed: int = 1) -> dict:
    """``input_ids``/``labels [b, n]`` with ``-100`` spans (as ``testkit.models.tiny_batch``), ids drawn
    from the config's vocabulary minus its special token ids (image/audio placeholders, ...)."""
    import torch

    text = config.get_text_config()
    vocab = text.vocab_size
    special = set()
    for cfg in (config, text):
        for name, v in cfg.to_dict().items():
            if name.endswith(("token_id", "token_index", "token_ids")):
                special.update(x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int))
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    g = torch.Generator().manual_seed(seed)
    ids = allowed[torch.randint(0, len(allowed), (b, n), generator=g)]
    labels = ids.clone()
    labels[:, : n // 5] = -100
    labels[0, n // 2 : n // 2 + 3] = -100
    return {"input_ids": ids, "labels": labels}


def _build(model_type: str, config: Any, attn: str, seed: int, dtype: Any):
    import torch

    torch.manual_seed(seed)
    # float64: the eager MoE experts (the grouped matmul kernels take no float64 on CPU)
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return causal_lm_class(model_type)._from_config(config, attn_implementation=attn, **extra).to(dtype)


def _grads(model) -> list:
    import torch

    return [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().reshape(-1)
        for _, p in model.named_parameters()
    ]


def _report(path: str | None, rank: int, record: dict) -> dict:
    if path:
        with open(f"{path}.{rank}", "w") as f:
            json.dump(record, f)
    return record


class _CountRingCalls:
    """Counts the calls of the registered "ring" attention function while in use: with and without
    the batch's ``ring_context`` (a model that drops its keyword arguments loses the context)."""

    def __init__(self) -> None:
        self.calls = self.with_context = 0

    def __enter__(self) -> _CountRingCalls:
        from transformers import AttentionInterface

        self.original = AttentionInterface._global_mapping["ring"]

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.with_context += kwargs.get("ring_context") is not None
            return self.original(*args, **kwargs)

        AttentionInterface.register("ring", counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register("ring", self.original)


def _reference(model_type: str, variant: str | None, n: int, seed: int, dtype: Any) -> dict:
    """Rank 0: loss, gradients and weights of one step on the whole batch in one process."""
    config = tiny_config(model_type, **variant_kwargs(variant, n))
    batch = _batch(config, 2, n)
    reference = "sdpa"
    try:
        model = _build(model_type, config, "sdpa", seed, dtype)
    except ValueError as e:
        if "does not support an attention implementation" not in str(e):
            raise
        reference = "eager"
        model = _build(model_type, config, "eager", seed, dtype)
    model.train()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    out = {"reference": reference, "loss": float(loss), "grads": _grads(model), "state": model.state_dict()}
    if variant is not None:  # does the variant change the model at all?
        out["variant_effect"] = _variant_effect(model_type, out, batch, reference, seed, dtype)
    return out


def _variant_effect(model_type: str, ref: dict, batch: dict, reference: str, seed: int, dtype: Any) -> float:
    """Relative change of the reference loss between the variant and the plain config (same weights)."""
    base = _build(model_type, tiny_config(model_type), reference, seed, dtype)
    mine = base.state_dict()
    if mine.keys() != ref["state"].keys() or any(mine[k].shape != v.shape for k, v in ref["state"].items()):
        return math.inf  # the variant changes the parameters themselves
    base.load_state_dict(ref["state"])
    base.train()
    base_loss = float(base(**batch, use_cache=False).loss)
    return abs(ref["loss"] - base_loss) / max(abs(base_loss), 1e-30)


def rank_check(
    model_type: str, variant: str | None, n: int, seed: int = 0, report: str | None = None, dtype: str = "float32"
) -> dict:
    """One rank's part of ``check_family`` (run by ``testkit.spawn.run_ranks``). In float64, the
    mixer kernels that compute in float32 whatever their inputs (transformers' gated delta rules)
    are float64 too, in the reference and in the ring run (``testkit.mixers.float64_kernels``)."""
    from contextlib import nullcontext

    from .mixers import float64_kernels

    with float64_kernels() if dtype == "float64" else nullcontext():
        return _rank_check(model_type, variant, n, seed, report, dtype)


def _rank_check(model_type: str, variant: str | None, n: int, seed: int, report: str | None, dtype: str) -> dict:
    import warnings

    import torch
    import torch.distributed as dist

    import hf_ring

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch_dtype = getattr(torch, dtype)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank}

    # 1. the reference: rank 0, the whole batch, one process
    ref: dict[str, Any] = {}
    failed = torch.zeros(1)
    if rank == 0:
        try:
            ref = _reference(model_type, variant, n, seed, torch_dtype)
            out.update({k: ref[k] for k in ("reference", "variant_effect") if k in ref})
        except Exception as e:  # noqa: BLE001 - the family cannot run from input_ids here
            out.update(status="skipped", detail=f"the single-process reference fails: {classify(e)[1]}")
            failed += 1
    dist.broadcast(failed, 0)
    if failed.item():
        return _report(report, rank, out if rank == 0 else out | {"status": "skipped"})

    # 2. ring attention on every rank, its own zigzag shard
    counter = _CountRingCalls()
    try:
        config = tiny_config(model_type, **variant_kwargs(variant, n))
        batch = _batch(config, 2, n)
        model = _build(model_type, config, "ring", seed, torch_dtype)
        if rank == 0:
            model.load_state_dict(ref["state"])
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        dist.broadcast(flat, 0)  # the same weights on every rank, whatever the init does
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
        model.train()
        kwargs = hf_ring.shard_batch(batch)
        context = kwargs["ring_context"]
        with counter:
            loss = model(**kwargs).loss
        # hf_ring's loss resets the context's count: calls left over mean the model computed its own loss
        out["own_loss"] = context.attention_calls > 0
        loss.backward()
        grads = _grads(model)
    except Exception as e:  # noqa: BLE001 - refused or broken
        status, detail = classify(e)
        return _report(
            report,
            rank,
            out
            | {
                "status": status,
                "detail": detail,
                "ring_calls": counter.calls,
                "ring_calls_with_context": counter.with_context,
            },
        )
    out.update(ring_calls=counter.calls, ring_calls_with_context=counter.with_context)

    # 3. compare: the loss on every rank, the CP-averaged gradients on rank 0
    sizes = [g.numel() for g in grads]
    flat = torch.cat(grads) if grads else torch.zeros(0, dtype=torch.float64)
    dist.all_reduce(flat)
    flat /= world
    losses = torch.zeros(world, dtype=torch.float64)
    losses[rank] = float(loss)
    dist.all_reduce(losses)
    if rank != 0:
        return _report(report, rank, out | {"status": "ran"})
    names = [name for name, _ in model.named_parameters()]
    ring_grads = flat.split(sizes)
    norms = [float(r.norm()) for r in ref["grads"]]
    floor = FLOOR * max(norms, default=0.0)
    worst, worst_name = 0.0, ""
    for name, g, r, norm in zip(names, ring_grads, ref["grads"], norms):
        err = float((g - r).norm()) / max(norm, floor, 1e-30)
        if not math.isfinite(err) or err > worst:
            worst, worst_name = (err if math.isfinite(err) else math.inf), name
    ref_loss = ref["loss"]
    loss_err = max(abs(float(x) - ref_loss) / max(abs(ref_loss), 1e-30) for x in losses)
    exact = loss_err <= TOL and worst <= TOL
    detail = f"loss rel err {loss_err:.1e} (ranks {', '.join(f'{float(x):.6f}' for x in losses)} vs {ref_loss:.6f})"
    detail += f"; worst grad rel err {worst:.1e} ({worst_name})" if worst_name else ""
    return _report(
        report,
        rank,
        out
        | {
            "status": "exact" if exact else "wrong",
            "detail": detail,
            "loss_rel_err": loss_err,
            "grad_rel_err": worst,
            "worst_tensor": worst_name,
        },
    )


# ------------------------------------------------------------------------------------------------
# in the calling process


def check_family(
    model_type: str,
    variant: str | None = None,
    n: int = 61,
    cp: int = 2,
    timeout: float = 120.0,
    dtype: str = "float32",
) -> dict:
    """One record: ``{"family", "variant", "status", "detail", "seconds", ...}`` (see the module)."""
    from .spawn import run_ranks

    t0 = time.perf_counter()
    record: dict[str, Any] = {"family": model_type, "variant": variant}
    with tempfile.TemporaryDirectory(prefix="hf_ring_sweep_") as tmp:
        report = os.path.join(tmp, "rank")
        try:
            per_rank = run_ranks(cp, rank_check, model_type, variant, n, report=report, dtype=dtype, timeout=timeout)
        except TimeoutError as e:
            per_rank = _read_reports(report, cp)
            heard = [r for r in per_rank if r and r.get("status") in ("refused", "broken")]
            if heard:  # a rank raised; the others hung in a collective waiting for it
                per_rank = [
                    r | {"detail": f"{r.get('detail', '')} (rank {r.get('rank')}; the others hung)"} for r in heard
                ]
            else:
                per_rank = [{"status": "broken", "detail": f"hung: {str(e).splitlines()[0]}"}]
        except RuntimeError as e:  # a rank died outside rank_check's own handling
            per_rank = [{"status": "broken", "detail": str(e).strip().splitlines()[-1][:300]}]
    record.update(_merge(per_rank, variant))
    errors = (record.get("loss_rel_err", 1.0), record.get("grad_rel_err", 1.0))
    if record["status"] == "wrong" and dtype == "float32" and max(errors) < BORDERLINE:
        # float32 rounding can reach TOL where gradients cancel (q/k norms, say): ask float64
        again = check_family(model_type, variant, n=n, cp=cp, timeout=timeout, dtype="float64")
        if again["status"] == "exact":
            record.update(status="exact", detail=f"float32: {record['detail']}; float64: {again['detail']}")
    record["why"] = explain(record)
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


_DIAGNOSTICS = ("reference", "variant_effect", "own_loss", "ring_calls", "ring_calls_with_context")
NO_EFFECT = 1e-6  # a variant whose reference loss moves less than this (relative) changes nothing


def _merge(per_rank: list[dict | None], variant: str | None) -> dict:
    records = [r for r in per_rank if r]
    rank0 = next((r for r in records if r.get("rank") == 0), {})
    diagnostics = {k: rank0[k] for k in _DIAGNOSTICS if k in rank0}
    for status in ("broken", "refused", "skipped"):
        same = [r for r in records if r.get("status") == status]
        if same:
            first = next((r for r in same if r.get("detail")), same[0])
            out = {"status": status, "detail": first.get("detail", "")}
            ranks = sorted(r["rank"] for r in same if "rank" in r)
            if status != "skipped" and ranks and len(ranks) < len(per_rank):
                out["detail"] += f" (rank {', '.join(map(str, ranks))} only)"
            break
    else:
        out = {k: v for k, v in rank0.items() if k != "rank"}
    out = diagnostics | out
    effect = out.get("variant_effect")
    if variant is not None and effect is not None and effect < NO_EFFECT:
        if out["status"] == "exact":
            out = diagnostics | {
                "status": "skipped",
                "detail": f"the {variant} variant changes nothing in this family (same reference loss as without it)",
            }
        else:
            out["detail"] += f" (the {variant} variant does not change the single-process reference)"
    return out


# ------------------------------------------------------------------------------------------------
# what a record means: the README's "why / what it would need"

_ATTENTION_KINDS = {
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "indexed_attention",
    "attention",
    "global",
    "local",
    "moe",
    "mlp",
    "dense",
    "sparse",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "minimax_m3_sparse",
    "window_attention",
}
_RECURRENT_NAMES = ("linear_attn", "mamba", "conv", "ssm", "recurrent", "rg_lru", "mixer", "rwkv", "lstm")


def _recurrent_kinds(model_type: str) -> list[str]:
    """Layer kinds of the family's tiny config that mix tokens without attention (SSM, linear
    attention, convolutions, recurrent blocks)."""
    try:
        config = tiny_config(model_type).get_text_config()
    except Exception:  # noqa: BLE001
        return []
    kinds: set[str] = set()
    for name in ("layer_types", "layers_block_type", "block_types", "attention_layers"):
        v = getattr(config, name, None)
        if isinstance(v, (list, tuple)):
            kinds.update(str(x) for x in v)
    return sorted(k for k in kinds if k not in _ATTENTION_KINDS)


def explain(record: dict) -> str:
    """One line for the README: why the family has its status, and what exactness would need."""
    status, detail, variant = record["status"], record.get("detail", ""), record.get("variant")
    if variant is not None and record.get("variant_effect", math.inf) < NO_EFFECT:
        variant = None  # the variant changes nothing: the plain family's reason holds
    if status == "exact":
        return ""
    if status == "skipped":
        return detail
    if status == "refused":
        msg = detail.split(": ", 1)[-1]
        if "never called ring attention" in msg:
            if record.get("ring_calls"):
                return (
                    "its decoder layers do not pass keyword arguments on to attention, so the batch's "
                    "ring_context never reaches it and hf_ring's guard refuses; would need the layers to pass "
                    "**kwargs"
                )
            if _recurrent_kinds(record["family"]) or not _has_attention(record["family"]):
                return (
                    "no layer calls transformers' attention registry (a recurrent / state-space model); "
                    "would need a sequence-parallel scan of its own"
                )
            return (
                "computes attention itself, outside transformers' attention registry, so the ring never runs; "
                "would need the model to call the registry"
            )
        if "computes attention itself" in msg:
            return (
                "computes attention outside transformers' attention registry (it used the mask itself); "
                "would need the model to call the registry"
            )
        if "must have the same shape" in msg:
            return (
                "value head dim != qk head dim (MLA); would need V padded to the qk head dim around the ring, "
                "or block kernels with separate qk and v head dims"
            )
        msg = msg.removeprefix('attn_implementation="ring": ').removeprefix('attn_implementation="ring" ')
        return msg.split(". ")[0].rstrip(".")  # hf_ring's own reason, first sentence
    if status == "wrong":
        grad = record.get("grad_rel_err", 0.0)
        loss = record.get("loss_rel_err", 0.0)
        tensor = record.get("worst_tensor", "")
        off = f"loss off by {loss:.0e}, gradients by {grad:.0e}" + (f" ({tensor})" if tensor else "")
        if record.get("ring_calls") == 0:
            return (
                f"{off}: neither its attention nor its loss goes through transformers' registries, so each rank "
                "silently trains on its own shard and no guard fires; would need a refusal (a model that never "
                "calls the ring attention function)"
            )
        if record.get("own_loss"):
            return (
                f"{off}: the model computes its own loss instead of transformers' ForCausalLM loss, so hf_ring "
                "cannot sum it over the CP group (each rank reports its shard's loss); would need the loss "
                "through the registry, or a refusal when a ring batch's loss bypasses it"
            )
        kinds = _recurrent_kinds(record["family"])
        also = f" (and its {', '.join(kinds)} layers see only their shard)" if kinds else ""
        if variant == "router_aux":
            return (
                f"{off}: the router load-balancing loss sees only this rank's tokens{also}; would need router "
                "statistics summed over the CP group"
            )
        if variant == "sliding":
            return (
                f"{off}: the window never reaches the attention function, so the ring attends the whole past{also}; "
                "would need the window passed on (then refused, or a windowed ring schedule)"
            )
        if kinds or any(k in tensor for k in _RECURRENT_NAMES):
            what = ", ".join(kinds) if kinds else "recurrent"
            return (
                f"{off}: its {what} layers mix tokens without attention and see only this rank's shard; "
                "would need their state carried across ranks (a sequence-parallel scan)"
            )
        if "position" in tensor:
            return (
                f"{off}: learned absolute positions that the model numbers its own way (RoBERTa-style from "
                "padding_idx + 1, or from the cache length) instead of the global position_ids shard_batch "
                "passes; would need shard_batch to number them as the model does"
            )
        return off
    return (
        f"{detail}; would need hf_ring to refuse it with RingNotSupported, or support it"
        if status == "broken"
        else detail
    )


def _has_attention(model_type: str) -> bool:
    try:
        config = tiny_config(model_type).get_text_config()
    except Exception:  # noqa: BLE001
        return True
    return any(getattr(config, k, None) for k in ("num_attention_heads", "n_head", "n_heads", "num_heads"))


README_START, README_END = "<!-- models:start -->", "<!-- models:end -->"
_ORDER = {s: i for i, s in enumerate(("wrong", "broken", "refused", "exact", "skipped"))}


def render_table(records: list[dict]) -> str:
    """The README's supported-models section: counts, the exact families in one list, a table of
    the refused (and any wrong or broken) ones with the reason, the skipped ones in one list."""
    from collections import Counter

    def name(r: dict) -> str:
        return r["family"] + (f" ({r['variant']})" if r.get("variant") else "")

    def why(r: dict) -> str:
        text = r.get("why") if r.get("why") is not None else explain(r)
        return text.replace("|", "\\|").replace("\n", " ")

    rows = sorted(records, key=lambda r: (_ORDER.get(r["status"], 9), r["family"], r.get("variant") or ""))
    counts = Counter(r["status"] for r in records)
    lines = [
        "Counts over " + f"{len(records)} family/variant records: "
        + ", ".join(f"{counts[s]} {s}" for s in ("exact", "refused", "wrong", "broken", "skipped") if counts[s]) + ".",
        "",
        "**Exact** (loss and every gradient equal to one process within 1e-5, fp32, CP = 2): "
        + ", ".join(name(r) for r in rows if r["status"] == "exact") + ".",
        "",
        "| refused: family (variant) | why (hf_ring's error) |",
        "|---|---|",
    ]
    for r in rows:
        if r["status"] in ("refused", "wrong", "broken"):
            flag = "" if r["status"] == "refused" else f"**{r['status'].upper()}** "
            lines.append(f"| {name(r)} | {flag}{why(r)} |")
    lines += ["", "Not swept: " + "; ".join(f"{name(r)} ({why(r)})" for r in rows if r["status"] == "skipped") + "."]
    return "\n".join(lines) + "\n"
