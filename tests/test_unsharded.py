"""A ring model called without ``shard_batch``: every rank holds the whole batch, and the model computes
what one process computes on it (``attention.one_process_attention``), never shard semantics guessed from
a shape. With a CP group of P = 2 and 3 set up, lengths that are multiples of 2P and not, with and without
labels, padded (right and left) and packed ``position_ids``: logits, loss and every gradient against the same
model under transformers' SDPA in float64, on every rank. The same without torch.distributed; soft-capping
(Gemma 2) and attention sinks (GPT-OSS) through the model's eager attention; Gemma 3's image blocks; no host
read in hf_ring's attention code on this path; hybrid mixers on the whole batch. The trainers' plain forwards
(TRL's ``compute_metrics``, ``cp_size=1``): tests/test_dpo.py, tests/test_grpo.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import hf_ring
from testkit.host_syncs import HostSyncs, backward
from testkit.models import tiny_batch, tiny_model
from testkit.spawn import run_ranks

ATTENTION_CODE = os.path.join(os.path.dirname(hf_ring.__file__), "transformers", "attention.py")


def _cases(n: int) -> dict[str, dict[str, torch.Tensor]]:
    """Batches of two rows of ``n`` tokens: plain, labelled, right- and left-padded, packed documents."""
    b = tiny_batch(2, n)
    ids, labels = b["input_ids"], b["labels"]
    right = torch.ones_like(ids)
    right[1, n - 4 :] = 0
    left = torch.ones_like(ids)
    left[1, :3] = 0
    cut = n // 3
    packed = torch.cat([torch.arange(cut), torch.arange(n - cut)])[None].expand(2, -1)
    return {
        "ids": {"input_ids": ids},
        "labels": {"input_ids": ids, "labels": labels},
        "right_padded": {"input_ids": ids, "attention_mask": right, "labels": labels.masked_fill(right == 0, -100)},
        "left_padded": {"input_ids": ids, "attention_mask": left, "labels": labels.masked_fill(left == 0, -100)},
        "packed": {"input_ids": ids, "position_ids": packed, "labels": labels},
    }


def _errors(family: str, batch: dict[str, torch.Tensor], **overrides: object) -> dict[str, float]:
    """Largest differences between the ring model and the SDPA model on ``batch`` (float64): logits,
    loss and parameter gradients."""
    ring = tiny_model(family, "ring", torch.float64, **overrides)
    ref = tiny_model(family, "sdpa", torch.float64, **overrides)
    out, want = ring(**batch), ref(**batch)
    errors = {"logits": (out.logits - want.logits).abs().max().item()}
    if want.loss is not None:
        errors["loss"] = abs(out.loss.item() - want.loss.item())
        out.loss.backward()
        want.loss.backward()
        grads = dict(ref.named_parameters())
        errors["grads"] = max((p.grad - grads[k].grad).abs().max().item() for k, p in ring.named_parameters())
    return errors


def unsharded_errors(n: int) -> dict[str, dict[str, float]]:
    """On every rank of a CP group of the whole world: each case's errors."""
    hf_ring.setup_context_parallel(cp_size=dist.get_world_size())
    return {name: _errors("llama", batch) for name, batch in _cases(n).items()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n", [12, 13])  # 12: a multiple of 2P at P = 2 and 3; 13: not
def test_ring_model_without_shard_batch_computes_the_whole_batch(world: int, n: int) -> None:
    for rank in run_ranks(world, unsharded_errors, n):
        for name, errors in rank.items():
            assert max(errors.values()) <= 1e-12, (name, errors)


def test_without_torch_distributed_as_well() -> None:
    assert not dist.is_initialized()
    for name, batch in _cases(11).items():
        errors = _errors("qwen3", batch)
        assert max(errors.values()) <= 1e-12, (name, errors)


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("gemma2", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": None, "query_pre_attn_scalar": 16}),
        ("gpt_oss", {}),
    ],
)
def test_softcap_and_sinks_take_the_model_s_eager_attention(model_type: str, overrides: dict) -> None:
    """SDPA computes neither: the reference is the model under "eager", which computes both."""
    from testkit.families import causal_lm_class, tiny_config

    config = tiny_config(model_type, **overrides)
    cls = causal_lm_class(model_type)
    torch.manual_seed(0)
    ring = cls._from_config(config, attn_implementation="ring", experts_implementation="eager").double()
    torch.manual_seed(0)
    ref = cls._from_config(config, attn_implementation="eager", experts_implementation="eager").double()
    ring.train(), ref.train()
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    out, want = ring(**batch), ref(**batch)
    assert (out.logits - want.logits).abs().max().item() <= 1e-12
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    worst = max((p.grad - grads[k].grad).abs().max().item() for k, p in ring.named_parameters() if p.grad is not None)
    assert worst <= 1e-12


def gemma3_blocks_errors() -> dict[str, float]:
    """On every rank of a CP group: Gemma 3 with image blocks (``token_type_ids``) and right padding, called
    without ``shard_batch``, against the same model under SDPA: the blocks come from the model's own mask
    function, which the one-process path applies as SDPA does."""
    from testkit.vlm import as_images, qwen_batch
    from testkit.vlm import tiny_model as vlm_model
    from tests.test_multimodal import ROWS_4, _image_blocks

    hf_ring.setup_context_parallel(cp_size=dist.get_world_size())
    batch = _image_blocks(as_images(qwen_batch(ROWS_4)))
    assert bool((batch["token_type_ids"] == 1).any()) and not bool(batch["attention_mask"].all())
    ring, ref = vlm_model("gemma3", "ring"), vlm_model("gemma3", "sdpa")
    out, want = ring(**batch), ref(**batch)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    return {
        "logits": (out.logits - want.logits).abs().max().item(),
        "loss": abs(out.loss.item() - want.loss.item()),
        "grads": max((p.grad - grads[k].grad).abs().max().item() for k, p in ring.named_parameters()
                     if p.grad is not None),  # fmt: skip
    }


def test_gemma3_image_blocks_without_shard_batch() -> None:
    for errors in run_ranks(2, gemma3_blocks_errors):
        assert max(errors.values()) <= 1e-12, errors


def test_no_host_read_in_the_attention_function_without_a_context() -> None:
    """The attention function makes no host read on this path (it read ``position_ids`` once per layer)."""
    model = tiny_model("llama", "ring", num_hidden_layers=3).train()
    batch = {**tiny_batch(1, 16), "position_ids": torch.arange(16)[None]}
    with HostSyncs() as syncs:
        backward(model(**batch).loss)
    found = syncs.count(ATTENTION_CODE)
    assert sum(found.values()) == 0, found


def test_a_padding_mask_next_to_a_ring_context_is_refused() -> None:
    model = tiny_model("llama", "ring")
    b = tiny_batch(2, 12)
    kwargs = hf_ring.shard_batch(b)
    mask = torch.ones_like(b["input_ids"])
    mask[1, 9:] = 0
    with pytest.raises(hf_ring.RingNotSupported, match="padding next to the batch's ring_context"):
        model(**kwargs, attention_mask=mask)


def test_a_layer_that_makes_its_own_keys_is_refused_without_shard_batch() -> None:
    """DeepSeek-V4 appends compressed keys that the mask does not cover: refused in one line, as under CP."""
    from testkit.families import causal_lm_class, tiny_config

    config = tiny_config("deepseek_v4")
    model = causal_lm_class("deepseek_v4")._from_config(config, attn_implementation="ring")
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(hf_ring.RingNotSupported, match=r"attends \d+ keys where its mask covers 32"):
        model(input_ids=ids, use_cache=False)


def hybrid_errors(model_type: str) -> dict[str, float]:
    """On every rank of a CP group: a hybrid model (its mixers need the batch's layout under CP) called
    without ``shard_batch`` runs its mixers on the whole batch, as one process does."""
    from testkit.families import causal_lm_class, tiny_config

    hf_ring.setup_context_parallel(cp_size=dist.get_world_size())
    config = tiny_config(model_type)
    models = {}
    for attn in ("ring", "sdpa"):
        torch.manual_seed(0)
        models[attn] = causal_lm_class(model_type)._from_config(config, attn_implementation=attn).double()
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(2))
    out, want = (models[a](input_ids=ids, labels=ids) for a in ("ring", "sdpa"))
    return {"logits": (out.logits - want.logits).abs().max().item(), "loss": abs(out.loss.item() - want.loss.item())}


@pytest.mark.parametrize("model_type", ["lfm2", "qwen3_5_text"])
def test_hybrid_without_shard_batch_runs_as_one_process(model_type: str) -> None:
    for errors in run_ranks(3, hybrid_errors, model_type):
        assert max(errors.values()) <= 1e-12, errors
