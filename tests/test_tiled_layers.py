"""Tiled decoder layers with head groups (``hf_ring.enable_tiled_layers``, ``enable_head_groups``): one
process against the same model untiled, every family the tiled forward computes; a step at CP = 4 with
every new option on (tiled layers, head groups, checkpointing with offload of every other layer's input, the
chunked loss, LoRA) equal to one process in float64 -- GQA 6:2, head_dim 80, a length not divisible by 2P,
packed documents, a sliding window (border route), Ulysses 2 x ring 2; the ledger of changes and its undo;
the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.transformers.layers import (
    LAYERS,
    changed,
    disable_head_groups,
    disable_tiled_layers,
    enable_head_groups,
    enable_tiled_layers,
)
from testkit.models import cp_grad_error, documents_alone_loss, named_grads, tiny_batch, tiny_model
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

ODD = dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=100, head_dim=80)
TOL = 1e-6  # float64 models whose RMSNorms compute in float32 (transformers'): the norm's backward per group


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    model.enable_input_require_grads()
    return model


def _build(family: str, attn: str, overrides: dict, lora: bool) -> torch.nn.Module:
    model = tiny_model(family, attn, torch.float64, **overrides)
    return _lora(model) if lora else model


def _options(model: torch.nn.Module, o: dict) -> None:
    if o.get("ckpt"):
        from testkit.offload import MeasuredOffload

        hf_ring.enable_activation_checkpointing(model, offload=MeasuredOffload if o.get("offload") else False)
    if o.get("chunked"):
        hf_ring.enable_chunked_loss(model)
    enable_head_groups(model, o.get("groups", 1))
    enable_tiled_layers(model, o.get("tile", 5), offload_every=o.get("every", 1))
    model.train()


@pytest.mark.parametrize("family", list(f.removesuffix("DecoderLayer").lower() for f in LAYERS))
def test_one_process_equals_untiled(family: str) -> None:
    """Loss and every gradient, tiles of 5 tokens, 2 head groups, checkpointing, LoRA on every projection."""
    overrides = dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=100)
    if family != "qwen3":
        overrides["head_dim"] = 16
    batch = tiny_batch(1, 37)
    results = []
    for tiled in (False, True):
        model = _build(family, "ring", overrides, lora=True)
        if tiled:
            _options(model, dict(ckpt=True, groups=2, tile=5))
        model.train()
        out = model(**hf_ring.shard_batch(batch))
        out.loss.backward()
        results.append((out.loss.detach(), named_grads(model, False)))
    (loss0, g0), (loss1, g1) = results
    assert rel_err(loss1, loss0) < 1e-12
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        assert rel_err(g1[name], g0[name]) < TOL, name


def cp_step_errors(case: dict) -> dict[str, float]:
    """The step of ``case`` at CP = world (every option on) against one process (sdpa, float64, no option)."""
    world = dist.get_world_size()
    hf_ring.setup_context_parallel(world, ulysses_size=case.get("ulysses", 1))
    family, overrides, lora = case["family"], case["overrides"], case.get("lora", False)
    ring, ref = _build(family, "ring", overrides, lora), _build(family, "sdpa", overrides, lora)
    _options(ring, case["options"])
    ref.train()
    docs = case.get("docs")
    if docs:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 97, (1, sum(docs)), generator=g)
        labels = ids.clone()
        labels[0, 10:13] = -100
        positions = torch.cat([torch.arange(n) for n in docs])[None]
        out = ring(**hf_ring.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions}))
        want = documents_alone_loss(ref, ids, labels, docs)
    else:
        batch = tiny_batch(1, case["n"])
        out = ring(**hf_ring.shard_batch(batch))
        want = ref(**batch).loss
    out.loss.backward()
    want.backward()
    return {"loss": rel_err(out.loss, want), "grads": cp_grad_error(ring, ref), "changes": len(changed(ring))}


CASES = {
    # GQA 6:2, head_dim 80, 37 tokens (padded to 40 for 2P = 8), LoRA, checkpointing + offload, chunked loss
    "llama_odd_lora_offload": dict(family="llama", overrides=ODD, n=37, lora=True,
                                   options=dict(ckpt=True, offload=True, chunked=True, groups=2, tile=4, every=2)),
    "qwen3_packed": dict(family="qwen3", overrides=dict(num_attention_heads=6, num_key_value_heads=2), n=0,
                         docs=[7, 1, 20, 13, 5], options=dict(ckpt=True, chunked=True, groups=2, tile=3)),
    "mistral_window_border": dict(family="mistral", overrides={**ODD, "sliding_window": 4}, n=41,
                                  options=dict(ckpt=True, chunked=True, groups=2, tile=3)),
    "llama_ulysses2_ring2": dict(family="llama", ulysses=2, n=44, lora=True,
                                 overrides=dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=64),
                                 options=dict(ckpt=True, offload=True, chunked=True, groups=2, tile=5, every=2)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_cp4_step_with_every_option_equals_one_process(name: str) -> None:
    for r in run_ranks(4, cp_step_errors, CASES[name]):
        assert r["loss"] < TOL and r["grads"] < TOL, r
        assert r["changes"] > 0


def test_offload_every_other_layer_halves_the_host_copies_and_changes_nothing() -> None:
    """4 layers: the inputs of layers 0 and 2 and the final norm's go to the host (3 of 5); layers 1 and 3 make
    theirs again in backward; loss and every gradient bit for bit those of offloading every input."""
    from hf_ring.transformers.patches import offloaded
    from testkit.live_tensors import LiveTensorBytes
    from testkit.offload import MeasuredOffload

    batch = tiny_batch(1, 64)
    runs = {}
    for every in (1, 2):
        model = tiny_model("llama", "ring", torch.float64, num_hidden_layers=4)
        _options(model, dict(ckpt=True, offload=True, chunked=True, tile=16, every=every))
        assert isinstance(offloaded(model), MeasuredOffload)
        with LiveTensorBytes() as mem:
            out = model(**hf_ring.shard_batch(batch))
            out.loss.backward()
        runs[every] = (out.loss.detach(), named_grads(model, False), mem.host_peak)
    one = 64 * 64 * 8  # a [64, 64] float64 layer input
    assert runs[1][2] // one == 5 and runs[2][2] // one == 3
    assert torch.equal(runs[1][0], runs[2][0])
    assert all(torch.equal(runs[1][1][k], runs[2][1][k]) for k in runs[1][1])


def test_ledger_lists_every_change_and_undoes_it() -> None:
    """The layers' and the final norm's forward are ledger entries of the model; the head groups and the tiles
    hf_ring's own records; nothing else on the model. disable_* and uninstall() put every forward back."""
    from hf_ring.ledger import LEDGER
    from hf_ring.transformers.attention import head_groups
    from hf_ring.transformers.layers import _LAYERS

    model = tiny_model("llama", "ring")
    layer, attn = model.model.layers[0], model.model.layers[1].self_attn
    own = {id(m): dict(vars(m)) for m in model.modules()}
    enable_head_groups(model, 2)
    enable_tiled_layers(model, 16)
    enable_tiled_layers(model, 8)  # idempotent: the tile changes, nothing is recorded twice
    names = changed(model)
    assert ("model.layers.0", "forward", "enable_tiled_layers") in names
    assert ("model.norm", "forward", "enable_tiled_layers") in names
    assert ("model.layers.1.self_attn", "head groups", "enable_head_groups") in names
    assert len(names) == len(set(names)) == 2 + 1 + 2  # layers' forward, norm's forward, head groups
    assert _LAYERS[layer].tile == 8 and head_groups(attn) == 2
    entry = LEDGER.find(layer, "forward")
    assert entry is not None and entry.scope == "model" and "enable_tiled_layers" in entry.why
    for m in model.modules():  # only the forwards are new on the model's modules
        assert set(vars(m)) - set(own[id(m)]) <= {"forward"}, type(m).__name__
    disable_tiled_layers(model)
    disable_head_groups(model)
    assert changed(model) == [] and head_groups(attn) == 1
    assert LEDGER.find(layer, "forward") is None and LEDGER.find(model.model.norm, "forward") is None
    assert all(vars(m).keys() == own[id(m)].keys() for m in model.modules())
    enable_head_groups(model, 2)
    enable_tiled_layers(model, 8)
    try:
        hf_ring.uninstall()  # also undoes what hf_ring changed when the model was built (its loss)
        assert changed(model) == [] and head_groups(attn) == 1
        assert not any("forward" in vars(m) for m in (*model.model.layers, model.model.norm))
    finally:
        hf_ring.register()


def test_refusals_name_the_problem_and_the_fix() -> None:
    with pytest.raises(hf_ring.RingNotSupported, match=r"head_groups=3 must divide the 2 K/V heads"):
        enable_head_groups(tiny_model("llama", "ring"), 3)
    gemma = torch.nn.Module()
    from transformers import AutoModelForCausalLM, Gemma2Config

    gemma = AutoModelForCausalLM.from_config(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=48,
                                                          num_hidden_layers=1, num_attention_heads=2,
                                                          num_key_value_heads=1, head_dim=16))  # fmt: skip
    with pytest.raises(hf_ring.RingNotSupported, match="Gemma2DecoderLayer is not a layer the tiled forward computes"):
        enable_tiled_layers(gemma, 8)
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", "ring"), LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.1))
    enable_tiled_layers(model, 8)
    model.train()
    with pytest.raises(hf_ring.RingNotSupported, match="lora_dropout=0.1.*set lora_dropout=0"):
        model(**hf_ring.shard_batch(tiny_batch(1, 20)))
