"""Long-context evaluation with context-parallel prefill (``hf-ring eval``; docs/evaluation.md).

- ``needle``: needle-in-a-haystack cells (length x depth), scored teacher-forced on the answer
  tokens; only the answer positions' logits are computed, on the ranks that hold them;
- ``ppl``: next-token loss by position bucket over long documents, LM head in chunks;
- ``runtime``: DP x CP layout, model / adapter / tokenizer loading, list parsing, progress;
- ``plots``: the heatmap and line plots (matplotlib optional);
- ``cli``: the ``hf-ring eval`` subcommands.

This floor sits beside the trainers: it imports transformers and peft (to load models and
adapters) and the floors below.
"""

from .needle import PasskeySource, TextSource, evaluate_needle, score_answer
from .ppl import evaluate_ppl, position_nll
from .runtime import EvalError, Runtime

__all__ = [
    "EvalError",
    "PasskeySource",
    "Runtime",
    "TextSource",
    "evaluate_needle",
    "evaluate_ppl",
    "position_nll",
    "score_answer",
]
