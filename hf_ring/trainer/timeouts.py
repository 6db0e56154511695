"""A rank that stops responding: say which collective timed out, on which group, after how long.

The CP, Ulysses, ring and DP groups of ``setup_context_parallel`` take the run's timeout
(``RingTrainer`` passes ``ddp_timeout``), as the default group does, so a frozen or lost rank makes
the others raise after it instead of holding the job. torch's message says little (gloo:
``Timed out waiting 20000ms for recv operation to complete``); ``explain`` finds the group and the
call that waited from the exception's traceback.

After such a timeout the process cannot tear its groups down (gloo's destructors wait on the lost
peer: the interpreter hangs at exit, seen for 10-20 s and more with torch 2.13). ``exit_after_timeout``
(armed by ``RingTrainer.train``) then ends the process at interpreter exit with status 1, after the
traceback and the other exit handlers, without running those destructors.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import types
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["CollectiveTimeout", "exit_after_timeout", "explain", "is_timeout"]

_TIMEOUT = re.compile(r"timed out|timeout|watchdog", re.IGNORECASE)
_COLLECTIVES = {  # torch.distributed calls, as users know them
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "batch_isend_irecv", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce", "wait",
}  # fmt: skip


_state = {"armed": False, "timed_out": False}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hf_ring's directory
_DIST = os.path.dirname(os.path.abspath(dist.__file__))  # torch.distributed's


class CollectiveTimeout(RuntimeError):
    """A collective of the run did not complete within its timeout: another rank stopped responding."""


def _exit_now() -> None:
    if _state["timed_out"]:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)


def exit_after_timeout() -> None:
    """Arm the exit described in the module docstring (once per process; the handler registered
    now runs after those registered later, e.g. by ``report_to`` integrations)."""
    if not _state["armed"]:
        atexit.register(_exit_now)
        _state["armed"] = True


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective timing out (gloo, NCCL)."""
    dist_error = getattr(dist, "DistError", ())
    return isinstance(exc, (RuntimeError, dist_error)) and bool(_TIMEOUT.search(str(exc)))


def _groups(cp: Any) -> dict[int, str]:
    named: dict[int, str] = {}
    if cp is not None:
        for attr, name in (("ring_group", "ring group"), ("ulysses_group", "Ulysses group"),
                           ("dp_group", "DP group"), ("cp_group", "CP group")):  # fmt: skip
            g = getattr(cp, attr, None)
            if g is not None:
                named[id(g)] = name
    if dist.is_initialized():
        named.setdefault(id(dist.group.WORLD), "world group")
    return named


def _frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def _inside(path: str, package: str) -> str | None:
    """``path`` relative to the directory ``package`` when the file lies in it, else ``None`` (by directory:
    a checkout or environment in a folder named ``hf_ring`` or ``torch`` has those names in every path)."""
    path = os.path.abspath(path)
    return os.path.relpath(path, package).replace("\\", "/") if path.startswith(package + os.sep) else None


def _where(exc: BaseException, cp: Any) -> tuple[str, str]:
    """``(call, group)`` from the traceback: the innermost torch.distributed call and the hf_ring
    function that made it, and the innermost process group found in the frames' variables."""
    named = _groups(cp)
    collective = caller = group = ""
    for frame in reversed(_frames(exc.__traceback__)):
        code = frame.f_code
        if not collective and code.co_name in _COLLECTIVES and _inside(code.co_filename, _DIST) is not None:
            collective = code.co_name
            if "group" in frame.f_locals and frame.f_locals["group"] is None and dist.is_initialized():
                group = f"world group (ranks 0-{dist.get_world_size() - 1})"
        elif not caller and (where := _inside(code.co_filename, _PACKAGE)) is not None:
            caller = f"{code.co_name} ({where}:{frame.f_lineno})"
        for value in list(frame.f_locals.values()):
            for candidate in (value, getattr(value, "group", None)):
                if not group and isinstance(candidate, dist.ProcessGroup):
                    label = named.get(id(candidate), "a process group")
                    try:
                        label += f" (ranks {dist.get_process_group_ranks(candidate)})"
                    except (RuntimeError, ValueError):
                        pass
                    group = label
        if caller and group:
            break
    call = " ".join(x for x in (collective, f"called from hf_ring {caller}" if caller else "") if x)
    return call, group


def explain(exc: BaseException, cp: Any, timeout: timedelta | float | None) -> CollectiveTimeout:
    """The ``CollectiveTimeout`` to raise for ``exc`` (a timeout, see ``is_timeout``) on this rank;
    from now on the process ends at exit as ``exit_after_timeout`` says, when armed."""
    _state["timed_out"] = True
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    call, group = _where(exc, cp)
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = f" in {call}" if call else ""
    on = (
        f"the {group}"
        if group
        else ("a group not named in the traceback (DDP's and FSDP's gradient reductions run on the world group)")
    )
    limit = f"{seconds:g} s (ddp_timeout)" if seconds is not None else "its timeout"
    return CollectiveTimeout(
        f"rank {rank}: a collective{where} on {on} did not complete within {limit}: another rank of "
        "the job stopped responding (frozen, killed, out of memory, or stuck in slow I/O). This rank stops; "
        "the launcher ends the others. If a rank legitimately waits longer (a slow checkpoint write or "
        f"evaluation on one rank), raise ddp_timeout. torch: {str(exc).strip()[:500]}"
    )
