"""The default texts of the needle task (``hf-ring eval needle --needle/--question/--answer``), apart
from ``needle`` so that the command line shows them without importing torch."""

from __future__ import annotations

__all__ = ["DEFAULT_ANSWER", "DEFAULT_NEEDLE", "DEFAULT_QUESTION"]

DEFAULT_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
DEFAULT_QUESTION = " What is the pass key? The pass key is"
DEFAULT_ANSWER = " {key}"
