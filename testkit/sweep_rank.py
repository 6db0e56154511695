"""One rank's part of a family sweep (``testkit.sweep.check_family``): the family's tiny model in one
process for reference (rank 0), then with ``attn_implementation="ring"`` on this rank's shard, on the
three paths (``labelled``, ``unlabelled``, ``chunked``), each compared with the reference or
classified as refused or broken (``classify``). Runs under ``testkit.spawn.run_ranks``; returns plain
values and writes its record to a file after every path (``report``).
"""

from __future__ import annotations

import json
import math
import traceback
from typing import Any

from .families import causal_lm_class, tiny_config
from .sweep_table import PATHS

__all__ = ["FLOOR", "TOL", "build_model", "classify", "rank_check", "sweep_batch", "variant_kwargs"]

TOL = 1e-5
FLOOR = 1e-3  # near-zero gradients: error relative to FLOOR x the largest gradient norm


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
    """``package/path:line`` of the frame that raised, when it lies inside hf_ring's, transformers' or torch's
    package directory (``testkit.frames``: not a folder name in the path, which a checkout named ``hf_ring``
    puts in every path), else the file's name."""
    import importlib

    from .frames import package_dir, package_path

    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    for package in ("hf_ring", "transformers", "torch"):
        where = package_path(f.filename, package_dir(importlib.import_module(package)))
        if where is not None:
            return f"{where}:{f.lineno}"
    return f"{f.filename.replace(chr(92), '/').rsplit('/', 1)[-1]}:{f.lineno}"


def sweep_batch(config: Any, b: int, n: int, seed: int = 1) -> dict:
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


def build_model(model_type: str, config: Any, attn: str, seed: int, dtype: Any):
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
    """Rank 0: loss, gradients and weights of one step on the whole batch in one process, and the
    logits of a prefill of its input ids (evaluation mode)."""
    import torch

    config = tiny_config(model_type, **variant_kwargs(variant, n))
    batch = sweep_batch(config, 2, n)
    reference = "sdpa"
    try:
        model = build_model(model_type, config, "sdpa", seed, dtype)
    except ValueError as e:
        if "does not support an attention implementation" not in str(e):
            raise
        reference = "eager"
        model = build_model(model_type, config, "eager", seed, dtype)
    model.train()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    out = {"reference": reference, "loss": float(loss), "grads": _grads(model), "state": model.state_dict()}
    model.eval()
    with torch.no_grad():
        out["logits"] = model(input_ids=batch["input_ids"], use_cache=False).logits.double()
    if variant is not None:  # does the variant change the model at all?
        out["variant_effect"] = _variant_effect(model_type, out, batch, reference, seed, dtype)
    return out


def _variant_effect(model_type: str, ref: dict, batch: dict, reference: str, seed: int, dtype: Any) -> float:
    """Relative change of the reference loss between the variant and the plain config (same weights)."""
    base = build_model(model_type, tiny_config(model_type), reference, seed, dtype)
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
    are float64 too, and every float32 cast of a float64 tensor is left out (``widened_casts``), in
    the reference and in the ring run."""
    from contextlib import ExitStack

    from .mixers import float64_kernels, widened_casts

    with ExitStack() as stack:
        if dtype == "float64":
            stack.enter_context(float64_kernels())
            stack.enter_context(widened_casts())
        return _rank_check(model_type, variant, n, seed, report, dtype)


def _step(model: Any, batch: dict, counter: _CountRingCalls) -> tuple[float, list, bool]:
    """One ring training step on this rank's shard: (loss, gradients, whether the model computed
    its loss itself -- the ring ran, but the model's ``loss_function`` was never called)."""
    import hf_ring

    model.zero_grad(set_to_none=True)
    kwargs = hf_ring.shard_batch(batch)
    context = kwargs["ring_context"]
    loss_function, losses = model.__dict__.get("_loss_function"), []
    if loss_function is not None:
        model._loss_function = lambda *args, **kw: losses.append(1) or loss_function(*args, **kw)
    try:
        with counter:
            loss = model(**kwargs).loss
    finally:
        if loss_function is not None:
            model._loss_function = loss_function
    own_loss = context.cross_rank_calls.total > 0 and not losses
    loss.backward()
    return float(loss), _grads(model), own_loss


def _prefill(model: Any, ids: Any, n: int) -> Any:
    """The logits ``[B, n, V]`` of a ring prefill of ``ids``, gathered from the CP group."""
    import torch

    import hf_ring

    model.eval()
    try:
        kwargs = hf_ring.shard_batch({"input_ids": ids})
        with torch.no_grad():
            logits = model(**kwargs).logits
        return kwargs["ring_context"].unshard(logits)[:, :n].double()
    finally:
        model.train()


def _compare_step(ref: dict, names: list[str], loss: float, grads: list) -> dict | None:
    """The CP-averaged gradients and every rank's loss against the reference (collectives on every
    rank; the record on rank 0, ``None`` elsewhere)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [g.numel() for g in grads]
    flat = torch.cat(grads) if grads else torch.zeros(0, dtype=torch.float64)
    dist.all_reduce(flat)
    flat /= world
    losses = torch.zeros(world, dtype=torch.float64)
    losses[rank] = loss
    dist.all_reduce(losses)
    if rank != 0:
        return None
    norms = [float(r.norm()) for r in ref["grads"]]
    floor = FLOOR * max(norms, default=0.0)
    worst, worst_name = 0.0, ""
    for name, g, r, norm in zip(names, flat.split(sizes), ref["grads"], norms):
        err = float((g - r).norm()) / max(norm, floor, 1e-30)
        if not math.isfinite(err) or err > worst:
            worst, worst_name = (err if math.isfinite(err) else math.inf), name
    ref_loss = ref["loss"]
    loss_err = max(abs(float(x) - ref_loss) / max(abs(ref_loss), 1e-30) for x in losses)
    detail = f"loss rel err {loss_err:.1e} (ranks {', '.join(f'{float(x):.6f}' for x in losses)} vs {ref_loss:.6f})"
    detail += f"; worst grad rel err {worst:.1e} ({worst_name})" if worst_name else ""
    return {
        "status": "exact" if loss_err <= TOL and worst <= TOL else "wrong",
        "detail": detail,
        "loss_rel_err": loss_err,
        "grad_rel_err": worst,
        "worst_tensor": worst_name,
    }


def _compare_logits(ref: dict, logits: Any) -> dict:
    err = float((logits - ref["logits"]).norm() / max(float(ref["logits"].norm()), 1e-30))
    status = "exact" if err <= TOL else "wrong"
    return {"status": status, "detail": f"logits rel err {err:.1e}", "logits_rel_err": err}


def _rank_check(model_type: str, variant: str | None, n: int, seed: int, report: str | None, dtype: str) -> dict:
    import warnings

    import torch
    import torch.distributed as dist

    import hf_ring

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch_dtype = getattr(torch, dtype)
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank, "dtype": dtype}

    # 1. the reference: rank 0, the whole batch, one process
    ref: dict[str, Any] = {}
    failed = torch.zeros(1)
    if rank == 0:
        try:
            ref = _reference(model_type, variant, n, seed, torch_dtype)
            out.update({k: ref[k] for k in ("reference", "variant_effect") if k in ref})
        except Exception as e:  # noqa: BLE001 - the family cannot run from input_ids here
            skip = {"status": "skipped", "detail": f"the single-process reference fails: {classify(e)[1]}"}
            out.update({path: skip for path in PATHS})
            failed += 1
    dist.broadcast(failed, 0)
    if failed.item():
        return _report(report, rank, out if rank == 0 else out | {p: {"status": "skipped"} for p in PATHS})

    # 2. the same model with ring attention on every rank, its own zigzag shard, on each path
    counter = _CountRingCalls()
    try:
        config = tiny_config(model_type, **variant_kwargs(variant, n))
        batch = sweep_batch(config, 2, n)
        model = build_model(model_type, config, "ring", seed, torch_dtype)
        if rank == 0:
            model.load_state_dict(ref["state"])
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        dist.broadcast(flat, 0)  # the same weights on every rank, whatever the init does
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
        model.train()
        names = [name for name, _ in model.named_parameters()]
    except Exception as e:  # noqa: BLE001 - refused or broken at build
        status, detail = classify(e)
        return _report(report, rank, out | {path: {"status": status, "detail": detail} for path in PATHS})

    def run(path: str, compute: Any, compare: Any) -> None:
        try:
            out[path] = compare(compute()) or {"status": "ran"}  # the comparison: on rank 0
        except Exception as e:  # noqa: BLE001 - refused or broken
            status, detail = classify(e)
            out[path] = {"status": status, "detail": detail}
        _report(report, rank, out)

    def labelled() -> tuple:
        loss, grads, own = _step(model, batch, counter)
        out["own_loss"] = own
        return loss, grads

    def chunked() -> tuple:
        hf_ring.enable_chunked_loss(model)
        return _step(model, batch, _CountRingCalls())[:2]

    run("labelled", labelled, lambda r: _compare_step(ref, names, *r))
    out.update(ring_calls=counter.calls, ring_calls_with_context=counter.with_context)
    ids = batch["input_ids"]
    run("unlabelled", lambda: _prefill(model, ids, n), lambda logits: _compare_logits(ref, logits) if ref else None)
    run("chunked", chunked, lambda r: _compare_step(ref, names, *r))
    return _report(report, rank, out)
