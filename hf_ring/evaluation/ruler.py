"""RULER with context-parallel prefill and greedy decoding over a sharded KV cache (``hf-ring eval ruler``).

Every ``(task, length, sample)`` is one prompt of exactly ``length - tokens_to_generate`` tokens
(``ruler_tasks.TaskGenerator``), decoded greedily by the CP group (``generate.greedy_generate``: every
rank keeps ``1/P`` of the prompt's keys and values) for the task's ``tokens_to_generate`` tokens or
until the tokenizer's end of sequence, and scored as RULER scores it (``ruler_tasks.ruler_score``).
The DP replicas split the samples (longest first). ``summarise`` gives the score per task and length
(in percent, RULER's figure) and RULER's average over the tasks per length.

``PasskeyTask`` is ``niah_single_1`` in the CPU demo's token ids (``hf_ring.data.passkey``: random hay
tokens, ``KEY d1..d5`` at a random place, ``ASK`` at the end, 5 digits to generate), for a model that
has no tokenizer.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch
from torch import nn

from ..data.passkey import ASK, DIGITS, HAY, NEEDLE, VOCAB, digit_token
from .generate import greedy_generate
from .ruler_tasks import TASKS, Sample, TaskGenerator, ruler_score
from .runtime import EvalError, Runtime, check_ring, progress

__all__ = ["DEFAULT_TASKS", "PasskeyTask", "evaluate_ruler", "summarise"]

DEFAULT_TASKS = [t for t in TASKS if not t.startswith("qa")]  # the 11 that need no downloaded data


class PasskeyTask:
    """``niah_single_1`` in the demo's token ids: one needle ``KEY d1..d5`` in random hay tokens, the
    question ``ASK``, 5 digit tokens to generate; the answer is the key's digits as text."""

    task = "niah_single_1"
    tokens_to_generate = DIGITS
    haystack = "random hay tokens 0..31"
    eos_token_id = None

    def make(self, length: int, index: int, seed: int = 0) -> Sample:
        room = length - DIGITS - (DIGITS + 1) - 1
        if room < 0:
            raise EvalError(f"the passkey task needs at least {2 * DIGITS + 2} tokens, got {length}")
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/passkey/{length}/{index}".encode()))
        hay = torch.randint(0, HAY, (room,), generator=g).tolist()
        digits = torch.randint(0, 10, (DIGITS,), generator=g).tolist()
        at = int(torch.randint(0, room + 1, (1,), generator=g))
        needle = [NEEDLE] + [digit_token(j, d) for j, d in enumerate(digits)]
        ids = hay[:at] + needle + hay[at:] + [ASK]
        key = "".join(map(str, digits))
        return Sample(self.task, length, index, ids, self.decode(ids), [key], DIGITS)

    @staticmethod
    def decode(ids: list[int]) -> str:
        """Digit tokens as their digits, every other token as a space."""
        first = digit_token(0, 0)
        return "".join(str((t - first) % 10) if first <= t < VOCAB else " " for t in ids)


def _sources(tasks: list[str], tokenizer: Any, seed: int, haystack: str | None, qa: str | None) -> dict[str, Any]:
    if tokenizer is None:
        bad = [t for t in tasks if t != "niah_single_1"]
        if bad:
            raise EvalError(
                f"without a tokenizer only niah_single_1 runs (in the demo's passkey token ids); {bad} need text: "
                "give --tokenizer, or a model directory that holds one"
            )
        return {"niah_single_1": PasskeyTask()}
    return {t: TaskGenerator(t, tokenizer, seed, haystack, qa) for t in tasks}


def evaluate_ruler(
    model: nn.Module,
    tokenizer: Any,
    tasks: list[str],
    lengths: list[int],
    rt: Runtime,
    samples: int = 1,
    seed: int = 0,
    haystack_file: str | None = None,
    qa_file: str | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """One record per ``(task, length, sample)``, on every rank, and each task's haystack.

    A record: ``task``, ``length``, ``sample``, ``output`` (the generated text), ``answers``, ``score`` in
    [0, 1], ``prompt_tokens``, ``generated_tokens``, ``seconds``. ``tokenizer`` ``None``: the passkey form
    of ``niah_single_1`` (token ids of ``hf_ring.data.passkey``)."""
    check_ring(model, "hf-ring eval ruler")
    sources = _sources(tasks, tokenizer, seed, haystack_file, qa_file)
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    items = sorted(((t, n, i) for t in tasks for n in lengths for i in range(samples)), key=lambda x: (-x[1], x))
    for t in tasks:  # every task must fit every length before the model runs
        for n in lengths:
            s = sources[t].make(n, 0, seed) if tokenizer is None else sources[t].make(n, 0)
            if vocab and max(s.ids) >= vocab:
                raise EvalError(f"the tokenizer gives token id {max(s.ids)} but the model's vocabulary has {vocab}")
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    local = []
    for task, n, i in progress(rt.mine(items), rt, "ruler", unit="sample"):
        src = sources[task]
        s = src.make(n, i, seed) if tokenizer is None else src.make(n, i)
        start = time.perf_counter()
        out = greedy_generate(model, torch.tensor([s.ids]), s.tokens_to_generate, group=rt.cp_group,
                              eos_token_id=eos)[0].tolist()  # fmt: skip
        seconds = time.perf_counter() - start
        if eos is not None and eos in out:
            out = out[: out.index(eos)]
        text = PasskeyTask.decode(out) if tokenizer is None else tokenizer.decode(out, skip_special_tokens=True)
        local.append({
            "task": task, "length": n, "sample": i, "output": text, "answers": s.answers,
            "score": ruler_score(text, s.answers, s.metric), "prompt_tokens": len(s.ids),
            "generated_tokens": len(out), "seconds": round(seconds, 3),
        })  # fmt: skip
    records = sorted(rt.gather(local), key=lambda r: (tasks.index(r["task"]), r["length"], r["sample"]))
    return records, {t: sources[t].haystack for t in tasks}


def summarise(records: list[dict[str, Any]], tasks: list[str], lengths: list[int]) -> dict[str, Any]:
    """``table``: per task, per length, the mean score in percent (RULER's figure); ``average``: per length,
    the mean of the tasks' figures (RULER's average); ``seconds_per_sample``: per length, mean seconds."""
    table: dict[str, dict[str, float]] = {}
    for t in tasks:
        table[t] = {}
        for n in lengths:
            scores = [r["score"] for r in records if r["task"] == t and r["length"] == n]
            table[t][str(n)] = round(100 * sum(scores) / len(scores), 2)
    average = {str(n): round(sum(table[t][str(n)] for t in tasks) / len(tasks), 2) for n in lengths}
    per_sample = {}
    for n in lengths:
        secs = [r["seconds"] for r in records if r["length"] == n]
        per_sample[str(n)] = round(sum(secs) / len(secs), 3)
    return {"table": table, "average": average, "seconds_per_sample": per_sample}
