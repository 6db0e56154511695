"""The reward functions of a GRPO recipe (``trainer: grpo``, ``data.rewards``).

Each entry of ``data.rewards`` names a function, as a string or as ``{function: NAME, <options>}``
(the options are passed to it as keyword arguments, for every batch):

    data:
      rewards:
        - {function: length, target: 12}        # built-in: completions near 12 words
        - {function: keyword, keyword: "w7"}     # built-in: completions that hold "w7"
        - my_rewards:correct_answer              # your own: module:function, importable from here

A function follows TRL's contract: ``f(prompts=..., completions=..., completion_ids=..., **columns)``
returns one float (or ``None``) per completion. The built-ins need no model and run on CPU.
Imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ..errors import RecipeError, did_you_mean

__all__ = ["BUILTINS", "reward_functions", "reward_keyword", "reward_length"]


def _text(completion: Any) -> str:
    """A completion's text: a string, or the last message of a conversational completion."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def reward_length(completions: list[Any], target: int = 16, **_: Any) -> list[float]:
    """``1 - |words - target| / target``, at least 0: 1 for a completion of ``target``
    whitespace-separated words, less the further it is from that."""
    return [max(0.0, 1.0 - abs(len(_text(c).split()) - target) / target) for c in completions]


def reward_keyword(completions: list[Any], keyword: str, **_: Any) -> list[float]:
    """1 for a completion that holds ``keyword`` (a substring), else 0."""
    return [1.0 if keyword in _text(c) else 0.0 for c in completions]


BUILTINS: dict[str, Callable[..., list[float]]] = {"length": reward_length, "keyword": reward_keyword}


def _function(name: str, where: str) -> Callable[..., Any]:
    if ":" not in name:
        if name not in BUILTINS:
            raise RecipeError(f"{where} {name!r}: not a built-in reward ({', '.join(BUILTINS)})"
                              f"{did_you_mean(name, BUILTINS)}; name your own as module:function")  # fmt: skip
        return BUILTINS[name]
    module, attr = name.split(":", 1)
    try:
        found = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        raise RecipeError(f"{where} {name!r}: no module {e.name!r} importable here; put it on PYTHONPATH or fix "
                          "the name (module:function)") from None  # fmt: skip
    except AttributeError:
        raise RecipeError(f"{where} {name!r}: module {module!r} has no {attr!r}; fix the name (module:function)"
                          ) from None  # fmt: skip
    if not callable(found):
        raise RecipeError(f"{where} {name!r}: {type(found).__name__} is not a function")
    return found


TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")


def reward_functions(entries: list[Any]) -> list[Callable[..., Any]]:
    """The functions ``data.rewards`` names (checked by ``sections.resolve_data``), their options
    bound. A name that does not import, an option the function does not take (a built-in's, or one
    without ``**kwargs``), or a built-in's missing option is refused naming the entry. TRL logs each
    as ``rewards/<function name>/mean`` (``reward_length``, ``reward_keyword`` for the built-ins)."""
    out = []
    for k, entry in enumerate(entries):
        where = f"data.rewards[{k}]"
        options = dict(entry) if isinstance(entry, dict) else {"function": entry}
        name = options.pop("function")
        fn = _function(name, where)
        params = inspect.signature(fn).parameters
        builtin = name in BUILTINS
        takes_any = not builtin and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        named = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD and n not in TRL_ARGUMENTS]
        for key in options:
            if key not in named and not takes_any:
                raise RecipeError(f"{where} {name!r}: no option {key!r}{did_you_mean(key, named)}; it takes {named}")
        missing = [n for n in named if builtin and params[n].default is inspect.Parameter.empty and n not in options]
        if missing:
            raise RecipeError(f"{where} {name!r}: give {missing[0]} ({{function: {name}, {missing[0]}: ...}})")
        out.append(functools.partial(fn, **options) if options else fn)
    return out
