"""attn_implementation="ring" glue: registration, shard_batch, padding, eval logits, and every
documented error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, BloomConfig, PreTrainedModel
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

import hf_ring
from hf_ring.transformers import install
from hf_ring.transformers.attention import ring_attention_forward
from hf_ring.transformers.loss import CausalLMLoss
from testkit.models import tiny_batch, tiny_config, tiny_model
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

ROOT = Path(__file__).resolve().parent.parent


def test_register_is_idempotent_and_leaves_other_losses_alone() -> None:
    hf_ring.register()
    hf_ring.register()
    entry = AttentionInterface._global_mapping["ring"]
    assert entry is install.attention_entry and not hasattr(entry, "hf_ring_original")
    hook = PreTrainedModel._check_and_adjust_attn_implementation
    assert not hasattr(hook.hf_ring_original, "hf_ring_original")  # wrapped once
    assert LOSS_MAPPING["ForCausalLM"] is ForCausalLMLoss  # the registry of losses is not touched
    batch = tiny_batch(2, 20)
    model = tiny_model("llama", "sdpa")
    assert isinstance(model.loss_function, CausalLMLoss) and model.loss_function.original() is ForCausalLMLoss
    logits = model(input_ids=batch["input_ids"]).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    assert torch.allclose(model(**batch).loss, want, rtol=1e-6)


def test_ring_attention_is_the_registered_function() -> None:
    """The registry's entry is ``ring_attention_forward``, imported on its first call."""
    module = tiny_model("llama", "ring").model.layers[0].self_attn
    q, k = torch.randn(1, 4, 6, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8, dtype=torch.float64)
    got, _ = AttentionInterface._global_mapping["ring"](module, q, k, k, None, scaling=0.25)
    want, _ = ring_attention_forward(module, q, k, k, None, scaling=0.25)
    assert torch.equal(got, want)


def test_trainer_still_sees_a_causal_lm_loss(tmp_path) -> None:
    """Trainer decides by identity (``LOSS_MAPPING[loss_type] is ForCausalLMLoss``) that position 0
    of a row is no target; hf_ring's loss lives on the model, so that answer is transformers' own,
    or plain Trainer and TRL's SFTTrainer would count one extra target per row and scale every
    loss down."""
    from transformers import Trainer, TrainingArguments

    for key in ("ForCausalLM", "ForConditionalGeneration", "CsmForConditionalGeneration"):
        assert LOSS_MAPPING[key] is ForCausalLMLoss, key
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = Trainer(model=tiny_model("llama", "ring"), args=args)
    assert trainer._loss_shifts_labels
    labels = torch.tensor([[5, 6, 7, -100], [8, -100, 9, 10]])
    assert trainer._get_num_items_in_batch([{"labels": labels}], torch.device("cpu")) == 4


def test_models_built_before_transformers_trainer_was_imported_keep_their_loss() -> None:
    """``import hf_ring``, a model, then ``transformers.trainer``: the trainer's name is the original
    loss, and the model's loss is hf_ring's."""
    import subprocess
    import sys

    code = (
        "import hf_ring, torch\n"
        "from testkit.models import tiny_model\n"
        "model = tiny_model('llama', 'ring')\n"
        "import transformers.trainer as t\n"
        "from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss\n"
        "assert t.ForCausalLMLoss is ForCausalLMLoss is LOSS_MAPPING['ForCausalLM']\n"
        "assert type(model.loss_function).__name__ == 'CausalLMLoss'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=ROOT)


# --- shard_batch -------------------------------------------------------------------------------


def padded_losses(world: int) -> dict:
    """Right-padded batch of two lengths vs each sequence alone, all with CP = world."""
    lengths, n = (29, 17), 29
    batch = tiny_batch(2, n, seed=3)
    mask = torch.zeros(2, n, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    batch["input_ids"] = batch["input_ids"].masked_fill(mask == 0, 5)
    batch["attention_mask"] = mask
    model = tiny_model("qwen3", "ring")
    ref = tiny_model("qwen3", "sdpa", torch.float64)
    out = model(**hf_ring.shard_batch(batch))
    alone, oracle = [], []
    for i, length in enumerate(lengths):
        one = {k: v[i : i + 1, :length] for k, v in batch.items() if k != "attention_mask"}
        alone.append(model(**hf_ring.shard_batch(one)).loss.item())
        oracle.append(ref(**one).loss.item())
    # per-sequence losses from the padded run's logits
    logits = hf_ring.unshard(out.logits)[:, :n].double()
    per_seq = []
    for i, length in enumerate(lengths):
        tgt = batch["labels"][i, 1:length]
        per_seq.append(torch.nn.functional.cross_entropy(logits[i, : length - 1], tgt, ignore_index=-100).item())
    counts = [(batch["labels"][i, 1:length] != -100).sum().item() for i, length in enumerate(lengths)]
    whole = sum(loss * c for loss, c in zip(oracle, counts)) / sum(counts)
    return {"alone": alone, "oracle": oracle, "per_seq": per_seq, "loss": out.loss.item(), "whole": whole}


@pytest.mark.parametrize("world", [2, 3])
def test_right_padding_gives_per_sequence_losses(world: int) -> None:
    for r in run_ranks(world, padded_losses, world):
        for i in range(2):
            assert abs(r["alone"][i] - r["oracle"][i]) <= 1e-5 * r["oracle"][i]
            assert abs(r["per_seq"][i] - r["oracle"][i]) <= 1e-5 * r["oracle"][i]
        assert abs(r["loss"] - r["whole"]) <= 1e-5 * r["whole"]


def eval_logits(world: int, family: str) -> float:
    batch = tiny_batch(2, 41)
    ids = batch["input_ids"]
    model = tiny_model(family, "ring").eval()
    ref = tiny_model(family, "sdpa", torch.float64).eval()
    with torch.no_grad():
        logits = model(**hf_ring.shard_batch({"input_ids": ids})).logits
        full = hf_ring.unshard(logits)[:, : ids.shape[1]]
        return rel_err(full, ref(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eval_logits_unshard_to_single_process_logits(family: str) -> None:
    assert max(run_ranks(3, eval_logits, 3, family)) <= 1e-5


def test_shard_batch_layout_and_counts() -> None:
    """Single process: padding to 2P = 2, labels shifted before sharding, global count."""
    batch = tiny_batch(2, 9)
    out = hf_ring.shard_batch(batch)
    assert out["input_ids"].shape == (2, 10) and out["position_ids"][0].tolist() == list(range(10))
    want = torch.cat((batch["labels"][:, 1:], torch.full((2, 2), -100)), dim=1)
    assert torch.equal(out["shift_labels"], want)
    assert out["num_items_in_batch"].item() == (want != -100).sum().item()
    assert out["use_cache"] is False
    given = hf_ring.shard_batch({**batch, "num_items_in_batch": torch.tensor(123)})
    assert given["num_items_in_batch"].item() == 123


# --- errors ------------------------------------------------------------------------------------


def _step(model, batch):
    return model(**hf_ring.shard_batch(batch))


def test_dropout_while_training_raises() -> None:
    model = tiny_model("llama", "ring", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="does not support attention dropout"):
        _step(model, tiny_batch(1, 16))
    model.eval()  # dropout is off in eval: fine
    _step(model, tiny_batch(1, 16))


def test_sliding_window_in_effect_matches_sdpa() -> None:
    """One process: windows shorter than the sequence (Qwen2 layers from 1 on, Mistral every layer) as
    SDPA computes them, through shard_batch and without it (the whole sequence on one rank)."""
    batch = tiny_batch(1, 16)
    for cfg in (
        tiny_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
        tiny_config("mistral", sliding_window=8),
    ):
        torch.manual_seed(0)
        ring = AutoModelForCausalLM.from_config(cfg, attn_implementation="ring")
        torch.manual_seed(0)
        sdpa = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        want = sdpa(**batch).loss.item()
        assert abs(_step(ring, batch).loss.item() - want) < 1e-5
        assert abs(ring(**batch, use_cache=False).loss.item() - want) < 1e-5


def test_softcapping_and_sinks_reach_the_ring() -> None:
    """One process: ``softcap`` and ``s_aux``/per-token ``sinks`` give the eager attention of Gemma 2 and
    GPT-OSS (scores capped, a sink logit joined to each row's softmax and dropped); a sink of the wrong
    shape is refused."""
    module = tiny_model("llama", "ring").model.layers[0].self_attn
    ctx = hf_ring.shard_batch({"input_ids": torch.zeros(1, 8, dtype=torch.long)})["ring_context"]  # one process
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 8, 16, generator=g) * 4, torch.randn(1, 2, 8, 16, generator=g), torch.randn(1, 2, 8, 16)
    sink = torch.randn(4, generator=g)
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    s = (torch.tanh(s / 5.0) * 5.0).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.cat((s, sink.view(1, 4, 1, 1).expand(1, 4, 8, 1)), -1).softmax(-1)[..., :-1]
    want = (p @ v.repeat_interleave(2, 1)).transpose(1, 2)
    out, _ = ring_attention_forward(module, q, k, v, None, scaling=0.25, softcap=5.0, s_aux=sink, ring_context=ctx)
    torch.testing.assert_close(out, want)
    per_token = sink.view(1, 4, 1, 1).expand(1, 4, 8, 1)
    out, _ = ring_attention_forward(module, q, k, v, None, scaling=0.25, softcap=5.0, sinks=per_token,
                                    ring_context=ctx)  # fmt: skip
    torch.testing.assert_close(out, want)
    with pytest.raises(ValueError, match="attention sinks of one logit per head"):
        ring_attention_forward(module, q, k, k, None, scaling=0.25, s_aux=torch.zeros(3), ring_context=ctx)
    with pytest.raises(hf_ring.RingNotSupported, match="passes sink, which SDPA does not compute"):
        ring_attention_forward(module, q, k, k, None, scaling=0.25, s_aux=sink)  # Llama's eager has no sinks


def test_mask_not_prepared_by_ring_raises() -> None:
    """Next to the batch's ``ring_context`` a mask the ring did not make (4D, or a padding mask) is refused;
    without one the model runs as one process, with the mask as SDPA takes it."""
    model, sdpa = tiny_model("llama", "ring"), tiny_model("llama", "sdpa")
    ids = tiny_batch(1, 8)["input_ids"]
    kwargs = hf_ring.shard_batch({"input_ids": ids})
    four_d = torch.zeros(1, 1, 8, 8)
    padding = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="did not prepare"):
        model(**kwargs, attention_mask=four_d)
    with pytest.raises(ValueError, match="attention_mask with padding next to the batch's ring_context"):
        model(**kwargs, attention_mask=padding)
    model(**kwargs, attention_mask=torch.ones(1, 8, dtype=torch.long))  # no padding: fine
    for mask in (four_d, padding):
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want = sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_left_padding_raises() -> None:
    batch = tiny_batch(2, 8)
    batch["attention_mask"] = torch.tensor([[1] * 8, [0, 0] + [1] * 6])
    with pytest.raises(ValueError, match="left padding"):
        hf_ring.shard_batch(batch)


def test_position_offsets_and_padding_positions_are_one_document() -> None:
    """Offset positions and collator positions inside the right padding are not packed documents
    (packed ones are tested in tests/test_documents.py)."""
    batch = tiny_batch(2, 12)
    out = hf_ring.shard_batch({**batch, "position_ids": torch.arange(100, 112)[None]})  # an offset: one document
    assert out["position_ids"][0, :3].tolist() == [100, 101, 102] and out["ring_context"].schedule is None
    mask = (torch.arange(12) < 8).long().expand(2, 12)
    padded = torch.cat((torch.arange(8), torch.zeros(4, dtype=torch.long))).expand(2, 12)  # collator padding
    out = hf_ring.shard_batch({**batch, "attention_mask": mask, "position_ids": padded})
    assert out["ring_context"].schedule is None


def test_kv_cache_decoding_runs_as_one_process_and_is_refused_with_a_context() -> None:
    """Without ``shard_batch``, ``generate`` (a KV cache) is one process's greedy decoding, token for token;
    a query block shorter than its keys next to a ``ring_context`` is refused."""
    model, sdpa = tiny_model("llama", "ring").eval(), tiny_model("llama", "sdpa").eval()
    ids = tiny_batch(1, 8)["input_ids"]
    got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert got.equal(sdpa.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    module = model.model.layers[0].self_attn
    ctx = hf_ring.shard_batch({"input_ids": ids})["ring_context"]
    q, kv = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="decoding with a KV cache"):
        ring_attention_forward(module, q, kv, kv, None, scaling=0.25, ring_context=ctx)


def test_dynamic_rope_raises() -> None:
    model = tiny_model("llama", "ring", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        _step(model, tiny_batch(1, 8))


def test_unknown_batch_key_raises() -> None:
    with pytest.raises(ValueError, match="does not know how to shard"):
        hf_ring.shard_batch({**tiny_batch(1, 8), "token_type_ids": torch.zeros(1, 8)})


def model_without_ring(kind: str) -> str:
    if kind == "sdpa":
        model = tiny_model("llama", "sdpa")
    else:  # a model that ignores transformers' attention registry
        cfg = BloomConfig(n_layer=1, hidden_size=32, n_head=4, vocab_size=97, bos_token_id=0, eos_token_id=0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ring")
    try:
        _step(model, tiny_batch(2, 12))
    except (RuntimeError, TypeError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "message"), [("sdpa", "never ran ring attention"), ("bloom", "computes attention itself")]
)
def test_sharded_batch_through_model_without_ring_attention_raises(kind: str, message: str) -> None:
    for msg in run_ranks(2, model_without_ring, kind):
        assert message in msg


def too_short() -> str:
    try:
        hf_ring.shard_batch(tiny_batch(1, 5))
    except ValueError as e:
        return str(e)
    return "no error"


def test_sequence_shorter_than_2p_raises() -> None:
    for msg in run_ranks(4, too_short):
        assert "shorter than 2 * P = 8" in msg
