"""The family sweep's multimodal families (``Gemma3ForConditionalGeneration`` and the others the
text sweep skips: ``testkit.families.skipped``) run with image inputs at CP = ``cp``.

``check_images(model_type)`` returns a sweep record (``testkit.sweep``'s format, variant ``"images"``)
on the three paths: a family hf_ring cuts at its text decoder's entry (``MULTIMODAL``: its tiny model of
``testkit.vlm``; Gemma 3 with its processor's ``token_type_ids``, so each image attends to itself both
ways) must be exact against one process -- the training step's loss and every gradient,
the vision encoder's included; the prefill's logits; the step with ``enable_chunked_loss`` -- and every
other family must refuse a batch with ``pixel_values`` (``RingNotSupported``), classified by
``testkit.sweep_rank.classify``.
"""

from __future__ import annotations

import time
from typing import Any

from .sweep_rank import TOL, classify
from .sweep_table import PATHS

__all__ = ["MULTIMODAL", "check_images", "images_rank"]

MULTIMODAL = {"gemma3": "gemma3"}  # sweep model type -> family of testkit.vlm
ROWS = [[("text", 9), ("image", 4), ("text", 14), ("image", 4), ("text", 6)], [("text", 11), ("image", 4), ("text", 8)]]


def _rel(x: Any, ref: Any) -> float:
    return float((x.double() - ref.double()).norm() / max(float(ref.double().norm()), 1e-300))


def _exact(model_type: str) -> dict:
    import torch
    import torch.distributed as dist

    import hf_ring
    from testkit.vlm import IMAGE, as_images, qwen_batch, tiny_model

    family = MULTIMODAL[model_type]
    batch = as_images(qwen_batch(ROWS))
    batch["token_type_ids"] = (batch["input_ids"] == IMAGE).long()  # as Gemma 3's processor: bidirectional images
    ref_model, model = tiny_model(family, "sdpa"), tiny_model(family, "ring")
    ref_model.train()
    ref = ref_model(**batch)
    ref.loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    scale = max(float(g.norm()) for g in ref_grads.values())

    def step() -> dict:
        model.zero_grad()
        model.train()
        loss = model(**hf_ring.shard_batch(batch)).loss
        loss.backward()
        worst = 0.0
        for n, p in model.named_parameters():
            if n in ref_grads:
                g = p.grad.double()
                dist.all_reduce(g)
                err = float((g / dist.get_world_size() - ref_grads[n]).norm()) / (float(ref_grads[n].norm()) or scale)
                worst = max(worst, err)
        return _status(max(_rel(loss.detach(), ref.loss.detach()), worst), "loss and every gradient")

    def prefill() -> dict:
        model.eval()
        ref_model.eval()
        with torch.no_grad():
            want = ref_model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            kwargs = hf_ring.shard_batch({k: v for k, v in batch.items() if k != "labels"})
            logits = kwargs["ring_context"].unshard(model(**kwargs).logits)[:, : want.shape[1]]
        real = batch["attention_mask"].bool()
        return _status(_rel(logits[real], want[real]), "logits")

    def chunked() -> dict:
        hf_ring.enable_chunked_loss(model)
        return step()

    return _paths({"labelled": step, "unlabelled": prefill, "chunked": chunked})


def _status(err: float, what: str) -> dict:
    return {"status": "exact" if err <= TOL else "wrong", "detail": f"{what}: relative error {err:.1e}", "err": err}


def _refused(model_type: str) -> dict:
    import torch
    from transformers import CONFIG_MAPPING

    import hf_ring
    from testkit.families import causal_lm_class
    from testkit.sweep_rank import sweep_batch

    def run() -> dict:
        # the refusal comes before the forward computes anything: the default config on the meta device
        config = CONFIG_MAPPING[model_type]()
        try:
            with torch.device("meta"):
                model = causal_lm_class(model_type)._from_config(config, attn_implementation="ring")
        except ImportError as e:  # a library the model needs is not installed here
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            return {"status": "skipped", "detail": f"cannot be built here: {first[:150]}"}
        batch = sweep_batch(config, 2, 61) | {"pixel_values": torch.zeros(2, 3, 8, 8)}
        model(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in hf_ring.shard_batch(batch).items()})
        return {"status": "wrong", "detail": "a batch with image inputs ran without hf_ring cutting it"}

    return _paths({path: run for path in PATHS})


def _paths(runs: dict) -> dict:
    out = {}
    for path, run in runs.items():
        try:
            out[path] = run()
        except Exception as e:  # noqa: BLE001 - refused or broken
            status, detail = classify(e)
            out[path] = {"status": status, "detail": detail}
    return out


def images_rank(model_type: str) -> dict:
    """On every rank: each path's status (``_exact`` or ``_refused``)."""
    import warnings

    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    return _exact(model_type) if model_type in MULTIMODAL else _refused(model_type)


def check_images(model_type: str, cp: int = 2, timeout: float = 120.0) -> dict:
    """The sweep record of a multimodal family run with image inputs at CP = ``cp``."""
    from testkit.spawn import run_ranks

    t0 = time.perf_counter()
    try:
        per_rank = run_ranks(cp, images_rank, model_type, timeout=timeout)
        order = ("wrong", "broken", "refused", "exact", "skipped")
        paths = {p: max((r[p] for r in per_rank), key=lambda s: -order.index(s["status"])) for p in PATHS}
    except Exception as e:  # noqa: BLE001 - hung or crashed ranks
        paths = {p: {"status": "broken", "detail": f"{type(e).__name__}: {str(e)[:200]}"} for p in PATHS}
    record = {"family": model_type, "variant": "images", **paths["labelled"]}
    return record | {"unlabelled": paths["unlabelled"], "chunked": paths["chunked"],
                     "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip
