"""``hf-ring eval needle``, ``hf-ring eval ppl`` and ``hf-ring eval ruler``: the subcommands, and the
functions they run (``run_needle``, ``run_ppl``, ``run_ruler``: the same in one process and on every
rank under ``torchrun`` / ``accelerate launch``; rank 0 writes the files). Building the parser imports
no torch: the runners import the evaluation modules when they run."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..errors import debug, exit_for
from ..planner.settings import tokens
from .prompts import DEFAULT_ANSWER, DEFAULT_NEEDLE, DEFAULT_QUESTION

__all__ = ["add_eval_parser", "run_needle", "run_ppl", "run_ruler"]

RULER_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]  # fmt: skip
RULER_SCORING = (
    "greedy decoding (context-parallel prefill, KV cache sharded across the CP group) of each task's tokens to "
    "generate; RULER's string match: share of the answers in the output (all), or any of them (part: qa)"
)

SCORING = (
    "teacher-forced: one prefill of the whole sequence, answer tokens scored from the logits before them "
    "(accuracy: every answer token is the argmax; answer_logprob: their mean log-probability); no generation"
)
NO_MATPLOTLIB = "matplotlib is not installed: wrote {json} only (pip install matplotlib for {png})"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a model directory or hub id (loaded with attn_implementation='ring')")
    p.add_argument("--adapter", help="a PEFT adapter directory, merged into the model")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", help="tokenizer directory or id (default: the adapter's, else MODEL's)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--cp-size", type=int, help="processes per CP group under a launcher (default: all of them)")


def add_eval_parser(sub: Any) -> None:
    """Add ``eval needle`` and ``eval ppl`` to the ``hf-ring`` subparsers ``sub``."""
    ev = sub.add_parser(
        "eval",
        help="long-context evaluation: needle heatmap, loss by position, RULER",
        description="Long-context evaluation with context-parallel prefill: run in one process, or "
        "under torchrun / accelerate launch (CP groups prefill one sequence; DP replicas split the "
        "work). See docs/evaluation.md.",
    )
    tasks = ev.add_subparsers(dest="task", required=True)
    n = tasks.add_parser(
        "needle",
        help="needle-in-a-haystack length x depth heatmap",
        description="For each (length, depth) cell, a needle holding a random key is placed at that "
        "depth of a haystack, followed by the question; the answer is scored teacher-forced (no "
        "generation). Writes OUT/needle.json and OUT/needle.png.",
    )
    _common(n)
    n.add_argument(
        "--lengths",
        required=True,
        help="sequence lengths in tokens: 1K,2K,...,1M ('...' continues the ratio; 1K = 1024)",
    )
    n.add_argument(
        "--depths",
        default="0,10,...,100",
        help="needle depths in percent of the haystack: 0,10,...,100 ('...' continues the step; default 0,10,...,100)",
    )
    n.add_argument("--samples", type=int, default=1, help="sequences (keys) per cell (default 1)")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument(
        "--mode",
        choices=["auto", "passkey", "text"],
        default="auto",
        help="passkey: the built-in task in the demo's token ids (no tokenizer); text: a tokenizer and a "
        "text haystack; auto: text when a tokenizer is found, else passkey",
    )
    n.add_argument("--haystack", help="a text file to use as the haystack (default: a generated filler)")
    n.add_argument("--needle", help=f"the needle text, with {{key}} for the key (default {DEFAULT_NEEDLE!r})")
    n.add_argument("--question", help=f"the question after the haystack (default {DEFAULT_QUESTION!r})")
    n.add_argument("--answer", help=f"the expected answer, with {{key}} (default {DEFAULT_ANSWER!r})")
    n.set_defaults(func=cmd_needle)
    p = tasks.add_parser(
        "ppl",
        help="loss by position bucket over long documents",
        description="Next-token loss by position bucket over the first SEQ_LEN tokens of each "
        "document of at least that length (chunked LM head: no full logits). Writes OUT/ppl.json "
        "and OUT/ppl.png.",
    )
    _common(p)
    p.add_argument(
        "--data",
        required=True,
        help="JSON lines: input_ids per line (scripts/tokenize_jsonl.py), or text under --field with a tokenizer",
    )
    p.add_argument("--seq-len", required=True, type=tokens, help="tokens per document: 32K, 128K, 1M")
    p.add_argument("--buckets", type=int, default=16, help="position buckets (default 16)")
    p.add_argument("--docs", type=int, help="at most this many documents (default: every long enough one)")
    p.add_argument("--field", default="text", help="the text field of --data lines without input_ids")
    p.add_argument("--chunk-size", type=int, help="rows of logits at a time (default: about 256 MB of them)")
    p.set_defaults(func=cmd_ppl)
    r = tasks.add_parser(
        "ruler",
        help="RULER's synthetic tasks, generated greedily with context-parallel prefill",
        description="RULER (arXiv 2404.06654): needle-in-a-haystack variants, variable tracking, common and "
        "frequent words, QA, generated offline by hf_ring at exact lengths in tokens, answered by greedy "
        "decoding with the KV cache sharded across the CP group, scored by RULER's string match. Writes "
        "OUT/ruler.json (one record per task, length and sample) and OUT/ruler.png.",
    )
    _common(r)
    r.add_argument("--lengths", required=True, help="lengths in tokens, generation included: 4K,8K,...,1M")
    r.add_argument(
        "--tasks",
        default=",".join(RULER_TASKS[:11]),
        help=f"comma-separated, of {', '.join(RULER_TASKS)} (default: all but qa_1, qa_2, which need --qa-file)",
    )
    r.add_argument("--samples", type=int, default=10, help="samples per task and length (default 10; RULER uses 500)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--haystack", help="a text file for the essay haystack of niah_single_2/3, multikey_1, multivalue, "
                   "multiquery (default: the noise sentences; RULER uses Paul Graham's essays)")  # fmt: skip
    r.add_argument("--qa-file", help="SQuAD v2 (qa_1) or HotpotQA (qa_2) JSON, downloaded by you; never fetched")
    r.add_argument(
        "--mode",
        choices=["auto", "passkey", "text"],
        default="auto",
        help="text: a tokenizer; passkey: niah_single_1 in the CPU demo's token ids (no tokenizer); auto: text "
        "when a tokenizer is found",
    )
    r.set_defaults(func=cmd_ruler)
    c = tasks.add_parser(
        "plot",
        help="needle heatmaps side by side (before / after), with accuracy vs length",
        description="Draw the needle.json results given side by side, and their accuracy vs "
        "length, into one PNG (e.g. before and after long-context fine-tuning).",
    )
    c.add_argument("results", nargs="+", help="needle.json files, or directories holding one")
    c.add_argument("--labels", help="comma-separated titles, one per result (default: the model names)")
    c.add_argument("--out", required=True, help="the PNG to write")
    c.set_defaults(func=cmd_plot, task="plot")


def _tokenizer(a: argparse.Namespace) -> Any:
    """``--tokenizer``'s tokenizer, else the adapter's or the model's, else ``None``."""
    from .runtime import EvalError, load_tokenizer

    if a.tokenizer:
        tok = load_tokenizer(a.tokenizer)
        if tok is None:
            raise EvalError(f"--tokenizer {a.tokenizer}: no tokenizer found there")
        return tok
    for name in (a.adapter, a.model):
        tok = load_tokenizer(name)
        if tok is not None:
            return tok
    return None


def _check_counts(a: argparse.Namespace, error: type[Exception], *names: str) -> None:
    """Refuse an option among ``names`` that is given and below its least value (``--seq-len``: 2
    tokens, the others 1), naming the flag, the value and the least one."""
    for name in names:
        value, least = getattr(a, name), 2 if name == "seq_len" else 1
        if value is not None and value < least:
            raise error(f"--{name.replace('_', '-')} {value}: give at least {least}")


def _needle_source(a: argparse.Namespace) -> Any:
    from .needle import PasskeySource, TextSource
    from .runtime import EvalError

    texts = {"--haystack": a.haystack, "--needle": a.needle, "--question": a.question, "--answer": a.answer}
    given = [k for k, v in texts.items() if v is not None]
    tok = _tokenizer(a) if a.mode != "passkey" else None
    if a.mode == "text" and tok is None:
        raise EvalError(f"--mode text needs a tokenizer; none found at {a.model} (give --tokenizer)")
    if tok is None:
        if given:
            raise EvalError(
                f"{', '.join(given)} need a tokenizer (the built-in passkey task is token ids); none "
                f"found at {a.model}: give --tokenizer, or drop {', '.join(given)}"
            )
        return PasskeySource()
    return TextSource(tok, a.haystack, a.needle, a.question, a.answer)


def run_needle(a: argparse.Namespace) -> dict[str, Any]:
    """``hf-ring eval needle``: the result (``needle.json``'s content) on every rank."""
    from ..planner.settings import format_tokens
    from ..plots import needle_png
    from .needle import evaluate_needle
    from .needle import summarise as summarise_needle
    from .runtime import EvalError, Runtime, load_model, machine_info, parse_depths, parse_lengths

    start = time.perf_counter()
    lengths, depths = parse_lengths(a.lengths), parse_depths(a.depths)
    _check_counts(a, EvalError, "samples", "cp_size")
    source = _needle_source(a)
    for n in lengths:  # before loading the model: every length must hold needle, question and answer
        source.make(n, 0, a.seed, 0)
    rt = Runtime.start(a.cp_size)
    model = load_model(a.model, a.adapter, a.dtype, rt)
    cells = evaluate_needle(model, source, lengths, depths, rt, a.samples, a.seed)
    result = {
        "task": "needle",
        "model": a.model,
        "adapter": a.adapter,
        "lengths": lengths,
        "depths": depths,
        "settings": {
            **source.settings(),
            "samples": a.samples,
            "seed": a.seed,
            "dtype": str(model.dtype),
            **rt.as_dict(),
            "scoring": SCORING,
        },
        "summary": summarise_needle(cells),
        "seconds": round(time.perf_counter() - start, 2),
        "machine": machine_info(),
        "cells": cells,
    }
    if rt.is_main:
        by_len = result["summary"]["accuracy_by_length"]
        print("accuracy by length: " + ", ".join(f"{format_tokens(int(n))} {v:.0%}" for n, v in by_len.items()))
        _write(a.out, "needle", result, needle_png)
    return result


def _write(out_dir: str, name: str, result: dict[str, Any], draw: Any) -> None:
    """``OUT/NAME.json`` and its picture ``OUT/NAME.png`` (``draw(result, path)``: ``False`` without
    matplotlib, which is then said)."""
    from .runtime import write_json

    out = Path(out_dir)
    write_json(out / f"{name}.json", result)
    png = draw(result, out / f"{name}.png")
    print(f"wrote {out / f'{name}.json'}" + (f" and {out / f'{name}.png'}" if png else ""))
    if not png:
        print(NO_MATPLOTLIB.format(json=out / f"{name}.json", png=out / f"{name}.png"))


def run_ppl(a: argparse.Namespace) -> dict[str, Any]:
    """``hf-ring eval ppl``: the result (``ppl.json``'s content) on every rank."""
    from ..planner.settings import format_tokens
    from ..plots import ppl_png
    from .ppl import documents, evaluate_ppl
    from .runtime import EvalError, Runtime, load_model, machine_info

    start = time.perf_counter()
    _check_counts(a, EvalError, "docs", "cp_size", "buckets", "chunk_size", "seq_len")
    docs, counts = documents(a.data, a.seq_len, _tokenizer(a), a.field, a.docs)
    rt = Runtime.start(a.cp_size)
    model = load_model(a.model, a.adapter, a.dtype, rt)
    table = evaluate_ppl(model, docs, counts["documents"], a.seq_len, a.buckets, rt, a.chunk_size)
    result = {
        "task": "ppl",
        "model": a.model,
        "adapter": a.adapter,
        "data": str(a.data),
        "seq_len": a.seq_len,
        "documents": counts["documents"],
        "skipped_short": counts["skipped_short"],
        "settings": {"dtype": str(model.dtype), **rt.as_dict(), "chunk_size": a.chunk_size},
        **table,
        "seconds": round(time.perf_counter() - start, 2),
        "machine": machine_info(),
    }
    if rt.is_main:
        print(
            f"loss {result['loss']:.4f} (ppl {result['ppl']:.2f}) over {counts['documents']} documents of "
            f"{format_tokens(a.seq_len)} tokens; {counts['skipped_short']} shorter ones skipped"
        )
        _write(a.out, "ppl", result, ppl_png)
    return result


def run_ruler(a: argparse.Namespace) -> dict[str, Any]:
    """``hf-ring eval ruler``: the result (``ruler.json``'s content) on every rank."""
    from ..planner.decode import decode_cache_bytes
    from ..planner.models import ModelShape
    from ..planner.settings import format_tokens
    from ..plots import ruler_png
    from .ruler import evaluate_ruler, summarise
    from .runtime import EvalError, Runtime, load_model, machine_info, parse_lengths

    start = time.perf_counter()
    lengths = parse_lengths(a.lengths)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in RULER_TASKS]
    if unknown or not tasks:
        raise EvalError(f"--tasks: unknown {unknown or 'empty list'}; known: {', '.join(RULER_TASKS)}")
    _check_counts(a, EvalError, "samples", "cp_size")
    tok = None if a.mode == "passkey" else _tokenizer(a)
    if a.mode == "text" and tok is None:
        raise EvalError(f"--mode text needs a tokenizer; none found at {a.model} (give --tokenizer)")
    rt = Runtime.start(a.cp_size)
    model = load_model(a.model, a.adapter, a.dtype, rt)
    records, haystacks = evaluate_ruler(model, tok, tasks, lengths, rt, a.samples, a.seed, a.haystack, a.qa_file)
    summary = summarise(records, tasks, lengths)
    config = model.config.get_text_config().to_dict()
    try:
        shape = ModelShape.from_config(config, a.model)
        size = next(model.parameters()).element_size()
        cache = {str(n): decode_cache_bytes(shape, n, rt.cp_size, dtype_bytes=size) for n in lengths}
    except (KeyError, TypeError, ValueError):
        cache = {}
    result = {
        "task": "ruler",
        "model": a.model,
        "adapter": a.adapter,
        "tasks": tasks,
        "lengths": lengths,
        "settings": {
            "mode": "passkey" if tok is None else "text",
            "tokenizer": getattr(tok, "name_or_path", None),
            "samples": a.samples,
            "seed": a.seed,
            "haystack": haystacks,
            "qa_file": a.qa_file,
            "dtype": str(model.dtype),
            **rt.as_dict(),
            "scoring": RULER_SCORING,
        },
        "summary": summary,
        "kv_cache_bytes_per_rank": cache,
        "seconds": round(time.perf_counter() - start, 2),
        "machine": machine_info(),
        "records": records,
    }
    if rt.is_main:
        avg = summary["average"]
        print("RULER average by length: " + ", ".join(f"{format_tokens(int(n))} {v:.1f}" for n, v in avg.items()))
        _write(a.out, "ruler", result, ruler_png)
    return result


def run_plot(a: argparse.Namespace) -> None:
    """``hf-ring eval plot``: several needle results in one picture."""
    from ..plots import model_name, needle_comparison_png
    from .runtime import EvalError

    results = []
    for r in a.results:
        path = Path(r) / "needle.json" if Path(r).is_dir() else Path(r)
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise EvalError(f"cannot read {path}: {e}") from None
        if results[-1].get("task") != "needle":
            raise EvalError(f"{path} is not a needle.json")
    labels = a.labels.split(",") if a.labels else [model_name(r) for r in results]
    if len(labels) != len(results):
        raise EvalError(f"--labels: {len(labels)} labels for {len(results)} results")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    if not needle_comparison_png(results, labels, a.out):
        raise EvalError("matplotlib is not installed (pip install matplotlib)")
    print(f"wrote {a.out}")


def _run(fn: Any, a: argparse.Namespace) -> int:
    """Run ``fn(a)``; bad input (a ``ValueError``: ``EvalError``, ``RingNotSupported``, the batch
    checks) ends the command with one line from one rank (``hf_ring.errors.exit_for``)."""
    try:
        fn(a)
    except ValueError as e:
        if debug():
            raise
        raise exit_for(e, f"hf-ring eval {a.task}") from None
    return 0


def cmd_needle(a: argparse.Namespace) -> int:
    return _run(run_needle, a)


def cmd_ppl(a: argparse.Namespace) -> int:
    return _run(run_ppl, a)


def cmd_ruler(a: argparse.Namespace) -> int:
    return _run(run_ruler, a)


def cmd_plot(a: argparse.Namespace) -> int:
    return _run(run_plot, a)
