"""What ring attention computes exactly, and the refusals for the rest (hf_ring/transformers/support.py).

Each case the sweep (tests/test_model_sweep.py) classifies is also pinned here on its own, at
CP = 2 with N not divisible by 2P: multi-head latent attention exact; mixed precision under
autocast as close to float64 as SDPA under the same autocast; hybrid mixers without a
context-parallel form (or without the batch's ring_context), windows the ring cannot read from the
model's mask, and models that use the mask themselves or build their own attention refused with
``RingNotSupported``; sliding windows and chunked attention, and the MoE router loss, exact.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_ring
from testkit.models import tiny_batch, tiny_model
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
CONFIGS = {
    "deepseek_v3": dict(
        BASE, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1,
    ),
    "lfm2": dict(BASE),
    "qwen3_next": dict(
        BASE, num_hidden_layers=4, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
    ),
    "mixtral": dict(BASE, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "qwen2_moe": dict(
        BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, use_sliding_window=True, sliding_window=8,
    ),
    "llama4_text": dict(BASE, head_dim=16, attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=96),
    "mpt": dict(vocab_size=97, d_model=64, n_heads=4, n_layers=2),
    "xglm": dict(vocab_size=97, d_model=64, attention_heads=4, num_layers=2, ffn_dim=96),
    "falcon": dict(vocab_size=97, hidden_size=64, num_attention_heads=4, num_hidden_layers=2),
    "gpt_neo": dict(
        vocab_size=97, hidden_size=64, num_heads=4, num_layers=2, attention_types=[[["global"], 2]],
        bos_token_id=0, eos_token_id=0,
    ),
}  # fmt: skip


def build(model_type: str, attn: str, experts_implementation: str | None = None, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **overrides})
    more = {"experts_implementation": experts_implementation} if experts_implementation else {}
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, **more)


def step_errors(model_type: str, n: int = 29, **overrides) -> dict[str, float]:
    """CP = world ring step against one process with sdpa on the whole sequence (fp32)."""
    batch = tiny_batch(2, n)
    ring, ref = build(model_type, "ring", **overrides), build(model_type, "sdpa", **overrides)
    out = ring(**hf_ring.shard_batch(batch))
    out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    world = torch.distributed.get_world_size()
    worst = 0.0
    for p, q in zip(ring.parameters(), ref.parameters()):
        if p.grad is None:
            continue
        g = p.grad.clone()
        torch.distributed.all_reduce(g)
        scale = q.grad.norm().item()
        if scale > 1e-6:
            worst = max(worst, rel_err(g / world, q.grad))
    return {"loss": abs(out.loss.item() - want.loss.item()) / want.loss.item(), "grads": worst}


def test_mla_value_head_dim_is_exact() -> None:
    """DeepSeek-V3's multi-head latent attention: value head dim 12, query/key head dim 24."""
    for r in run_ranks(2, step_errors, "deepseek_v3"):
        assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r


def refusal(model_type: str, n: int = 29, unroute: bool = False, **overrides) -> str:
    """The error of one ring step; ``unroute``: without the family's mixer routes (a hybrid whose
    mixers hf_ring has no context-parallel form of)."""
    from hf_ring.transformers import mixers

    saved = dict(mixers.MIXER_FAMILIES)
    if unroute:
        mixers.MIXER_FAMILIES.pop(f"{model_type}.modeling_{model_type}")
    try:
        model = build(model_type, "ring", **overrides)
        model(**hf_ring.shard_batch(tiny_batch(2, n)))
    except hf_ring.RingNotSupported as e:
        return f"RingNotSupported: {e}"
    except Exception as e:  # noqa: BLE001 - any other error is a failure of the test
        return f"{type(e).__name__}: {e}"
    finally:
        mixers.MIXER_FAMILIES.update(saved)
    return "no error"


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("mpt", "uses the attention mask itself"),
        ("xglm", "uses the attention mask itself"),
        ("falcon", "falcon computes attention itself"),
        ("gpt_neo", "gpt_neo computes attention itself"),
    ],
)
def test_refused_with_a_clear_error(model_type: str, message: str) -> None:
    for msg in run_ranks(2, refusal, model_type):
        assert msg.startswith("RingNotSupported") and message in msg, msg


@pytest.mark.parametrize(("model_type", "message"), [("lfm2", "Lfm2ShortConv"), ("qwen3_next", "GatedDeltaNet")])
def test_unrouted_mixers_are_refused(model_type: str, message: str) -> None:
    """A mixer class without a context-parallel form (here: its route taken away) is refused at CP > 1."""
    for msg in run_ranks(2, refusal, model_type, unroute=True):
        assert msg.startswith("RingNotSupported") and message in msg and "no context-parallel form" in msg, msg


def test_a_causal_mask_with_the_models_own_mask_functions_is_refused() -> None:
    """Gemma 3's text model with ``use_bidirectional_attention`` ORs a function of its own into every causal
    mask (transformers ``create_causal_mask(or_mask_function=...)``); the ring cannot see it and refuses a
    batch from ``shard_batch``, also in one process with a window longer than the sequence (it used to attend
    causally there). Called without ``shard_batch`` the model runs as one process, with that mask (SDPA's)."""
    from testkit.families import tiny_config

    config = tiny_config("gemma3_text", use_bidirectional_attention=True, sliding_window=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring").double()
    ids = torch.randint(0, 50, (1, 24))
    with pytest.raises(hf_ring.RingNotSupported, match="mask functions of the model's own"):
        model(**hf_ring.shard_batch({"input_ids": ids}))
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    assert (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item() <= 1e-12


def unsharded_errors(model_type: str) -> dict[str, float]:
    """Without ``shard_batch`` (no ``ring_context``) every rank of the CP group holds the whole batch and runs
    it as one process: the mixers (LFM2) and the window (Qwen2-MoE) over the whole sequence, float64."""
    hf_ring.setup_context_parallel(cp_size=torch.distributed.get_world_size())
    batch = tiny_batch(2, 28)
    kw = {"experts_implementation": "eager"} if model_type == "qwen2_moe" else {}  # grouped_mm: no float64
    out, want = (build(model_type, attn, **kw).double()(**batch) for attn in ("ring", "sdpa"))
    return {"logits": (out.logits - want.logits).abs().max().item(), "loss": abs(out.loss.item() - want.loss.item())}


@pytest.mark.parametrize("model_type", ["lfm2", "qwen2_moe"])
def test_without_ring_context_the_whole_batch_runs_as_one_process(model_type: str) -> None:
    for r in run_ranks(2, unsharded_errors, model_type):
        assert max(r.values()) <= 1e-12, r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_type", ["qwen2_moe", "llama4_text"])
def test_windows_and_chunks_are_exact(model_type: str, world: int) -> None:
    """A sliding window of 8 (Qwen2-MoE) and chunks of 8 (Llama 4) over 29 tokens: at CP = 2 the
    border route (zigzag chunks of 8), at CP = 4 the ring (chunks of 4)."""
    for r in run_ranks(world, step_errors, model_type):
        assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r


def test_window_the_mask_does_not_apply_is_refused() -> None:
    """A layer that passes sliding_window= to the attention function while its mask applies another
    window (or none): flash-attn and SDPA would disagree, so the ring refuses; a config field that
    neither the mask nor the call applies is ignored, as SDPA ignores it."""
    from hf_ring.transformers.attention import RING_MASK, RingMask
    from hf_ring.transformers.support import check_layer

    model = build("qwen2_moe", "ring")
    layer = model.model.layers[0].self_attn
    with pytest.raises(hf_ring.RingNotSupported, match="passes sliding_window=8 .* its mask applies no window"):
        check_layer(layer, {"sliding_window": 8}, 32, True, 2, mask=RING_MASK)
    with pytest.raises(hf_ring.RingNotSupported, match="a window of 4"):
        check_layer(layer, {"sliding_window": 8}, 32, True, 2, mask=RingMask(window=4))
    check_layer(layer, {"sliding_window": 8}, 32, True, 2, mask=RingMask(window=8))
    check_layer(layer, {}, 32, True, 2, mask=RING_MASK)  # config.sliding_window alone: the mask is the truth
    with pytest.raises(hf_ring.RingNotSupported, match="local over 8 tokens"):
        check_layer(layer, {}, 32, True, 2, mask=RingMask(local_size=8, unknown="it is neither"))
    with pytest.raises(hf_ring.RingNotSupported, match="did not make its mask"):
        check_layer(layer, {"sliding_window": 8}, 32, True, 2, mask=None)


@pytest.mark.parametrize("coef", [0.0, 0.001])
def test_router_loss_runs_exactly(coef: float) -> None:
    """With its coefficient, the router loss is summed over the CP group (tests/test_router_loss.py)."""
    for r in run_ranks(2, step_errors, "mixtral", router_aux_loss_coef=coef):
        assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r


def test_hybrid_runs_on_one_rank() -> None:
    """A hybrid model is exact without context parallelism: the refusal is for CP > 1 only."""
    batch = tiny_batch(1, 12)
    ring, ref = build("lfm2", "ring"), build("lfm2", "sdpa")
    assert abs(ring(**hf_ring.shard_batch(batch)).loss.item() - ref(**batch).loss.item()) < 1e-5


def autocast_errors(family: str) -> dict[str, float]:
    """fp32 weights under bf16 autocast (what Trainer(bf16=True) does): ring at CP = world and
    one-process sdpa under the same autocast, each against the float64 model."""
    batch = tiny_batch(2, 29)
    ring, sdpa = tiny_model(family, "ring"), tiny_model(family, "sdpa")
    oracle = tiny_model(family, "sdpa", torch.float64)
    want = oracle(**batch).loss.item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ring(**hf_ring.shard_batch(batch)).loss
        base = sdpa(**batch).loss
    got.backward()
    return {"ring": abs(got.item() - want) / want, "sdpa": abs(base.item() - want) / want}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_autocast_bf16_matches_sdpa_under_autocast(family: str) -> None:
    for r in run_ranks(2, autocast_errors, family):
        assert r["ring"] <= 2 * r["sdpa"] + 1e-3, r
