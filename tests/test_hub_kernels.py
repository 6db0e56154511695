"""The ``kernels`` hub under context parallelism (transformers >= 5.25 loads models with
``use_kernels`` on where ``kernels`` is installed). ``kernelize`` replaces a layer's forward, or a
function the layer calls (its private ``_kernel_funcs``), with ``kernels``' own ``_replace_forward``
(``kernels/_internals/layer/layer.py``); these tests call that function as ``kernelize`` does, with
stand-in hub layers that compute what transformers' torch functions compute.

A hub kernel behind a function hf_ring routes (the chunked delta rule, the short convolution) is
the local compute of its context-parallel form: the run stays exact. A hub kernel in place of a
token mixer, or of a mixer's function around the routed ones, is refused at the first sharded
forward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("kernels")

import hf_ring  # noqa: E402
from hf_ring.errors import RingNotSupported  # noqa: E402
from testkit.families import causal_lm_class, tiny_config  # noqa: E402
from testkit.models import tiny_batch  # noqa: E402
from testkit.oracle import rel_err  # noqa: E402
from testkit.spawn import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _hub_layer(base: type, body) -> type:  # noqa: ANN001
    """A hub layer class derived from ``base`` whose forward runs ``body``, as ``kernelize`` swaps it in."""

    class HubLayer(base):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return body(self, *args, **kwargs)

    return HubLayer


def _kernelize(model: torch.nn.Module, what: str) -> None:
    """Put a stand-in hub kernel where ``kernelize`` would: on every Gated DeltaNet layer (``"layer"``),
    or on its private wrapper of the function ``what``."""
    from kernels._internals.layer.layer import _replace_forward

    for sub in model.modules():
        if type(sub).__name__ != "Qwen3_5GatedDeltaNet":
            continue
        target = sub if what == "layer" else sub._kernel_funcs[what]
        base = type(target) if what == "layer" else torch.nn.Module
        _replace_forward(target, _hub_layer(base, type(target).forward), repo="kernels-community/stand-in")


def run(what: str) -> dict:
    torch.manual_seed(0)
    config = tiny_config("qwen3_5_text")
    cls = causal_lm_class("qwen3_5_text")
    ref = cls._from_config(tiny_config("qwen3_5_text"), attn_implementation="sdpa").double()
    model = cls._from_config(config, attn_implementation="ring").double()
    model.load_state_dict(ref.state_dict())
    batch = tiny_batch(1, 37, vocab=config.vocab_size)
    plain = model(**hf_ring.shard_batch(batch)).loss.detach()
    _kernelize(model, what)
    try:
        loss = model(**hf_ring.shard_batch(batch)).loss.detach()
    except RingNotSupported as e:
        return {"refused": str(e)}
    # the Gated DeltaNet kernels compute in float32 whatever the input: 1e-7 from the float64 reference
    return {"vs_plain": rel_err(loss, plain), "vs_one_process": rel_err(loss, ref(**batch).loss.detach())}


@pytest.mark.parametrize("what", ["chunk_gated_delta_rule", "causal_conv1d_fn", "fused_recurrent_gated_delta_rule"])
def test_hub_kernel_behind_a_routed_function_stays_exact(what: str) -> None:
    for r in run_ranks(2, run, what):
        assert "refused" not in r, r
        assert r["vs_plain"] == 0 and r["vs_one_process"] < 1e-6, r


@pytest.mark.parametrize("what", ["layer", "causal_conv1d_forward"])
def test_hub_kernel_in_place_of_a_mixer_is_refused(what: str) -> None:
    for r in run_ranks(2, run, what):
        name = "Qwen3_5GatedDeltaNet" if what == "layer" else f"Qwen3_5GatedDeltaNet's {what}"
        assert "hub kernel" in r.get("refused", "") and name in r["refused"] and "use_kernels=False" in r["refused"], r
