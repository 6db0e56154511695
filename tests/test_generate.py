"""Greedy decoding under context parallelism (``hf_ring.evaluation.generate``) against one process's
``model.generate(do_sample=False)``: the same tokens, and every step's logits within float64 rounding,
at CP = 2 and 3, Ulysses 2 x 2, a sliding-window model and a hybrid (Qwen3.5's Gated DeltaNet and
short convolutions, their states handed along the ring at the prefill); prompts shorter than the
zigzag's 2P chunks; end of sequence; packed or padded prompts and undecodable models refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.errors import RingNotSupported
from hf_ring.evaluation.generate import greedy_generate
from hf_ring.evaluation.runtime import EvalError
from testkit.families import causal_lm_class, tiny_config
from testkit.mixers import float64_kernels
from testkit.models import tiny_model
from testkit.spawn import run_ranks


def _hybrid(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tiny_config(model_type)
    return causal_lm_class(model_type)._from_config(cfg, attn_implementation="ring").to(torch.float64).eval()


def decode_vs_generate(family: str, n: int, new: int, ulysses: int = 1, eos: int | None = None, **overrides) -> dict:
    """On every rank: CP greedy decoding of two prompts of ``n`` tokens against ``model.generate`` run
    whole on this rank (the ring model called without ``shard_batch`` is one process)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ulysses > 1:
        hf_ring.setup_context_parallel(world, ulysses_size=ulysses)
    with float64_kernels():
        if family in ("llama", "qwen3", "mistral"):
            model = tiny_model(family, "ring", torch.float64, **overrides).eval()
        else:
            model = _hybrid(family)
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(n))
        extra = {"eos_token_id": eos, "pad_token_id": 0} if eos is not None else {"min_new_tokens": new}
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             output_logits=True, return_dict_in_generate=True, **extra)  # fmt: skip
        scores: list[torch.Tensor] = []
        got = greedy_generate(model, ids, new, eos_token_id=eos, pad_token_id=0 if eos is not None else None,
                              scores=scores)  # fmt: skip
    want = ref.sequences[:, n:]
    err = max(float((a - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(scores, ref.logits))
    return {"equal": torch.equal(got, want), "got": got.tolist(), "want": want.tolist(), "err": err}


def check(results: list[dict], tol: float = 1e-9) -> None:
    for r in results:
        assert r["equal"], r
        assert r["err"] <= tol, r
    assert all(r["got"] == results[0]["got"] for r in results)  # every rank decodes the same tokens


@pytest.mark.timeout(300)
def test_one_process_equals_generate():
    check([decode_vs_generate("qwen3", 37, 10)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,family,n", [(2, "llama", 45), (3, "qwen3", 40), (3, "qwen3", 5)])
def test_cp_decoding_equals_generate(world, family, n):
    """P = 2 and 3 (GQA); a prompt of 5 tokens at P = 3 is shorter than 2P: it all runs replicated."""
    check(run_ranks(world, decode_vs_generate, family, n, 12, timeout=240))


@pytest.mark.timeout(300)
def test_ulysses_ring_decoding_equals_generate():
    check(run_ranks(4, decode_vs_generate, "llama", 50, 10, ulysses=2, timeout=240))


@pytest.mark.timeout(300)
def test_sliding_window_decoding_equals_generate():
    """Mistral with a window of 16 tokens over prompts of 45: the window cuts the sharded cache."""
    check(run_ranks(2, decode_vs_generate, "mistral", 45, 12, sliding_window=16, timeout=240))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3])
def test_hybrid_decoding_equals_generate(world):
    """Qwen3.5 (Gated DeltaNet + short convolutions + full attention): the states after the CP prefill
    are the one-process ones; the reference decodes with transformers' recurrent kernels in float32."""
    check(run_ranks(world, decode_vs_generate, "qwen3_5_text", 41, 8, timeout=360), tol=1e-5)


@pytest.mark.timeout(300)
def test_end_of_sequence_equals_generate():
    """Row 0 ends at its second token (39), row 1 goes on; row 0 is padded after it, as generate pads."""
    r = run_ranks(2, decode_vs_generate, "llama", 45, 12, eos=39, timeout=240)
    check(r)
    assert r[0]["got"][0][:3] == [85, 39, 0]


def test_packed_and_padded_prompts_refused():
    model = tiny_model("llama", "ring").eval()
    ids = torch.randint(0, 97, (1, 20))
    packed = torch.cat((torch.arange(12), torch.arange(8)))[None]
    with pytest.raises(EvalError, match="packed prompts"):
        greedy_generate(model, ids, 4, position_ids=packed)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    with pytest.raises(EvalError, match="padding"):
        greedy_generate(model, ids, 4, attention_mask=mask)


def test_undecodable_mixers_refused():
    model = causal_lm_class("nemotron_h")._from_config(tiny_config("nemotron_h"), attn_implementation="ring")
    with pytest.raises(RingNotSupported, match="decodes only for Gated DeltaNet"):
        greedy_generate(model.eval(), torch.randint(0, 50, (1, 20)), 4)
