"""RULER's tasks, generated offline by hf_ring's own code, at exact lengths in tokens of any tokenizer.

RULER (Hsieh et al., arXiv 2404.06654; NVIDIA/RULER's synthetic task scripts, and lm-evaluation-harness
0.4.x's ``niah_*``, ``ruler_vt``, ``ruler_cwe``, ``ruler_fwe`` and ``ruler_qa_*`` tasks) defines each task
by a prompt template, how its context is filled, the expected answers, how many tokens to generate and
how the output is scored. The prompt templates below are RULER's (its task definitions, Apache-2.0,
NVIDIA); the generators are hf_ring's:

==================  ========================================================================  =========
task                context (RULER's definition)                                              answers
==================  ========================================================================  =========
niah_single_1       noise sentences, 1 needle "One of the special magic numbers for KEY is:    the value
                    VALUE." (key: adjective-noun, value: 7 digits)
niah_single_2       essay haystack (``haystack_file``; else the noise sentences), same needle  the value
niah_single_3       essay haystack, the value a UUID                                           the value
niah_multikey_1     essay haystack, 4 needles with different keys, one asked for               its value
niah_multikey_2     every haystack line a needle of another key (numbers)                      the value
niah_multikey_3     every haystack line a needle of another key (UUID keys and values)          the value
niah_multivalue     essay haystack, 4 values for one key                                       all 4
niah_multiquery     essay haystack, 4 needles, all 4 keys asked for                            all 4
vt                  noise sentences with one chain of 4 hops "VAR B = VAR A" from a 5-digit    the 5
                    value, one worked example before it                                        variables
cwe                 a numbered list: 10 words 30 times each, the others 3 times (6 and 1      the 10
                    below 4K), one worked example before it                                    words
fwe                 coded words (6 letters) drawn by a Zipf law (alpha 2), the first "..."     top 3
qa_1, qa_2          documents of SQuAD / HotpotQA (a local file, never fetched), one holds      the
                    the answer; "Document i:" headers                                          answers
==================  ========================================================================  =========

Generated tokens: 128 for NIAH, 30 for vt, 120 for cwe, 50 for fwe, 32 for qa. Scores: the share of
the expected answers that appear in the output (``string_match_all``), or whether any does
(``string_match_part``, qa), case-insensitive, after stripping the output (``ruler_score``).

**Lengths.** A sample of length ``L`` has exactly ``L - tokens_to_generate`` prompt tokens (RULER's
``max_seq_length`` counts the generated tokens too, and its prompts come out up to a haystack unit
short): the context is filled with as many haystack units as fit (searched once per task and length,
then checked per sample), and the few tokens left (fewer than one unit) are noise-sentence tokens right
after the context. The prompt is ``BOS + tokens(instruction and context) + filler + tokens(question
and answer prefix)``; ``Sample.text`` is its decoded text.

**Seeds.** Sample ``i`` of task ``t`` at length ``L`` draws from ``random.Random`` seeded by a CRC of
``(seed, t, L, i)``: the same on every rank and every run.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from .ruler_words import key_words, word_pool
from .runtime import EvalError

__all__ = ["NOISE", "Sample", "TASKS", "TaskGenerator", "ruler_score", "string_match_all", "string_match_part"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
    "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} "
    "for {query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_PREFIX = " Answer:"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # where essay needles may go: 40 depths from 0 to 100 %


@dataclass(frozen=True)
class Sample:
    """One prompt: ``ids`` (exactly ``length - tokens_to_generate`` of them), its decoded ``text``, the
    expected ``answers`` and how they are scored (``metric``: ``"all"`` or ``"part"``)."""

    task: str
    length: int
    index: int
    ids: list[int]
    text: str
    answers: list[str]
    tokens_to_generate: int
    metric: str = "all"


@dataclass(frozen=True)
class Spec:
    """One task's definition (see the module docstring's table)."""

    kind: str
    tokens_to_generate: int
    metric: str = "all"
    options: dict[str, Any] = field(default_factory=dict)


def _niah(haystack: str, k: str = "words", v: str = "numbers", nk: int = 1, nv: int = 1, nq: int = 1) -> Spec:
    return Spec("niah", 128, options={"haystack": haystack, "key": k, "value": v, "nk": nk, "nv": nv, "nq": nq})


TASKS: dict[str, Spec] = {
    "niah_single_1": _niah("noise"),
    "niah_single_2": _niah("essay"),
    "niah_single_3": _niah("essay", v="uuids"),
    "niah_multikey_1": _niah("essay", nk=4),
    "niah_multikey_2": _niah("needle"),
    "niah_multikey_3": _niah("needle", k="uuids", v="uuids"),
    "niah_multivalue": _niah("essay", nv=4),
    "niah_multiquery": _niah("essay", nq=4),
    "vt": Spec("vt", 30, options={"chains": 1, "hops": 4}),
    "cwe": Spec("cwe", 120, options={"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": Spec("fwe", 50, options={"alpha": 2.0, "word_len": 6}),
    "qa_1": Spec("qa", 32, "part", {"dataset": "squad"}),
    "qa_2": Spec("qa", 32, "part", {"dataset": "hotpotqa"}),
}


# --- scoring (RULER's string match) ---------------------------------------------------------------


def clean_output(text: str) -> str:
    """RULER's post-processing of a prediction: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(output: str, answers: list[str]) -> float:
    """The share of ``answers`` found in ``output`` (case-insensitive)."""
    out = output.lower()
    return sum(a.lower() in out for a in answers) / len(answers)


def string_match_part(output: str, answers: list[str]) -> float:
    """1 when any of ``answers`` is found in ``output`` (case-insensitive), else 0."""
    out = output.lower()
    return float(any(a.lower() in out for a in answers))


def ruler_score(output: str, answers: list[str], metric: str = "all") -> float:
    """One sample's score in [0, 1], as RULER scores it (its per-task mean times 100 is RULER's figure)."""
    fn = string_match_all if metric == "all" else string_match_part
    return fn(clean_output(output), answers)


# --- generators ----------------------------------------------------------------------------------


def _seed(seed: int, task: str, length: int, index: int) -> int:
    return zlib.crc32(f"{seed}/{task}/{length}/{index}".encode())


def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return rng.choice(key_words())


def _sentences(text: str) -> list[str]:
    """A text cut after every ``.``, ``!`` or ``?`` followed by white space (an essay haystack's sentences)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


class TaskGenerator:
    """Samples of one task for ``tokenizer`` (any Hugging Face tokenizer).

    ``haystack_file``: a text for the essay haystack (default: the noise sentences); ``qa_file``: SQuAD
    (v2, ``data/paragraphs/qas``) or HotpotQA (a list of ``question/answer/context``) JSON, read locally.
    ``make(length, index)`` returns a ``Sample``; ``EvalError`` when ``length`` cannot hold the task."""

    def __init__(
        self, task: str, tokenizer: Any, seed: int = 0, haystack_file: str | None = None, qa_file: str | None = None
    ) -> None:
        if task not in TASKS:
            raise EvalError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
        self.task, self.spec, self.tok, self.seed = task, TASKS[task], tokenizer, seed
        self.opts = self.spec.options
        self.essay: list[str] | None = None
        if self.opts.get("haystack") == "essay" and haystack_file:
            try:
                words = re.sub(r"\s+", " ", open(haystack_file).read()).strip().split(" ")
            except OSError as e:
                raise EvalError(f"cannot read the haystack {haystack_file}: {e}") from None
            if len(words) < 10:
                raise EvalError(f"the haystack {haystack_file} has fewer than 10 words")
            self.essay = words
        self.qa = _read_qa(qa_file, self.opts["dataset"]) if self.spec.kind == "qa" else None
        self.prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])
        self.filler = self._encode(" " + " ".join([NOISE] * 8))
        self.sizes: dict[int, int] = {}

    @property
    def haystack(self) -> str:
        """What fills the context: ``essay: FILE``, ``noise`` or the task's own."""
        h = self.opts.get("haystack")
        if h == "essay":
            return "essay" if self.essay is not None else "noise (no haystack file)"
        return h or {"vt": "noise", "cwe": "word list", "fwe": "coded words", "qa": "documents"}[self.spec.kind]

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _count(self, parts: tuple[str, str]) -> int:
        return len(self.prefix) + len(self._encode(parts[0])) + len(self._encode(parts[1]))

    # each build returns ((text up to the end of the context, question and answer prefix), answers)
    def _build(self, size: int, rng: random.Random) -> tuple[tuple[str, str], list[str]]:
        return getattr(self, f"_build_{self.spec.kind}")(size, rng)

    def _build_niah(self, size: int, rng: random.Random) -> tuple[tuple[str, str], list[str]]:
        o = self.opts
        nk = max(o["nk"], o["nq"])
        keys, values, needles = [], [], []
        for _ in range(nk):
            keys.append(_value(rng, o["key"]))
            values.append([_value(rng, o["value"]) for _ in range(o["nv"])])
            needles += [NEEDLE.format(type_needle_v=o["value"], key=keys[-1], value=v) for v in values[-1]]
        rng.shuffle(needles)
        if self.opts["haystack"] == "essay" and self.essay is not None:
            words = (self.essay * (size // len(self.essay) + 1))[:size]
            sents = _sentences(" ".join(words))
            cuts = sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
            pieces, last = [], 0
            for cut, needle in zip(cuts, needles):
                pieces += [" ".join(sents[last:cut]), needle]
                last = cut
            context = " ".join(p for p in [*pieces, " ".join(sents[last:])] if p)
        else:
            if self.opts["haystack"] == "needle":
                lines = [
                    NEEDLE.format(type_needle_v=o["value"], key=_value(rng, o["key"]), value=_value(rng, o["value"]))
                    for _ in range(size)
                ]
            else:
                lines = [NOISE] * size
            for at, needle in zip(sorted((rng.randint(0, size) for _ in needles), reverse=True), needles):
                lines.insert(at, needle)
            context = "\n".join(lines)
        asked = rng.sample(range(nk), o["nq"])
        query = keys[asked[0]] if o["nq"] == 1 else ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
        answers = [v for i in asked for v in values[i]]
        template, prefix, kind = NIAH_TEMPLATE, NIAH_PREFIX, o["value"]
        if o["nq"] * o["nv"] == 1:  # one answer: RULER's singular wording
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            prefix, kind = prefix.replace("are", "is"), kind[:-1]
        text = template.format(type_needle_v=kind, context=context, query=query)
        cut = text.index("\nWhat ")
        return (text[:cut], text[cut:] + prefix.format(type_needle_v=kind, query=query)), answers

    def _chain(self, rng: random.Random, letters: int, value: str) -> tuple[list[str], list[str]]:
        hops = self.opts["hops"]
        names: list[str] = []
        while len(names) < hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=letters))
            if name not in names:
                names.append(name)
        return names, [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]

    def _vt_text(self, size: int, rng: random.Random, letters: int, value: str) -> tuple[str, str, list[str]]:
        names, chain = self._chain(rng, letters, value)
        lines = [NOISE] * size
        for j, at in enumerate(sorted(rng.randint(0, size) for _ in chain)):
            lines.insert(at + j, chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        text = VT_TEMPLATE.format(context=context, query=value)
        return text, VT_PREFIX.format(num_v=self.opts["hops"] + 1, query=value), names

    def _build_vt(self, size: int, rng: random.Random) -> tuple[tuple[str, str], list[str]]:
        # one worked example (3-letter names, 5 noise lines), then the task
        ex_text, ex_prefix, ex_names = self._vt_text(5, rng, 3, str(rng.randint(10000, 99999)))
        example = ex_text + ex_prefix + " ".join(ex_names) + "\n\n"
        text, prefix, names = self._vt_text(size, rng, 5, str(rng.randint(10000, 99999)))
        cut = text.index("\nQuestion: ")
        return (example + text[:cut], text[cut:] + prefix), names

    def _word_list(self, words: list[str], repeats: tuple[int, int], rng: random.Random) -> tuple[str, list[str]]:
        common, rest = words[:10], words[10:]
        listed = common * repeats[0] + rest * repeats[1]
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    def _build_cwe(self, size: int, rng: random.Random) -> tuple[tuple[str, str], list[str]]:
        o = self.opts
        short = self._length < 4096
        pool = word_pool(max(size + 10, 600))
        ex_ctx, ex_answer = self._word_list(rng.sample(pool, 20 if short else 40), (3, 1) if short else (10, 3), rng)
        example = (
            CWE_TEMPLATE.format(context=ex_ctx)
            + CWE_PREFIX
            + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer))
        )
        repeats = (6, 1) if short else (o["freq_cw"], o["freq_ucw"])
        ctx, answers = self._word_list(rng.sample(pool, size + o["num_cw"]), repeats, rng)
        text = example + "\n" + CWE_TEMPLATE.format(context=ctx)
        cut = text.rindex("\nQuestion: ")
        return (text[:cut], text[cut:] + CWE_PREFIX), answers

    def _build_fwe(self, size: int, rng: random.Random) -> tuple[tuple[str, str], list[str]]:
        o = self.opts
        vocab_size = max(16, (self._length - self.spec.tokens_to_generate) // 50)
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=o["word_len"])))
        words = sorted(vocab)
        rng.shuffle(words)
        words[0] = "..."  # the most frequent is noise
        zeta = math.pi**2 / 6 if o["alpha"] == 2.0 else sum(k ** -o["alpha"] for k in range(1, 100_000))
        drawn = [w for k, w in enumerate(words, 1) for _ in range(int(size * k ** -o["alpha"] / zeta))]
        rng.shuffle(drawn)
        text = FWE_TEMPLATE.format(context=" ".join(drawn))
        cut = text.index("\nQuestion: ")
        return (text[:cut], text[cut:] + FWE_PREFIX), words[1:4]

    def _build_qa(self, size: int, rng: random.Random) -> tuple[tuple[str, str], list[str]]:
        assert self.qa is not None
        questions, docs = self.qa
        q = questions[self._index % len(questions)]
        others = [i for i in range(len(docs)) if i not in q["docs"]]
        chosen = list(q["docs"]) + rng.sample(others, min(len(others), max(0, size - len(q["docs"]))))
        if size > len(docs):  # more documents than the file has: repeated
            chosen = (chosen * (size // len(chosen) + 1))[:size]
        rng.shuffle(chosen)
        context = "\n\n".join(f"Document {i + 1}:\n{docs[d]}" for i, d in enumerate(chosen))
        text = QA_TEMPLATE.format(context=context, query=q["question"])
        cut = text.rindex("\n\nAnswer the question")
        return (text[:cut], text[cut:] + QA_PREFIX), q["answers"]

    # --- sizing ----------------------------------------------------------------------------------

    def _unit(self) -> int:
        return {"niah": 500 if self.essay is not None else 25, "vt": 10, "cwe": 10, "fwe": 10, "qa": 2}[self.spec.kind]

    def _size(self, length: int) -> int:
        """The most haystack units that fit ``length`` (searched once per length, with sample 0)."""
        if length in self.sizes:
            return self.sizes[length]
        budget = length - self.spec.tokens_to_generate
        rng = random.Random(_seed(self.seed, self.task, length, 0))
        state = rng.getstate()

        def fits(n: int) -> bool:
            rng.setstate(state)
            return self._count(self._build(n, rng)[0]) <= budget

        if not fits(1):
            raise EvalError(
                f"RULER {self.task}: {length} tokens cannot hold its prompt and {self.spec.tokens_to_generate} "
                "generated tokens; give a longer length"
            )
        rng.setstate(state)
        base = self._count(self._build(1, rng)[0])
        rng.setstate(state)
        per = max(1e-3, (self._count(self._build(9, rng)[0]) - base) / 8)  # tokens per haystack unit
        guess = max(1, int((budget - base) / per))
        if fits(guess):  # bracket the answer around the estimate: fits(lo), not fits(hi)
            lo, hi = guess, guess + 1 + guess // 20
            while fits(hi):
                lo, hi = hi, hi + 1 + hi // 20
        else:
            lo, hi = max(1, guess - 1 - guess // 20), guess
            while not fits(lo):
                lo, hi = max(1, lo - 1 - lo // 20), lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        self.sizes[length] = lo
        return lo

    def make(self, length: int, index: int) -> Sample:
        """Sample ``index`` at ``length`` tokens (prompt ``length - tokens_to_generate``, exactly)."""
        self._length, self._index = length, index
        size = self._size(length)
        budget = length - self.spec.tokens_to_generate
        while True:
            rng = random.Random(_seed(self.seed, self.task, length, index))
            parts, answers = self._build(size, rng)
            head, tail = self._encode(parts[0]), self._encode(parts[1])
            gap = budget - len(self.prefix) - len(head) - len(tail)
            if gap >= 0:
                break
            if size == 1:
                raise EvalError(f"RULER {self.task}: sample {index} does not fit {length} tokens")
            size = max(1, size - self._unit())
        fill = (self.filler * (gap // max(1, len(self.filler)) + 1))[:gap]
        ids = self.prefix + head + fill + tail
        text = self.tok.decode(ids, skip_special_tokens=True)
        return Sample(self.task, length, index, ids, text, answers, self.spec.tokens_to_generate, self.spec.metric)


def _read_qa(path: str | None, dataset: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Questions (``question``, ``answers``, ``docs``: indices of the documents that hold the answer) and
    documents of a local SQuAD v2 or HotpotQA JSON file."""
    if not path:
        raise EvalError(
            f"RULER's QA task on {dataset} needs its data: download it yourself and give --qa-file FILE "
            "(SQuAD v2 dev JSON for qa_1, HotpotQA dev distractor JSON for qa_2); hf_ring never fetches it"
        )
    try:
        data = json.load(open(path))
    except (OSError, json.JSONDecodeError) as e:
        raise EvalError(f"cannot read the QA file {path}: {e}") from None
    questions: list[dict[str, Any]] = []
    if dataset == "squad":
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        at = {c: i for i, c in enumerate(docs)}
        for d in data["data"]:
            for p in d["paragraphs"]:
                for qa in p["qas"]:
                    if not qa.get("is_impossible") and qa["answers"]:
                        questions.append({"question": qa["question"], "answers": [a["text"] for a in qa["answers"]],
                                          "docs": [at[p["context"]]]})  # fmt: skip
    else:
        docs = sorted({f"{t}\n{''.join(s)}" for d in data for t, s in d["context"]})
        at = {c: i for i, c in enumerate(docs)}
        for d in data:
            questions.append({"question": d["question"], "answers": [d["answer"]],
                              "docs": [at[f"{t}\n{''.join(s)}"] for t, s in d["context"]]})  # fmt: skip
    if not questions:
        raise EvalError(f"the QA file {path} holds no answerable question")
    return questions, docs
