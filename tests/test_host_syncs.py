"""No synchronising host<->device copy inside a hybrid layer: once a batch's plans exist (the first
step made them, ``RingContext.cached``), a training step of each hybrid family at CP = 2 on packed
documents makes no call that would make a CUDA stream wait (``testkit.host_syncs``: host data made
into tensors, ``.to(device)``, ``.item()`` / ``.tolist()`` / ``bool()``, data-dependent shapes)
in hf_ring's mixer code, forward and backward (custom Functions and checkpoint recomputes included)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.transformers import mixers
from testkit.families import causal_lm_class, tiny_config
from testkit.host_syncs import HostSyncs, backward
from testkit.spawn import run_ranks

MIXER_CODE = ("hf_ring/ops/mixers/", "hf_ring/ops/exchange.py", "hf_ring/ops/state_passing.py",
              "hf_ring/transformers/mixers.py")  # fmt: skip
DOCS = [1, 2, 9, 1, 14, 2, 1, 7, 3]  # 40 tokens: documents cross chunks and ranks at CP = 2
FAMILIES = {  # model type -> the hybrid layer it has (Gated DeltaNet, Mamba2 / SSD, Mamba, conv, ...)
    "qwen3_5_text": "gated_deltanet",
    "nemotron_h": "mamba2_ssd",
    "jamba": "mamba_selective",
    "lfm2": "short_conv",
    "minimax": "lightning",
    "recurrent_gemma": "rg_lru",
}


def mixer_layers(model: torch.nn.Module, model_type: str) -> int:
    module = sys.modules[causal_lm_class(model_type).__module__]
    cls = mixers.MIXER_FAMILIES[module.__name__.removeprefix("transformers.models.")].classes[0]
    return sum(type(m).__name__ == cls for m in model.modules())


def step_syncs(model_type: str) -> dict:
    """On every rank: the synchronising calls of one training step after a first one, by call site."""
    torch.manual_seed(0)
    config = tiny_config(model_type)
    model = causal_lm_class(model_type)._from_config(config, attn_implementation="ring").train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.get_text_config().vocab_size, (1, sum(DOCS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    kwargs = hf_ring.shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": positions})
    model(**kwargs).loss.backward()  # the first step makes the batch's plans
    with HostSyncs() as syncs:
        backward(model(**kwargs).loss)
    found = syncs.count(*MIXER_CODE)
    return {
        "layers": mixer_layers(model, model_type),
        "mixer_syncs": sum(found.values()),
        "sites": sorted(f"{kind} {fn} {site.split('hf_ring/')[-1]} x{n}" for (kind, fn, site), n in found.items()),
        "rank": dist.get_rank(),
    }


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_no_host_sync_inside_a_hybrid_layer(model_type: str) -> None:
    for r in run_ranks(2, step_syncs, model_type):
        assert r["layers"] > 0, r
        assert r["mixer_syncs"] == 0, r
