"""Long-context evaluation with context-parallel prefill (``hf-ring eval``; docs/evaluation.md).

- ``needle``: needle-in-a-haystack cells (length x depth), scored teacher-forced on the answer
  tokens; only the answer positions' logits are computed, on the ranks that hold them;
- ``ppl``: next-token loss by position bucket over long documents, LM head in chunks;
- ``ruler``: RULER's tasks (``ruler_tasks``, ``ruler_words``: generated offline at exact lengths),
  answered by ``generate.greedy_generate``: CP prefill, then greedy decoding with the KV cache sharded
  across the CP group;
- ``runtime``: DP x CP layout, model / adapter / tokenizer loading, list parsing, progress;
- ``cli``: the ``hf-ring eval`` subcommands; ``prompts``: the needle task's default texts.

Its pictures (heatmaps, loss by position) are drawn by ``hf_ring.plots``.

This floor sits beside the trainers: it imports transformers and peft (to load models and
adapters) and the floors below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> its module, imported on first use (``hf-ring --help`` builds the eval parser
# from ``cli`` without importing torch)
_EXPORTS = {
    "EvalError": "runtime",
    "PasskeySource": "needle",
    "Runtime": "runtime",
    "TextSource": "needle",
    "evaluate_needle": "needle",
    "evaluate_ppl": "ppl",
    "evaluate_ruler": "ruler",
    "greedy_generate": "generate",
    "TaskGenerator": "ruler_tasks",
    "ruler_score": "ruler_tasks",
    "position_nll": "ppl",
    "score_answer": "needle",
}
__all__ = [
    "EvalError",
    "PasskeySource",
    "Runtime",
    "TaskGenerator",
    "TextSource",
    "evaluate_needle",
    "evaluate_ppl",
    "evaluate_ruler",
    "greedy_generate",
    "ruler_score",
    "position_nll",
    "score_answer",
]

if TYPE_CHECKING:
    from .generate import greedy_generate
    from .needle import PasskeySource, TextSource, evaluate_needle, score_answer
    from .ppl import evaluate_ppl, position_nll
    from .ruler import evaluate_ruler
    from .ruler_tasks import TaskGenerator, ruler_score
    from .runtime import EvalError, Runtime


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
