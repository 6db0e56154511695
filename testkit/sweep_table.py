"""What a sweep record means: the "why / what it would need" of docs/models.md, and its table.

``explain(record)`` gives one line for a record (or for one path of it, ``path_record``);
``render_table(records)`` docs/models.md's supported-models section, generated from
``docs/models.json`` by ``scripts/sweep_models.py``: counts per path, the families exact on every
path, a table of the others with each path's status and the reason.
"""

from __future__ import annotations

import math

from .families import tiny_config

__all__ = ["PATHS", "explain", "path_record", "render_table"]

NO_EFFECT = 1e-6  # a variant whose reference loss moves less than this (relative) changes nothing
# the three paths every family is judged on: the record's own fields are the labelled path's
PATHS = ("labelled", "unlabelled", "chunked")
_DIAGNOSTICS = ("reference", "variant_effect", "own_loss", "ring_calls", "ring_calls_with_context", "dtype")


def path_record(record: dict, path: str) -> dict:
    """One path of a record, as a record of its own (family, variant and diagnostics included)."""
    if path == "labelled":
        return record
    sub = record.get(path)
    if sub is None:  # a record of the reference alone (skipped), or of an older sweep
        skipped = record["status"] == "skipped"
        detail = record.get("detail", "") if skipped else "not run"
        sub = {"status": "skipped" if skipped else "broken", "detail": detail}
    same = {k: record[k] for k in ("family", "variant", *_DIAGNOSTICS) if k in record}
    return same | sub


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
    """One line of the table: why the family has its status, and what exactness would need."""
    status, detail, variant = record["status"], record.get("detail", ""), record.get("variant")
    if variant is not None and record.get("variant_effect", math.inf) < NO_EFFECT:
        variant = None  # the variant changes nothing: the plain family's reason holds
    if status == "exact":
        return ""
    if status == "skipped":
        return detail
    if status == "refused":
        msg = detail.split(": ", 1)[-1]
        if "never ran ring attention" in msg:
            if record.get("ring_calls"):
                return (
                    "its decoder layers do not pass keyword arguments on to attention, so the batch's "
                    "ring_context never reaches it and hf_ring's guard refuses; would need the layers to pass "
                    "**kwargs"
                )
            if _recurrent_kinds(record["family"]) or _mixers(record["family"]) or not _has_attention(record["family"]):
                return (
                    "no layer calls transformers' attention registry and its token mixer (recurrent / state-space) "
                    "has no context-parallel form in hf_ring; would need a sequence-parallel scan of its own"
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
        if "logits_rel_err" in record:
            off = f"prefill logits off by {record['logits_rel_err']:.0e}"
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


def _mixers(model_type: str) -> bool:
    """The family's modeling module has token-mixing classes outside attention (by name: RWKV, xLSTM, ...)."""
    from hf_ring.transformers.support import sequence_mixers

    from .families import causal_lm_class

    cls = causal_lm_class(model_type)
    return cls is not None and bool(sequence_mixers(cls.__module__))


def _has_attention(model_type: str) -> bool:
    try:
        config = tiny_config(model_type).get_text_config()
    except Exception:  # noqa: BLE001
        return True
    return any(getattr(config, k, None) for k in ("num_attention_heads", "n_head", "n_heads", "num_heads"))


_ORDER = {s: i for i, s in enumerate(("wrong", "broken", "refused", "exact", "skipped"))}
_STATUSES = ("exact", "refused", "wrong", "broken", "skipped")
_PATH_NAMES = {
    "labelled": "labelled loss and gradients",
    "unlabelled": "unlabelled logits (prefill)",
    "chunked": "loss and gradients with the chunked loss",
}


def render_table(records: list[dict]) -> str:
    """docs/models.md's supported-models section: counts per path, the families exact on every path in
    one list, a table of the others (each path's status and the reason), the skipped ones in one list."""
    from collections import Counter

    def name(r: dict) -> str:
        return r["family"] + (f" ({r['variant']})" if r.get("variant") else "")

    def why(r: dict) -> str:
        text = r.get("why") if r.get("why") is not None else explain(r)
        return text.replace("|", "\\|").replace("\n", " ")

    def cell(status: str) -> str:
        return status if status in ("exact", "refused", "skipped") else f"**{status.upper()}**"

    paths = {id(r): [path_record(r, p) for p in PATHS] for r in records}
    worst = {id(r): min(_ORDER.get(p["status"], 9) for p in paths[id(r)]) for r in records}
    rows = sorted(records, key=lambda r: (worst[id(r)], r["family"], r.get("variant") or ""))
    counts = {p: Counter(path_record(r, p)["status"] for r in records) for p in PATHS}
    every = [r for r in rows if all(p["status"] == "exact" for p in paths[id(r)])]
    wide = sorted({r["family"] for r in records if r.get("dtype") == "float64"})
    lines = [
        f"Counts over {len(records)} family/variant records, per path: "
        + "; ".join(
            f"{_PATH_NAMES[p]}: " + ", ".join(f"{counts[p][s]} {s}" for s in _STATUSES if counts[p][s]) for p in PATHS
        )
        + ".",
        "",
        "**Exact on every path** (at CP = 2 against one process, within 1e-5 relative, fp32: the loss and every "
        "gradient with labels, the logits without labels, and the loss and every gradient again with the chunked "
        "loss on): " + ", ".join(name(r) for r in every) + ".",
        "",
    ]
    if wide:
        lines += [
            "Judged in float64: " + ", ".join(wide) + ". Their Gated DeltaNet kernels and gated RMSNorm in "
            "transformers compute in float32 whatever the input, so the gradients of the decay parameters "
            "(A_log, dt_bias) carry about 1e-4 of cancellation error even in one float32 process; the sweep runs "
            "these families in float64 with those float32 casts widened (in the test harness only), the ring "
            "and the one-process reference alike.",
            "",
        ]
    lines += ["| family (variant) | labelled | unlabelled | chunked | why (hf_ring's error, or what differs) |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        parts = paths[id(r)]
        if all(p["status"] in ("exact", "skipped") for p in parts):
            continue
        reasons: list[str] = []
        for p in parts:
            if p["status"] not in ("exact", "skipped") and why(p) not in reasons:
                reasons.append(why(p))
        text = " / ".join(reasons)
        lines.append(f"| {name(r)} | " + " | ".join(cell(p["status"]) for p in parts) + f" | {text} |")
    lines += ["", "Not swept: " + "; ".join(f"{name(r)} ({why(r)})" for r in rows if r["status"] == "skipped") + "."]
    return "\n".join(lines) + "\n"
