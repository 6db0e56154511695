"""flash-attn 2.6.3 - 2.8.3's mask, as its sources compute it: the argument preprocessing of each entry
point, ``set_params_fprop``, and ``src/mask.h``. One implementation, used by the flash-attn stand-in
(``testkit.flash_standin``) and by the tests that check every band block of a schedule against it.

Line numbers are those of ``csrc/flash_attn/flash_api.cpp`` (``api``), ``src/mask.h`` and
``src/flash_fwd_launch_template.h`` at the tags v2.8.3 / v2.6.3; every tag between has the same code
(checked line by line: ``docs/standins.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ENTRIES", "FlashWindow", "flash_keeps", "flash_limits", "flash_mask", "flash_window"]

ENTRIES = ("fwd", "varlen_fwd", "bwd", "varlen_bwd")


@dataclass(frozen=True)
class FlashWindow:
    """What the kernel runs with: ``params.is_causal``, the ``Is_local`` template switch and
    ``params.window_size_left/right`` after ``set_params_fprop``."""

    is_causal: bool
    is_local: bool
    left: int
    right: int


def flash_window(causal: bool, left: int, right: int, seqlen_q: int, seqlen_k: int, entry: str = "fwd") -> FlashWindow:
    """The window an entry point hands its kernel. ``seqlen_q/k``: the dense lengths, or the
    ``max_seqlen_q/k`` of a varlen call (the clamps and ``set_params_fprop`` see only those).

    * ``fwd`` (``mha_fwd``, api L399-404 / L397-402): ``left >= Sk -> -1``, ``right >= Sk -> -1``; then
      ``Sq == 1`` makes ``causal`` false; then ``causal`` sets ``right = 0``.
    * ``varlen_fwd`` (api L585-586, L608-609 / L608-609, L630-631): ``max_seqlen_q == 1`` makes ``causal``
      false, ``causal`` sets ``right = 0``, then the clamps against ``max_seqlen_k``.
    * ``bwd``, ``varlen_bwd`` (api L791, L840-841 and L1002, L1055-1056 / L834, L892-893 and L1071,
      L1133-1134): ``causal`` sets ``right = 0``, then the clamps (``varlen``: against ``max_seqlen_k``).
    * then ``set_params_fprop`` (api L139-144 / L134-139): ``is_causal = left < 0 and right == 0``; a
      ``-1`` next to a non-negative edge becomes ``seqlen_k``; and ``Is_local`` (fwd launch template L70 /
      L67, bwd L99 / L95) is ``(left >= 0 or right >= 0) and not is_causal``.
    """
    if entry not in ENTRIES:
        raise ValueError(f"entry must be one of {ENTRIES}, got {entry!r}")

    def clamp(left: int, right: int) -> tuple[int, int]:
        return (-1 if left >= seqlen_k else left), (-1 if right >= seqlen_k else right)

    if entry == "fwd":
        left, right = clamp(left, right)
    if entry in ("fwd", "varlen_fwd") and seqlen_q == 1:
        causal = False
    if causal:
        right = 0
    if entry != "fwd":
        left, right = clamp(left, right)
    is_causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    return FlashWindow(is_causal, (left >= 0 or right >= 0) and not is_causal, left, right)


def flash_limits(sq: int, sk: int, w: FlashWindow) -> tuple[Tensor, Tensor]:
    """Per query row of one sequence of ``sq`` queries and ``sk`` keys (``binfo.actual_seqlen_q/k``: a
    varlen call's own lengths), the keys ``mask.h`` keeps: ``lo <= col < hi`` (``[sq]`` int64 each; a row
    with ``lo >= hi`` sees none). With ``Is_local``, ``lo = max(0, row + sk - sq - left)`` and
    ``hi = min(sk, row + 1 + sk - sq + right)`` (mask.h L172-173, L194 / L171-172, L193); causal, only
    the right edge (L189 / L188, ``right == 0``); else every key (``apply_mask``: ``col < sk``)."""
    row = torch.arange(sq)
    lo, hi = torch.zeros(sq, dtype=torch.long), torch.full((sq,), sk, dtype=torch.long)
    if w.is_causal or w.is_local:
        hi = torch.clamp(row + 1 + sk - sq + w.right, max=sk)
    if w.is_local:
        lo = torch.clamp(row + sk - sq - w.left, min=0)
    return lo, hi


def flash_mask(sq: int, sk: int, w: FlashWindow) -> Tensor:
    """``[sq, sk]`` bool, True where ``mask.h`` keeps key ``col`` for query ``row`` (``flash_limits``)."""
    lo, hi = flash_limits(sq, sk, w)
    col = torch.arange(sk)[None, :]
    return (col >= lo[:, None]) & (col < hi[:, None])


def flash_keeps(
    sq: int,
    sk: int,
    causal: bool,
    window: tuple[int, int] | None,
    entry: str = "fwd",
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> Tensor:
    """``flash_mask`` of a call with ``causal`` and ``window = (window_size_left, window_size_right)``
    (``None``: ``(-1, -1)``) for one sequence of ``sq`` x ``sk`` (a varlen call: its ``max_seqlen_*``)."""
    left, right = window if window is not None else (-1, -1)
    w = flash_window(causal, left, right, max_seqlen_q or sq, max_seqlen_k or sk, entry)
    return flash_mask(sq, sk, w)
