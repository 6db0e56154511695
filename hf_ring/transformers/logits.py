"""A causal LM's logits as a function of its LM head's output, for computing them chunk by chunk.

The chunked loss (``enable_chunked_loss``) and ``hf-ring eval ppl`` compute the logits from the LM
head a few thousand positions at a time. Many models do more than the head: Gemma 2 and
RecurrentGemma soft-cap the logits, Falcon-H1 multiplies them by ``lm_head_multiplier``, Cohere by
``logit_scale``, Granite divides them by ``logits_scaling``, others cast them or add a bias.
``logits_transform(lm, decoder, caller)`` finds what the model does, from the model itself, once:

1. the model's own ``forward`` runs on a tiny input (3 positions) with its decoder and its LM head
   (``get_output_embeddings()``) stood in for: the decoder returns zeros, the head a random
   ``Z [1, 3, V]``; no layer runs, no parameter is read, nothing is communicated;
2. every torch call the forward makes from ``Z`` to the logits it returns is recorded
   (``hf_ring.ops.tail``), once in training mode and once in evaluation mode (no labels: the
   loss's own calls, ``logits.float()`` among them, stay out);
3. the recording is kept when it reproduces the model's logits on the probe, replayed on the rows
   ``[3, V]``, ``[2, V]`` and ``[1, V]`` (so it acts on each position alone, whatever their number),
   within 4 units in the last place, and is the same in both modes.

Anything else -- a head the forward does not call exactly once, logits not computed from it, a
transform that reads the batch's shape or mixes positions, trainable parameters in it -- raises
``RingNotSupported`` naming the model and what differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..errors import RingNotSupported
from ..ledger import LEDGER
from ..ops.tail import Recorder, Replay
from .support import model_name

__all__ = ["logits_transform"]

ROWS = 3  # positions of the probe


class _Output(BaseModelOutputWithPast):
    """The stand-in decoder's output: the hidden states, and ``None`` for anything else asked of it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _StandIn(nn.Module):
    """In place of ``real`` during the probe: returns ``make(*args)``; reads its other attributes
    (``lm_head_multiplier``, ``config``, ...) from ``real``, but its submodules are stand-ins too
    (BART's causal LM calls ``self.model.decoder``: nothing of the real model runs); counts the
    calls of itself and of its submodules' stand-ins."""

    def __init__(self, real: nn.Module, make: Callable[..., Any], counter: list[int] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_make", make)
        object.__setattr__(self, "_counter", counter if counter is not None else [0])

    @property
    def calls(self) -> int:
        return self._counter[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._counter[0] += 1
        return self._make(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(object.__getattribute__(self, "_real"), name)
        if isinstance(value, nn.Module):
            return _StandIn(value, object.__getattribute__(self, "_make"), object.__getattribute__(self, "_counter"))
        return value


def _path(lm: nn.Module, target: nn.Module) -> tuple[nn.Module, str] | None:
    """The parent of ``target`` inside ``lm`` and its attribute name there."""
    for name, module in lm.named_modules():
        if module is target and name:
            parent, _, attr = name.rpartition(".")
            return lm.get_submodule(parent), attr
    return None


@contextmanager
def _swapped(lm: nn.Module, swaps: list[tuple[nn.Module, str, nn.Module]]) -> Iterator[None]:
    with LEDGER.scoped() as scope:
        for parent, attr, new in swaps:
            scope.set_attr(parent, attr, new, why="`logits_transform`'s probe: the decoder and head stood in for")
        yield


def _sizes(lm: PreTrainedModel, head: nn.Module) -> tuple[int, int]:
    """(hidden size, vocabulary) of the head's input and output."""
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    weight = getattr(head, "weight", None)
    hidden = getattr(text, "hidden_size", None) or getattr(head, "in_features", None)
    vocab = getattr(head, "out_features", None) or (weight.shape[0] if isinstance(weight, Tensor) else None)
    vocab = vocab or getattr(text, "vocab_size", None)
    if not isinstance(hidden, int) and isinstance(weight, Tensor):
        hidden = weight.shape[-1]
    return int(hidden), int(vocab)


def _refuse(lm: PreTrainedModel, caller: str, what: str) -> RingNotSupported:
    return RingNotSupported(
        f"{caller}: {type(lm).__name__} ({model_name(lm.config)}) {what}, so its logits cannot be computed from "
        "its LM head chunk by chunk."
    )


def _probe(lm: PreTrainedModel, dec: nn.Module, head: nn.Module, caller: str, training: bool) -> Replay | None:
    """One recording of the model's tail (see the module docstring), checked on row subsets."""
    where = [_path(lm, dec), _path(lm, head)]
    if None in where:
        raise _refuse(lm, caller, "does not hold its decoder and its output embedding as submodules")
    param = next(head.parameters(), None)
    device = param.device if param is not None and param.device.type != "meta" else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    hidden_size, vocab = _sizes(lm, head)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(1, ROWS, vocab, generator=g, dtype=torch.float64) * 16).to(device, dtype)
    hidden = torch.zeros(1, ROWS, hidden_size, device=device, dtype=dtype)
    ids = torch.zeros(1, ROWS, dtype=torch.long, device=device)

    def head_output(x: Tensor, *_: Any, **__: Any) -> Tensor:
        if tuple(x.shape[:-1]) != (1, ROWS):
            raise _refuse(lm, caller, f"hands its LM head {tuple(x.shape)}, not the {ROWS} positions it was given")
        return z

    stand_dec = _StandIn(dec, lambda *_, **__: _Output(last_hidden_state=hidden))
    stand_head = _StandIn(head, head_output)
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}  # no labels: the loss's own calls stay out
    lm.train(training)
    swaps = [(*where[0], stand_dec), (*where[1], stand_head)]
    with _swapped(lm, swaps), torch.no_grad(), torch.autocast(device.type, enabled=False), Recorder(z) as rec:
        try:
            out = type(lm).forward(lm, **kwargs)
        except RingNotSupported:
            raise
        except Exception as e:  # noqa: BLE001 - the model's forward does not run on the probe
            raise _refuse(lm, caller, f"could not be probed ({type(e).__name__}: {e})") from e
    if stand_dec.calls == 0 or stand_head.calls != 1:
        raise _refuse(
            lm, caller, f"called its decoder {stand_dec.calls} times and its output embedding "
            f"(get_output_embeddings()) {stand_head.calls} times in one forward, not once each",
        )  # fmt: skip
    logits = out.logits if hasattr(out, "logits") else out[0]
    try:
        replay = rec.replay(logits)
    except LookupError:
        raise _refuse(lm, caller, "does not compute its logits from its output embedding's output") from None
    if replay is not None:
        _check(lm, caller, replay, z, logits)
    return replay


def _check(lm: PreTrainedModel, caller: str, replay: Replay, z: Tensor, logits: Tensor) -> None:
    trainable = [tuple(t.shape) for t in replay.constants if t.requires_grad]
    if trainable:
        raise _refuse(lm, caller, f"computes its logits with trainable tensors of shapes {trainable} ({replay})")
    if tuple(logits.shape[:-1]) != tuple(z.shape[:-1]):
        raise _refuse(
            lm, caller, f"returns logits of shape {tuple(logits.shape)} from a head output of {tuple(z.shape)}"
        )
    rows, want = z.reshape(ROWS, -1), logits.reshape(ROWS, -1)
    for part in (slice(None), slice(1, None), slice(0, 1)):
        try:
            got = replay(rows[part])
        except Exception as e:  # noqa: BLE001 - the recorded calls depend on the probe's shape
            raise _refuse(
                lm, caller, f"transforms its logits in a way that depends on their shape ({replay}: {e})"
            ) from e
        ref = want[part]
        eps = torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0
        same = got.shape == ref.shape and got.dtype == ref.dtype
        if not same or not torch.allclose(got, ref, rtol=4 * eps, atol=4 * eps * float(ref.abs().max())):
            diff = float((got.double() - ref.double()).abs().max()) if same else f"{tuple(got.shape)} {got.dtype}"
            raise _refuse(
                lm, caller, f"transforms its logits ({replay}) in a way that its recording does not reproduce on "
                f"{ref.shape[0]} of the probe's {ROWS} positions (max difference {diff}): it mixes positions",
            )  # fmt: skip


def logits_transform(lm: PreTrainedModel, decoder: nn.Module, caller: str) -> Replay | None:
    """What ``lm`` does between its LM head and its logits, as a function of a chunk of the head's
    output ``[T, V]`` -> ``[T, V']``; ``None`` when its logits are the head's output.

    ``decoder``: the module whose output the head reads (``lm.model`` for Llama); ``caller``: names
    the feature in errors. Runs the probe described in the module docstring (in training mode, then
    in evaluation mode; the modes of ``lm``'s modules are restored). Raises
    ``RingNotSupported`` when the logits cannot be computed chunk by chunk exactly.
    """
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Module):
        raise _refuse(lm, caller, "has no output embedding (get_output_embeddings() is not a module)")
    with LEDGER.scoped() as scope:  # the probe runs the model in both modes; each module's own mode again after it
        for m in lm.modules():
            scope.set_attr(m, "training", m.training, why="`logits_transform`'s probe: the modules' modes")
        train = _probe(lm, decoder, head, caller, training=True)
        evaluation = _probe(lm, decoder, head, caller, training=False)
    if repr(train) != repr(evaluation):
        raise _refuse(lm, caller, f"transforms its logits one way in training ({train}) and another in evaluation "
                      f"({evaluation})")  # fmt: skip
    return train
