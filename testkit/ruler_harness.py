"""lm-evaluation-harness's RULER tasks next to ``hf-ring eval ruler`` on the same tiny model and the same
samples: lm-eval makes the samples and runs its HF model (one process, ``model.generate``); hf_ring
decodes the same contexts under context parallelism and scores them with its own RULER scorer.

Offline: the tokenizer is ``testkit.tokenizers``' (trained here), the model a tiny random Llama saved
next to it; only the RULER tasks that need no download run (the essay haystack and QA fetch data)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

# lm-eval task -> hf_ring task (the same RULER definition) -- the ones that need no download
OFFLINE_TASKS = {
    "niah_single_1": "niah_single_1",
    "niah_multikey_2": "niah_multikey_2",
    "niah_multikey_3": "niah_multikey_3",
    "ruler_vt": "vt",
    "ruler_cwe": "cwe",
    "ruler_fwe": "fwe",
}


def tiny_text_model(path: str | os.PathLike) -> str:
    """A 2-layer Llama over ``testkit.tokenizers``' tokenizer, saved with it at ``path``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from testkit.tokenizers import tiny_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def lm_eval_samples(model_dir: str, tasks: list[str], length: int, limit: int) -> list[dict[str, Any]]:
    """lm-eval's samples of ``tasks`` at ``length`` (its ``max_seq_lengths`` metadata), with its model's
    outputs and scores: ``task``, ``context`` (the text its model got), ``max_gen``, ``answers``,
    ``output``, ``score``."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # lm-eval's NIAH module asks nltk for its sentence splitter at import and downloads it when missing
    # (waiting on the network here); only the essay haystack uses it, and no task run here has one
    import tempfile

    nltk_data = Path(tempfile.mkdtemp(prefix="hf_ring_nltk_"))
    (nltk_data / "tokenizers" / "punkt_tab").mkdir(parents=True)
    os.environ["NLTK_DATA"] = str(nltk_data)
    import lm_eval

    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": model_dir, "tokenizer": model_dir, "dtype": "float32", "max_length": length + 256},
        tasks=tasks, metadata={"max_seq_lengths": [length]}, limit=limit, batch_size=1, device="cpu",
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )  # fmt: skip
    rows = []
    for task in tasks:
        for s in out["samples"][task]:
            context, gen = s["arguments"][0][0], s["arguments"][0][1]
            rows.append({"task": task, "index": s["doc"]["index"], "context": context, "max_gen": gen["max_gen_toks"],
                         "answers": list(s["doc"]["outputs"]), "output": s["filtered_resps"][0],
                         "score": float(s[str(length)])})  # fmt: skip
    return rows


def hf_ring_outputs(model_dir: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On every rank of a launched group: greedy CP decoding of each row's context (tokenized as lm-eval's
    HF model tokenizes it: ``tokenizer(text)``), decoded and scored by hf_ring."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_ring  # noqa: F401  (registers "ring")
    from hf_ring.evaluation.generate import greedy_generate
    from hf_ring.evaluation.ruler_tasks import ruler_score

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="ring", dtype=torch.float32).eval()
    out = []
    for r in rows:
        ids = torch.tensor([tok(r["context"])["input_ids"]])
        new = greedy_generate(model, ids, r["max_gen"], eos_token_id=tok.eos_token_id)[0].tolist()
        new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        text = tok.decode(new, skip_special_tokens=True)
        out.append({"output": text, "score": ruler_score(text, r["answers"]), "prompt_tokens": ids.shape[1]})
    return out


def table(samples: list[dict[str, Any]]) -> str:
    """Markdown: per task, lm-eval's and hf_ring's mean scores and how many outputs are equal, from the
    samples of a results file (lm-eval's fields plus ``hf_ring_output``, ``hf_ring_score``)."""
    lines = ["| lm-eval task | samples | lm-eval score | hf_ring score (CP = 2 decoding) | equal outputs |"]
    lines.append("|---|---|---|---|---|")
    for task in dict.fromkeys(r["task"] for r in samples):
        mine = [r for r in samples if r["task"] == task]
        a = 100 * sum(r["score"] for r in mine) / len(mine)
        b = 100 * sum(r["hf_ring_score"] for r in mine) / len(mine)
        same = sum(r["output"] == r["hf_ring_output"] for r in mine)
        lines.append(f"| {task} | {len(mine)} | {a:.1f} | {b:.1f} | {same}/{len(mine)} |")
    return "\n".join(lines)
