"""The mistakes a user can make, and how the command line reports them.

A *user error* is a mistake in what the user gave -- a recipe, a flag, the data, a model the ring
refuses, a context-parallel layout -- and its message names the field, the value and the fix.
``hf-ring`` prints it as one line, from one process (rank 0 under a launcher, else this process),
and exits with status 1; ``HF_RING_DEBUG=1`` shows the traceback instead. Any other exception is a
fault of hf_ring or of the machine and keeps its traceback.

The user errors are ``UserError`` and its subclasses -- ``RecipeError``, ``RecipeNotFound``, and
``RingNotSupported`` (a model, option or input the ring does not compute exactly) with its kinds
``RingMaskUsed`` and ``RingNeverRan`` --, and the classes named in ``USER_ERRORS``, which live beside
the code that raises them: ``CheckpointError`` (a checkpoint that cannot be resumed from) and
``EvalError`` (bad input to ``hf-ring eval``). ``is_user_error`` looks those up in ``sys.modules``
only: an exception of a class can exist only once its module is loaded, so deciding imports nothing.

This module imports only the standard library: every floor of hf_ring may use it.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
from collections.abc import Iterable

__all__ = [
    "DEBUG_ENV",
    "LAUNCHER_ERROR_FILE",
    "USER_ERRORS",
    "RecipeError",
    "RecipeNotFound",
    "RingMaskUsed",
    "RingNeverRan",
    "RingNotSupported",
    "UserError",
    "closest",
    "debug",
    "did_you_mean",
    "exit_for",
    "is_user_error",
    "one_line",
    "reports",
]

DEBUG_ENV = "HF_RING_DEBUG"
LAUNCHER_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torch elastic's per-rank error file
QUIET_RANK_DELAY_S = 3.0  # how long a rank that does not report waits before it exits

# user errors defined elsewhere, as "module.Class" (their modules import torch or transformers)
USER_ERRORS = (
    "hf_ring.trainer.checkpoints.CheckpointError",
    "hf_ring.evaluation.runtime.EvalError",
)


class UserError(ValueError):
    """A mistake in the user's input; the message names the field, the value and the fix."""


class RecipeError(UserError):
    """A recipe, or a flag of ``hf-ring train``, that cannot run as given."""


class RecipeNotFound(RecipeError, FileNotFoundError):
    """A recipe name or path that names no recipe (also a ``FileNotFoundError``)."""


class RingNotSupported(UserError):
    """A model, option or input that ring attention does not compute exactly (``hf_ring.transformers.support``
    says what and why); the message names the model, the reason and the alternative."""


class RingMaskUsed(RingNotSupported, TypeError):
    """A model used the ring's mask object as a tensor (it bypasses transformers' attention registry)."""


class RingNeverRan(RingNotSupported, RuntimeError):
    """A forward of a sharded batch ran neither ring attention nor a context-parallel token mixer
    (``hf_ring.transformers.guard``): every rank computed its tokens from its own shard."""


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a user's mistake: a ``UserError`` or an instance of a class of ``USER_ERRORS``."""
    if isinstance(exc, UserError):
        return True
    for qualified in USER_ERRORS:
        module, _, name = qualified.rpartition(".")
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def closest(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The element of ``choices`` nearest to ``name`` (``difflib``, case ignored), or ``None``."""
    by_lower: dict[str, str] = {}
    for c in choices:
        by_lower.setdefault(str(c).lower(), str(c))
    found = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[found[0]] if found else None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to ``name``; ``""`` when none is close."""
    near = closest(name, choices)
    return f" (did you mean {near!r}?)" if near is not None else ""


def debug() -> bool:
    """``HF_RING_DEBUG`` is set (and not ``0``/``false``/``no``): show tracebacks of user errors."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def reports() -> bool:
    """Whether this process reports errors: rank 0 of an initialised process group, else the process
    whose launcher gave it ``RANK`` 0, else (no launcher) this process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (runs of white space, line breaks included, become one space)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def exit_for(exc: BaseException, command: str) -> SystemExit:
    """The ``SystemExit`` that ends ``command`` (``"hf-ring train"``) after the user error ``exc``:
    ``"<command>: <message on one line>"`` in the process that reports (``reports``), status 1
    without a word in the others (a launched one after ``QUIET_RANK_DELAY_S``: the launcher ends
    the job when a rank exits, maybe before rank 0 has said it). Every process also leaves the
    line in its launcher's error file (``TORCHELASTIC_ERROR_FILE``, set by ``torchrun`` and
    ``accelerate launch``), whose report of the failed ranks then shows it instead of a link: a
    mistake only some ranks make is not lost. Raise it ``from None``."""
    line = f"{command}: {one_line(exc)}"
    path = os.environ.get(LAUNCHER_ERROR_FILE)
    if path:
        try:
            info = {"py_callstack": line, "timestamp": str(int(time.time()))}  # the report shows py_callstack
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": info}}, f)
        except OSError:  # the report keeps its link; the line is printed all the same
            pass
    if reports():
        return SystemExit(line)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # the launcher stops every rank once one exits: give rank 0, which hits the same mistake in
        # the same place, the time to say it before this rank's exit ends the job
        time.sleep(QUIET_RANK_DELAY_S)
    return SystemExit(1)
