"""Llama 4's NoPE temperature tuning from global positions (hf_ring/transformers/temperature.py).

A tiny Llama 4 text model whose layer 1 is a NoPE layer (``no_rope_layers=[1, 0]``, an int as
transformers stores it) with ``attn_temperature_tuning`` and ``floor_scale = 4``, so the query
temperature changes every 4 tokens across a sequence of 61: one training step at CP = world against
one process with sdpa, all in float64 (loss on every rank and every gradient), also as Ulysses 2 x
ring 2; packed documents against each document alone; without shard_batch (no ring_context) computed as one process.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_ring
from testkit.models import cp_grad_error, documents_alone_loss, tiny_batch
from testkit.spawn import run_ranks

CONFIG = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, attention_chunk_size=128,
    no_rope_layers=[1, 0], floor_scale=4, attn_scale=1.0, attn_temperature_tuning=True, max_position_embeddings=256,
    initializer_range=0.2,
)  # fmt: skip
N = 61  # not a multiple of 2P; 15 temperature steps
DOCS = [3, 17, 9, 26, 6]  # one packed row of 61 tokens


def build(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama4_text", **CONFIG)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, experts_implementation="eager")
    return model.to(torch.float64)


def step_errors(ulysses: int = 1) -> dict[str, float]:
    if ulysses > 1:
        hf_ring.setup_context_parallel(torch.distributed.get_world_size(), ulysses_size=ulysses)
    batch = tiny_batch(2, N)
    ring, ref = build("ring"), build("sdpa")
    out = ring(**hf_ring.shard_batch(batch))
    out.loss.backward()
    want = ref(**batch).loss
    want.backward()
    return {"loss": abs(out.loss.item() - want.item()) / want.item(), "grads": cp_grad_error(ring, ref)}


def temperature_changes_the_loss() -> float:
    """The oracle itself depends on the temperature (else the test above would prove nothing)."""
    batch = tiny_batch(2, N)
    on = build("sdpa")(**batch).loss.item()
    CONFIG["attn_temperature_tuning"] = False
    try:
        off = build("sdpa")(**batch).loss.item()
    finally:
        CONFIG["attn_temperature_tuning"] = True
    return abs(on - off) / abs(off)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_temperature_tuning_is_exact(world: int) -> None:
    assert temperature_changes_the_loss() > 1e-3
    for r in run_ranks(world, step_errors):
        assert r["loss"] <= 1e-6 and r["grads"] <= 1e-6, r


def test_temperature_tuning_is_exact_with_ulysses() -> None:
    """CP 4 as Ulysses 2 x ring 2: each rank's rows are a contiguous piece of its ring position's shard."""
    for r in run_ranks(4, step_errors, 2):
        assert r["loss"] <= 1e-6 and r["grads"] <= 1e-6, r


def autocast_errors() -> dict[str, float]:
    """float32 weights under bf16 autocast: ring at CP = world and one-process sdpa under the same
    autocast, each against the float64 model."""
    batch = tiny_batch(2, N)
    want = build("sdpa")(**batch).loss.item()
    ring, sdpa = build("ring").float(), build("sdpa").float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ring(**hf_ring.shard_batch(batch)).loss.item()
        base = sdpa(**batch).loss.item()
    return {"ring": abs(got - want) / want, "sdpa": abs(base - want) / want}


def test_temperature_tuning_under_bf16_autocast() -> None:
    for r in run_ranks(2, autocast_errors):
        assert r["ring"] <= 2 * r["sdpa"] + 1e-3, r


def packed_errors() -> dict[str, float]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (1, sum(DOCS)), generator=g)
    labels = ids.clone()
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    ring, ref = build("ring"), build("sdpa")
    out = ring(**hf_ring.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions}))
    out.loss.backward()
    want = documents_alone_loss(ref, ids, labels, DOCS)
    want.backward()
    return {"loss": abs(out.loss.item() - want.item()) / want.item(), "grads": cp_grad_error(ring, ref)}


@pytest.mark.parametrize("world", [1, 3])
def test_packed_documents_get_their_own_temperatures(world: int) -> None:
    """Each document's queries are scaled by their position in the document, as if it ran alone."""
    for r in run_ranks(world, packed_errors):
        assert r["loss"] <= 1e-6 and r["grads"] <= 1e-6, r


def unsharded_errors() -> dict[str, float]:
    """Without ``shard_batch`` every rank holds the whole batch: the model's own temperatures (from its local
    positions, which are the global ones then), as one process computes them."""
    hf_ring.setup_context_parallel(cp_size=torch.distributed.get_world_size())
    batch = tiny_batch(2, N)
    out, want = build("ring")(**batch), build("sdpa")(**batch)
    return {"logits": (out.logits - want.logits).abs().max().item(), "loss": abs(out.loss.item() - want.loss.item())}


def test_without_ring_context_runs_as_one_process() -> None:
    for r in run_ranks(2, unsharded_errors):
        assert max(r.values()) <= 1e-12, r
