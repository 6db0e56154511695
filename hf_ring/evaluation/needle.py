"""Needle in a haystack: is a fact placed at every depth of every length retrieved?

For each cell ``(length, depth)`` a sequence of exactly ``length`` tokens is built: the haystack,
with the needle (which holds a random key) after ``depth`` percent of it, then the question and the
answer. The model reads the whole sequence once (context-parallel prefill: each rank of the CP
group holds ``1/P`` of it) and is scored *teacher-forced* on the answer tokens -- no generation:

- ``accuracy``: every answer token is the argmax of the logits before it (equal to greedy decoding
  whenever the answer is right);
- ``answer_logprob``: the mean log-probability of the answer tokens.

Only the logits of the answer positions are computed (``logits_to_keep``), on the rank that holds
them; a ``[3, A]`` tensor is summed over the CP group. Sequences come from a ``PasskeySource``
(the demo's tiny vocabulary, token ids, no tokenizer) or a ``TextSource`` (a tokenizer, a haystack
text: a generated filler by default, or a file of the user's).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..data.passkey import ASK, DIGITS, HAY, NEEDLE, VOCAB, digit_token
from ..transformers.batch import shard_batch
from ..transformers.context import CONTEXT_KEY
from .prompts import DEFAULT_ANSWER, DEFAULT_NEEDLE, DEFAULT_QUESTION
from .runtime import EvalError, Runtime, check_ring, progress

__all__ = ["Case", "PasskeySource", "TextSource", "evaluate_needle", "score_answer", "summarise"]

# The generated filler: plain sentences that carry no fact (ours, free to use).
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    " The river runs to the sea. The hills are quiet. Clouds pass over the fields."
)


@dataclass(frozen=True)
class Case:
    """One sequence: ``ids [N]``, the answer at ``ids[answer_at:]``, the needle at ``needle_at``."""

    ids: Tensor
    answer_at: int
    needle_at: int
    key: str


def _generator(seed: int, length: int, depth: float, sample: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{length}/{depth}/{sample}".encode()))


def _place(room: int, depth: float) -> int:
    return round(depth / 100 * room)


class PasskeySource:
    """The built-in passkey task of ``hf_ring.data.passkey`` (token ids; the demo's vocabulary):
    ``[hay .. NEEDLE d1..d5 .. hay ASK d1..d5]``, hay tokens drawn at random (the generated filler)."""

    mode = "passkey"
    min_length = 2 * (DIGITS + 1)

    def check_model(self, model: nn.Module) -> None:
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        if vocab < VOCAB:
            raise EvalError(
                f"the built-in passkey task uses token ids 0..{VOCAB - 1} but the model's vocabulary has {vocab}; "
                "give a model with a tokenizer (or --tokenizer) for the text needle"
            )

    def settings(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "haystack": "random hay tokens 0..31",
            "needle": "KEY d1..d5",
            "question": "ASK",
            "answer": "d1..d5",
        }

    def make(self, length: int, depth: float, seed: int, sample: int) -> Case:
        if length < self.min_length:
            raise EvalError(
                f"length {length} is shorter than the passkey's needle, question and answer ({self.min_length} tokens)"
            )
        g = _generator(seed, length, depth, sample)
        hay = torch.randint(0, HAY, (length,), generator=g)
        digits = [int(d) for d in torch.randint(0, 10, (DIGITS,), generator=g)]
        answer = torch.tensor([digit_token(j, d) for j, d in enumerate(digits)])
        room = length - self.min_length
        at = _place(room, depth)
        ids = torch.cat((hay[:at], torch.tensor([NEEDLE]), answer, hay[at:room], torch.tensor([ASK]), answer))
        return Case(ids, length - DIGITS, at, "".join(map(str, digits)))


class TextSource:
    """A text needle with a tokenizer: ``[BOS] haystack[:k] needle haystack[k:] question answer``.

    ``needle``, ``question`` and ``answer`` may hold ``{key}``, a random five-digit number per
    sample. The haystack (the generated filler, or the text of ``haystack_file``) is tokenized once
    and repeated as needed; the needle goes in after the last sentence end at or before ``depth``
    percent of it (looking back at most 256 tokens)."""

    mode = "text"

    def __init__(
        self,
        tokenizer: Any,
        haystack_file: str | None = None,
        needle: str | None = None,
        question: str | None = None,
        answer: str | None = None,
    ) -> None:
        if (needle is None) != (question is None):
            raise EvalError("--needle and --question go together (the question asks for what the needle holds)")
        self.tok = tokenizer
        self.needle = needle if needle is not None else DEFAULT_NEEDLE
        self.question = question if question is not None else DEFAULT_QUESTION
        self.answer = answer if answer is not None else DEFAULT_ANSWER
        if "{key}" not in self.answer and answer is None and "{key}" not in self.needle:
            raise EvalError("--needle has no {key}: give the expected --answer")
        self.haystack_file = haystack_file
        if haystack_file:
            try:
                text = Path(haystack_file).read_text()
            except OSError as e:
                raise EvalError(f"cannot read the haystack {haystack_file}: {e}") from None
        else:
            text = FILLER * 64
        hay = self._encode(text)
        if not hay:
            raise EvalError(f"the haystack {haystack_file} holds no tokens")
        self.hay = torch.tensor(hay, dtype=torch.long)
        self.prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])  # BOS, if the model uses one
        ends = [i for i in set(hay) if tokenizer.decode([i]).rstrip().endswith((".", "!", "?", "\n"))]
        self.ends = torch.isin(self.hay, torch.tensor(ends, dtype=torch.long))  # a sentence ends after it
        self.min_length = len(self.prefix) + sum(len(p) for p in self._parts("99999"))

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _parts(self, key: str) -> tuple[list[int], list[int], list[int]]:
        return tuple(self._encode(t.replace("{key}", key)) for t in (self.needle, self.question, self.answer))

    def check_model(self, model: nn.Module) -> None:
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        top = max(int(self.hay.max()), *(max(p, default=0) for p in self._parts("99999")))
        if vocab and top >= vocab:
            raise EvalError(f"the tokenizer gives token id {top} but the model's vocabulary has {vocab}")

    def settings(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tokenizer": getattr(self.tok, "name_or_path", None),
            "haystack": self.haystack_file or "generated filler",
            "needle": self.needle,
            "question": self.question,
            "answer": self.answer,
        }

    def make(self, length: int, depth: float, seed: int, sample: int) -> Case:
        g = _generator(seed, length, depth, sample)
        key = str(int(torch.randint(10_000, 100_000, (1,), generator=g)))
        needle, question, answer = self._parts(key)
        room = length - len(self.prefix) - len(needle) - len(question) - len(answer)
        if room < 0:
            raise EvalError(f"length {length} is shorter than the needle, question and answer ({length - room} tokens)")
        reps = -(-room // len(self.hay))
        hay = self.hay.repeat(reps)[:room]
        at = _place(room, depth)
        ends = self.ends.repeat(reps)[:room]
        back = ends[max(0, at - 256) : at].nonzero()
        if at > 0 and len(back):  # right after a sentence end
            at = max(0, at - 256) + int(back[-1]) + 1
        t = torch.tensor
        ids = torch.cat((t(self.prefix, dtype=torch.long), hay[:at], t(needle), hay[at:], t(question), t(answer)))
        return Case(ids.long(), length - len(answer), len(self.prefix) + at, key)


def score_answer(
    model: nn.Module, ids: Tensor, answer_at: int, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor]:
    """Teacher-forced scores of the answer ``ids[answer_at:]`` after one prefill of ``ids [N]``.

    Every rank of ``group`` (the CP group; ``None``: the default one) passes the same ``ids``; each
    holds its zigzag shard and computes the logits only of the answer positions it holds
    (``logits_to_keep``), and a ``[3, A]`` tensor is summed over the group. Returns, on every rank,
    ``logprob [A]`` (float64: the log-probability of each answer token) and ``hit [A]`` (bool: the
    token is the argmax)."""
    n = ids.shape[0]
    a = n - answer_at
    if not 0 < answer_at < n:
        raise EvalError(f"the answer must start inside the sequence (at {answer_at} of {n})")
    device = next(model.parameters()).device
    kwargs = shard_batch({"input_ids": ids[None].to(device)}, group=group)
    ctx = kwargs[CONTEXT_KEY]
    pos = kwargs["position_ids"][0]  # global positions of the local rows [S_local]
    local = ((pos >= answer_at - 1) & (pos < n - 1)).nonzero().squeeze(1)  # rows whose next token is an answer token
    j = pos[local] - (answer_at - 1)  # which answer token each one predicts
    with torch.no_grad():
        logits = model(**kwargs, logits_to_keep=local).logits[0].float()  # [k, V]
    if ctx.cross_rank_calls.total == 0:
        raise EvalError(
            "the model never ran ring attention or a context-parallel token mixer (it computes attention "
            "itself); load a model that uses transformers' attention registry with attn_implementation='ring'"
        )
    target = ids.to(device)[answer_at + j]
    out = torch.zeros(3, a, dtype=torch.float64, device=device)
    if len(local):
        out[0, j] = logits.log_softmax(-1).gather(1, target[:, None]).squeeze(1).double()
        out[1, j] = (logits.argmax(-1) == target).double()
        out[2, j] = 1.0
    if ctx.size > 1:
        dist.all_reduce(out, group=ctx.group)
    if not bool((out[2] == 1).all()):
        raise RuntimeError(f"score_answer: answer positions held {out[2].tolist()} times across the CP group")
    return out[0].cpu(), out[1].cpu().bool()


def evaluate_needle(
    model: nn.Module,
    source: PasskeySource | TextSource,
    lengths: list[int],
    depths: list[float],
    rt: Runtime,
    samples: int = 1,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One record per ``(length, depth)`` cell, sorted by length then depth, on every rank.

    The cells are split over the DP replicas (longest first, so that a sequence too long for
    memory fails in the first minute); each replica's CP group prefills its cells one by one."""
    check_ring(model, "hf-ring eval needle")
    source.check_model(model)
    for n in lengths:  # every length must fit before any model call
        source.make(n, 0, seed, 0)
        if n < 2 * rt.cp_size:
            raise EvalError(f"length {n} is shorter than 2 x the CP size ({rt.cp_size}): use fewer processes")
    cells = sorted(((n, d) for n in lengths for d in depths), key=lambda c: (-c[0], c[1]))
    local = []
    for n, d in progress(rt.mine(cells), rt, "needle"):
        start = time.perf_counter()
        runs = []
        for s in range(samples):
            case = source.make(n, d, seed, s)
            logprob, hit = score_answer(model, case.ids, case.answer_at, rt.cp_group)
            runs.append(
                {
                    "key": case.key,
                    "needle_at": case.needle_at,
                    "retrieved": bool(hit.all()),
                    "answer_logprob": float(logprob.mean()),
                    "token_logprobs": logprob.tolist(),
                }
            )
        local.append(
            {
                "length": n,
                "depth": d,
                "accuracy": sum(r["retrieved"] for r in runs) / samples,
                "answer_logprob": sum(r["answer_logprob"] for r in runs) / samples,
                "answer_tokens": len(runs[0]["token_logprobs"]),
                "seconds": round(time.perf_counter() - start, 3),
                "samples": runs,
            }
        )
    return sorted(rt.gather(local), key=lambda r: (r["length"], r["depth"]))


def summarise(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean accuracy and answer log-probability overall and per length."""
    by_len: dict[int, list[dict[str, Any]]] = {}
    for c in cells:
        by_len.setdefault(c["length"], []).append(c)

    def mean(rows: list[dict[str, Any]], k: str) -> float:
        return sum(r[k] for r in rows) / len(rows)

    return {
        "accuracy": mean(cells, "accuracy"),
        "answer_logprob": mean(cells, "answer_logprob"),
        "accuracy_by_length": {str(n): mean(rows, "accuracy") for n, rows in by_len.items()},
    }
