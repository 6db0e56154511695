"""What each attention layer of a family asks of a block kernel, at the family's default head dims.

``layer_requests(model_type)`` builds the family's tiny model (``testkit.families.tiny_config``, with a
sliding window shorter than the test sequence where the family has one) but with the head dims of its
default config (Gemma 4's full-attention layers: ``head_dim`` 512), runs one forward through
``attn_implementation="ring"`` in one process on a ``shard_batch`` batch (a CP group of one, so the
ring's block kernels run; without ``shard_batch`` the call takes the one-process path), and records
what every attention call asked ``get_kernel`` for: ``(head_dim, softcap, window, sinks)``. ``None``
when the family does not run through the ring (refused, or no attention layer).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

from .config_fields import HEAD_DIM, WIDTH
from .families import _config_class, _default, tiny_config, variants

__all__ = ["LayerRequest", "layer_requests"]

_MLA = ("qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "global_head_dim")
N = 32  # tokens of the test sequence; the sliding variant's window is N // 4


@dataclass(frozen=True)
class LayerRequest:
    """One attention layer's call: the head dim its kernel sees, soft-capping, band blocks, sinks."""

    head_dim: int
    softcap: bool
    window: bool
    sinks: bool


def _head_dims(model_type: str) -> dict[str, Any]:
    """``tiny_config`` fields that put the default config's head dims back (explicit fields, per-layer
    ones, or a width that gives the derived ``hidden_size / num_attention_heads``)."""
    cls = _config_class(model_type)
    default = _default(cls).to_dict()
    tiny = tiny_config(model_type).to_dict()
    out: dict[str, Any] = {f: default[f] for f in (*HEAD_DIM, *_MLA) if isinstance(default.get(f), int) and f in tiny}
    plc, mine = default.get("per_layer_config"), tiny.get("per_layer_config") or {}
    n = tiny.get("num_hidden_layers")
    if isinstance(plc, dict) and isinstance(n, int):  # heterogeneous layers: {"05": {"head_dim": 512}, ...}
        out["per_layer_config"] = {
            k: {**mine.get(k, {}), **{f: v[f] for f in (*HEAD_DIM, *_MLA) if isinstance(v.get(f), int)}}
            for k, v in plc.items()
            if isinstance(v, dict) and int(k) < n
        }
    if "head_dim" not in out and "num_attention_heads" in default and isinstance(default.get("hidden_size"), int):
        heads = default["num_attention_heads"]
        if isinstance(heads, int) and heads and default["hidden_size"] % heads == 0 and "hidden_size" in WIDTH:
            out["hidden_size"] = tiny["num_attention_heads"] * (default["hidden_size"] // heads)
    return out


@functools.cache
def layer_requests(model_type: str) -> tuple[LayerRequest, ...] | None:
    """Every attention call's request of one forward of ``model_type`` at its default head dims (at the
    tiny config's where the family's config does not take its default head dims with the tiny widths)."""
    sliding = {"sliding": N // 4} if "sliding" in variants(model_type) else {}
    try:
        return _requests(model_type, {**sliding, **_head_dims(model_type)})
    except _Broken:
        return _requests(model_type, sliding)


class _Broken(Exception):
    """The model does not build or run with these fields."""


def _requests(model_type: str, fields: dict[str, Any]) -> tuple[LayerRequest, ...] | None:
    import torch

    import hf_ring  # noqa: F401 - registers "ring"
    from hf_ring import shard_batch
    from hf_ring.ops import ring
    from hf_ring.transformers.support import RingNotSupported

    from .sweep_rank import build_model, sweep_batch

    seen: list[LayerRequest] = []
    sinks = [False]
    originals = {name: getattr(ring, name) for name in ("get_kernel", "check_extras")}

    def extras(q, softcap, s, *who):  # noqa: ANN001, ANN202
        sinks[0] = s is not None
        return originals["check_extras"](q, softcap, s, *who)

    def pick(backend, device, dtype, softcap=False, window=False, head_dim=None):  # noqa: ANN001, ANN202
        seen.append(LayerRequest(int(head_dim), bool(softcap), bool(window), sinks[0]))
        return originals["get_kernel"](backend, device, dtype, softcap, window, head_dim)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(model_type, **fields)
            model = build_model(model_type, config, "ring", 0, torch.float32)
            ring.get_kernel, ring.check_extras = pick, extras  # type: ignore[attr-defined]
            with torch.no_grad():
                model(**shard_batch(sweep_batch(config, 1, N)))  # one process, one shard: through the ring
        except RingNotSupported:
            return None
        except Exception as e:  # noqa: BLE001 - the caller tries the plain tiny config
            raise _Broken(f"{model_type}: {type(e).__name__}: {e}") from e
        finally:
            for name, fn in originals.items():
                setattr(ring, name, fn)
    return tuple(seen) or None
