"""The torch calls that turn one tensor into another, recorded once and replayed on other tensors.

A causal LM does more between its LM head and its logits than the head: soft-caps
(``c * tanh(z / c)``), multipliers, a division by a scale, a bias, a cast to float32. A loss
computed from the head in chunks must apply the same calls to every chunk, in the same order and
dtypes, or it trains on other logits. ``Recorder(source)`` is a ``TorchFunctionMode``: while it is
active it records every torch call that takes ``source`` or a tensor made from it (its function,
and its other arguments as constants); ``recorder.replay(result)`` returns those calls as a
function of the source (``Replay``), or ``None`` when ``result`` is ``source`` itself.

A replay is only as general as what was recorded: calls that read a shape, take another tensor of
the recorded batch, or mix rows are baked in. Whoever uses one checks it on inputs of other shapes
(``hf_ring.transformers.logits`` does, on row subsets of the probe). This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Recorder", "Replay"]


@dataclass(frozen=True)
class _Ref:
    """A tensor made by the recording: output ``leaf`` of step ``step`` (step -1: the source)."""

    step: int
    leaf: int


@dataclass
class _Step:
    func: Any
    spec: Any  # the pytree spec of (args, kwargs)
    leaves: list[Any]  # _Ref for recorded tensors, the value itself for constants
    inplace: bool = False  # it returned one of its recorded inputs (changed in place)


def _describe(step: _Step) -> str:
    """``name(constants)``: the call's name and the arguments it took besides recorded tensors."""
    name = str(getattr(step.func, "__name__", step.func))
    name = name[2:-2] if name.startswith("__") and name.endswith("__") else name
    shown = [
        f"tensor{list(v.shape)}" if isinstance(v, Tensor) else repr(v) for v in step.leaves if not isinstance(v, _Ref)
    ]
    return f"{name}({', '.join(shown)})" if shown else name


@dataclass
class Replay:
    """The recorded calls from the source to one result, as a function of the source.

    ``replay(x)`` runs them on ``x`` (a tensor the calls accept: the source's shape, or another one
    when the calls allow it). ``constants`` are the tensors the calls took besides the source, and
    ``steps`` their names in order (``repr`` shows them)."""

    _steps: list[_Step]
    _result: _Ref
    _mutates: bool = False
    constants: list[Tensor] = field(default_factory=list)

    def __call__(self, x: Tensor) -> Tensor:
        values: dict[_Ref, Any] = {_Ref(-1, 0): x.clone() if self._mutates else x}
        for i, step in enumerate(self._steps):
            leaves = [values[v] if isinstance(v, _Ref) else v for v in step.leaves]
            args, kwargs = tree_unflatten(leaves, step.spec)
            out, _ = tree_flatten(step.func(*args, **kwargs))
            values.update({_Ref(i, j): t for j, t in enumerate(out)})
        return values[self._result]

    @property
    def steps(self) -> list[str]:
        return [_describe(s) for s in self._steps]

    def __repr__(self) -> str:
        return "Replay(" + " -> ".join(self.steps) + ")"


class Recorder(TorchFunctionMode):
    """Records, while active, the torch calls that take ``source`` or a tensor made from it."""

    def __init__(self, source: Tensor) -> None:
        super().__init__()
        self._steps: list[_Step] = []
        self._where: dict[int, _Ref] = {id(source): _Ref(-1, 0)}
        self._alive: list[Tensor] = [source]  # keeps every recorded tensor's id unique

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        refs = [self._where.get(id(x)) if isinstance(x, Tensor) else None for x in leaves]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        if not outs or not any(refs):
            return out
        i = len(self._steps)
        inplace = any(any(t is x for x, r in zip(leaves, refs) if r is not None) for t in outs)
        self._steps.append(_Step(func, spec, [r if r is not None else x for r, x in zip(refs, leaves)], inplace))
        for j, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, Tensor):
                self._where[id(t)] = _Ref(i, j)
                self._alive.append(t)
        return out

    def replay(self, result: Tensor) -> Replay | None:
        """The calls from the source to ``result``: ``None`` when ``result`` is the source; raises
        ``LookupError`` when ``result`` was not made from the source while recording."""
        ref = self._where.get(id(result))
        if ref is None:
            raise LookupError("the result was not computed from the recorded source")
        if ref.step < 0:
            return None
        needed, todo = set(), [ref.step]
        while todo:  # the steps the result depends on
            i = todo.pop()
            if i >= 0 and i not in needed:
                needed.add(i)
                todo.extend(v.step for v in self._steps[i].leaves if isinstance(v, _Ref))
        order = sorted(needed)
        renumber = {old: new for new, old in enumerate(order)}

        def moved(v: Any) -> Any:
            return _Ref(renumber[v.step], v.leaf) if isinstance(v, _Ref) and v.step >= 0 else v

        kept = [self._steps[i] for i in order]
        steps = [_Step(s.func, s.spec, [moved(v) for v in s.leaves], s.inplace) for s in kept]
        constants = [v for s in steps for v in s.leaves if isinstance(v, Tensor)]
        return Replay(steps, moved(ref), any(s.inplace for s in steps), constants)
