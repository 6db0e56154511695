"""Ring attention with TRL: ``RingSFTTrainer`` (``RingTrainer`` mixed into ``trl.SFTTrainer``) at
CP=2 logs the losses and gradient norms of single-process ``SFTTrainer`` with sdpa attention on the
same prompt-completion data (TRL's tokenisation, completion-only labels, right padding, EOS),
within 1e-5, in float32.

(Prompt-completion data: the first label of a row is not -100, so this also checks that, with
``hf_ring`` imported, ``Trainer`` still counts next-token targets over ``labels[..., 1:]``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from testkit.spawn import launcher_env, run_ranks

pytest.importorskip("trl")

VOCAB = 64


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(path)


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (n,), generator=g))


def _examples() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(4, 24, (16, 2), generator=g).tolist()
    return [{"prompt": _words(g, p), "completion": " " + _words(g, c)} for p, c in sizes]


def sft_run(kind: str, out: str, tok_dir: str, packing: bool = False) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from hf_ring.trainer.trl import RingSFTConfig, RingSFTTrainer
    from testkit.models import tiny_model

    ring = kind == "ring"
    if ring:
        launcher_env()
    common = dict(output_dir=out, max_steps=4, per_device_train_batch_size=2, learning_rate=0.1, optim="sgd",
                  logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, bf16=False, max_length=64,
                  save_strategy="no", seed=0, gradient_checkpointing=True, packing=packing)  # fmt: skip
    args = RingSFTConfig(cp_size=2, **common) if ring else SFTConfig(**common)
    cls = RingSFTTrainer if ring else SFTTrainer
    model = tiny_model("llama", "ring" if ring else "sdpa", vocab_size=VOCAB)
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(_examples()),
                  processing_class=AutoTokenizer.from_pretrained(tok_dir))  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    cp = getattr(trainer, "cp_size", None)
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs], "cp": cp}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_ring_sft_trainer_cp2_matches_single_process_sft_trainer(tmp_path: Path, packing: bool) -> None:
    """Padded rows, and TRL's packing (padding-free rows of several documents, position_ids restarting
    at each; sdpa masks by them in the single-process run)."""
    _tokenizer(tmp_path / "tok")
    ring = run_ranks(2, sft_run, "ring", str(tmp_path / "ring"), str(tmp_path / "tok"), packing, timeout=300)
    ref = run_ranks(1, sft_run, "ref", str(tmp_path / "ref"), str(tmp_path / "tok"), packing, timeout=300)[0]
    assert ring[0] == ring[1] and ring[0]["cp"] == 2
    assert len(ref["loss"]) == len(ring[0]["loss"]) == 4
    for step, (a, b) in enumerate(zip(ring[0]["loss"], ref["loss"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: RingSFTTrainer loss {a} vs SFTTrainer {b}"
    for step, (a, b) in enumerate(zip(ring[0]["grad_norm"], ref["grad_norm"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: grad norm {a} vs {b}"


def test_seq_idx_must_follow_position_ids() -> None:
    from hf_ring.trainer.trl import drop_seq_idx

    pos = torch.tensor([[0, 1, 2, 0, 1]])
    good = {"input_ids": pos, "position_ids": pos, "seq_idx": torch.tensor([[0, 0, 0, 1, 1]], dtype=torch.int32)}
    assert "seq_idx" not in drop_seq_idx(good)
    with pytest.raises(ValueError, match="seq_idx does not follow its position_ids"):
        drop_seq_idx({**good, "seq_idx": torch.tensor([[0, 0, 1, 1, 1]])})
    with pytest.raises(ValueError, match="seq_idx does not follow"):
        drop_seq_idx({"input_ids": pos, "seq_idx": good["seq_idx"]})
