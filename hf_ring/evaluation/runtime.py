"""What both evaluations share: the DP x CP layout of this process, loading the model (and an
adapter, and a tokenizer), parsing ``--lengths``/``--depths`` lists, the progress bar, splitting
work items over DP replicas and gathering their results, and writing the JSON.

One process (no launcher): CP = 1, DP = 1. Under ``torchrun`` / ``accelerate launch``: the world is
cut by ``hf_ring.setup_context_parallel(cp_size)`` (default: every process in one CP group); the
ranks of a CP group prefill one sequence together, the DP replicas take turns over the work items.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import setup_context_parallel
from ..planner.settings import tokens

__all__ = [
    "EvalError",
    "Runtime",
    "load_model",
    "load_tokenizer",
    "parse_depths",
    "parse_lengths",
    "progress",
    "write_json",
]

T = TypeVar("T")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EvalError(ValueError):
    """Bad input to an evaluation (the CLI prints the message and exits with status 2)."""


@dataclass(frozen=True)
class Runtime:
    """This process's place: the CP group that prefills one sequence together, and the DP replica
    that picks which work items it takes. ``cp_group``/``dp_group`` are ``None`` in one process."""

    cp_group: dist.ProcessGroup | None = None
    cp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0
    dp_size: int = 1
    device: torch.device = torch.device("cpu")
    is_main: bool = True

    @classmethod
    def start(cls, cp_size: int | None = None) -> Runtime:
        """One process, or the DP x CP groups of a launched world (``cp_size`` default: the world)."""
        launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if not launched and not (dist.is_available() and dist.is_initialized()):
            if cp_size not in (None, 1):
                raise EvalError(f"--cp-size {cp_size} needs {cp_size} processes: start with torchrun or accelerate")
            return cls(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
        cp_size = cp_size or world
        if world % cp_size:
            raise EvalError(f"--cp-size {cp_size} does not divide the {world} processes")
        cp = setup_context_parallel(cp_size)
        if torch.cuda.is_available():
            device = torch.device(
                "cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            )
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        return cls(cp.cp_group, cp.cp_size, cp.dp_group, cp.dp_rank, cp.dp_size, device, dist.get_rank() == 0)

    def mine(self, items: Sequence[T]) -> list[T]:
        """The items this DP replica evaluates (every ``dp_size``-th, from its own)."""
        return list(items[self.dp_rank :: self.dp_size])

    def gather(self, local: list[Any]) -> list[Any]:
        """Every replica's results of ``mine``, back in the order of the items (on every rank)."""
        if self.dp_size == 1:
            return local
        parts: list[Any] = [None] * self.dp_size
        dist.all_gather_object(parts, local, group=self.dp_group)
        out: list[Any] = []
        for i in range(max(len(p) for p in parts)):
            out += [p[i] for p in parts if i < len(p)]
        return out

    def reduce_dp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the DP replicas (in place; returned)."""
        if self.dp_size > 1:
            dist.all_reduce(x, group=self.dp_group)
        return x

    def as_dict(self) -> dict[str, int]:
        return {"cp_size": self.cp_size, "dp_size": self.dp_size}


def progress(items: Iterable[T], rt: Runtime, desc: str, unit: str = "cell", count: int | None = None) -> Iterator[T]:
    """Iterate over this replica's ``items`` (``count`` of them: default ``len(items)``); rank 0
    shows a bar over all replicas' items."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        yield from items
        return
    total = (len(items) if count is None else count) * rt.dp_size  # type: ignore[arg-type]
    with tqdm(total=total, desc=desc, unit=unit, disable=not rt.is_main, dynamic_ncols=True) as bar:
        for item in items:
            yield item
            bar.update(min(rt.dp_size, total - bar.n))


# --- loading -------------------------------------------------------------------------------------


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(name: str, adapter: str | None, dtype: str, rt: Runtime) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(name, attn_implementation="ring")`` on this rank's
    device in evaluation mode, with the PEFT adapter ``adapter`` merged in (if given).

    ``dtype``: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32``, ``bfloat16``, ``float16``.
    Raises ``EvalError`` for a model that cannot be loaded with ring attention."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ring", dtype=_dtype(dtype, rt.device))
    except (OSError, ValueError, KeyError) as e:
        raise EvalError(f"cannot load {name} as a causal LM with attn_implementation='ring': {e}") from e
    if adapter:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        except (OSError, ValueError) as e:
            raise EvalError(f"cannot load the adapter {adapter} onto {name}: {e}") from e
    return model.to(rt.device).eval()


def check_ring(model: nn.Module, caller: str) -> None:
    """Raise ``EvalError`` unless ``model`` runs its attention as ``"ring"``."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != "ring":
        raise EvalError(
            f"{caller}: the model runs attn_implementation={impl!r}, not 'ring': load it with "
            "AutoModelForCausalLM.from_pretrained(..., attn_implementation='ring') (after `import hf_ring`)"
        )


def load_tokenizer(name: str | None) -> Any | None:
    """The tokenizer saved at ``name`` (a directory or hub id), or ``None`` when there is none."""
    if not name:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError, KeyError):
        return None


# --- lists on the command line -------------------------------------------------------------------


def _expand(text: str, parse: Any, what: str, geometric: bool) -> list[Any]:
    """``a,b,c`` or ``a,b,...,z`` (the step from ``a`` to ``b``, continued up to ``z``: a ratio
    when ``geometric``, a difference otherwise)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise EvalError(f"{what}: empty list")
    out: list[Any] = []
    i = 0
    while i < len(parts):
        if parts[i] != "...":
            out.append(_parse(parse, parts[i], what))
            i += 1
            continue
        if len(out) < 2 or i + 1 >= len(parts):
            raise EvalError(f"{what}: '...' needs two values before it and one after it (as in 1K,2K,...,64K)")
        a, b, z = out[-2], out[-1], _parse(parse, parts[i + 1], what)
        if (a <= 0 or b / a <= 1 if geometric else b <= a) or z < b:
            raise EvalError(f"{what}: '{text}' does not rise to {parts[i + 1]}")
        while True:
            nxt = b * (b / a) if geometric else b + (b - a)
            nxt = round(nxt) if isinstance(a, int) and isinstance(b, int) else round(nxt, 6)
            if nxt > z:
                break
            out.append(nxt)
            a, b = b, nxt
        if out[-1] != z:
            raise EvalError(f"{what}: '{text}': the steps do not end at {parts[i + 1]}")
        i += 2
    return out


def _parse(parse: Any, text: str, what: str) -> Any:
    try:
        return parse(text)
    except ValueError:
        raise EvalError(f"{what}: cannot read '{text}'") from None


def parse_lengths(text: str) -> list[int]:
    """``1K,2K,...,1M`` -> ``[1024, 2048, ..., 1048576]`` (``...`` continues the ratio)."""
    lengths = _expand(text, tokens, "--lengths", geometric=True)
    bad = [n for n in lengths if n < 1]
    if bad:
        raise EvalError(f"--lengths: {bad} are not positive token counts")
    return sorted(set(lengths))


def parse_depths(text: str) -> list[float]:
    """``0,10,...,100`` -> ``[0, 10, ..., 100]`` (percent of the haystack before the needle;
    ``...`` continues the difference). Raises ``EvalError`` for a depth outside 0-100."""

    def number(t: str) -> float:
        v = float(t)
        return int(v) if v.is_integer() else v

    depths = _expand(text, number, "--depths", geometric=False)
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad:
        raise EvalError(f"--depths: {bad} outside 0-100 (a depth is the percent of the haystack before the needle)")
    return sorted(set(depths))


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


def machine_info() -> dict[str, Any]:
    """The machine a result is measured on: CPU model (``/proc/cpuinfo``), usable cores, platform, and
    the CUDA device when there is one."""
    import platform

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out: dict[str, Any] = {"cpu": cpu, "cores": cores, "platform": platform.platform()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def read_jsonl(path: str | os.PathLike) -> Iterable[dict[str, Any]]:
    """The records of a JSON-lines file (``EvalError`` for one that is not)."""
    try:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise EvalError(f"{path}:{i}: not JSON ({e})") from None
    except OSError as e:
        raise EvalError(f"cannot read {path}: {e}") from None
