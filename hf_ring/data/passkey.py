"""Synthetic passkey retrieval: find a five-digit key hidden in a long haystack.

A sequence is ``[hay ... NEEDLE d1 d2 d3 d4 d5 hay ... ASK d1 d2 d3 d4 d5]``; digit ``j`` is drawn
from its own group of ten tokens, so the answer's ``j``-th token must be copied from the key. Only
the answer tokens carry labels. A sample is retrieved when all five are predicted (teacher forcing,
which equals greedy decoding when every digit is right).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from ..ops.cross_entropy import IGNORE_INDEX

DIGITS = 5
HAY = 32  # haystack tokens 0..31
NEEDLE, ASK = HAY, HAY + 1
VOCAB = HAY + 2 + 10 * DIGITS


def digit_token(position: int, value: int) -> int:
    return HAY + 2 + 10 * position + value


@dataclass(frozen=True)
class PasskeyDataset(Dataset):
    """``length`` sequences of ``seq_len`` tokens; sample ``i`` is the same for every rank and run."""

    seq_len: int
    length: int = 1_000_000
    seed: int = 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, HAY, (self.seq_len,), generator=g)
        digits = torch.randint(0, 10, (DIGITS,), generator=g)
        key = torch.tensor([NEEDLE] + [digit_token(j, int(d)) for j, d in enumerate(digits)])
        answer = torch.tensor([ASK] + [digit_token(j, int(d)) for j, d in enumerate(digits)])
        room = self.seq_len - 2 * (DIGITS + 1)
        if room < 0:
            raise ValueError(f"passkey: seq_len {self.seq_len} is shorter than {2 * (DIGITS + 1)}")
        at = int(torch.randint(0, room + 1, (1,), generator=g))
        ids[at : at + DIGITS + 1] = key
        ids[-(DIGITS + 1) :] = answer
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[-DIGITS:] = ids[-DIGITS:]
        return {"input_ids": ids, "labels": labels}


def retrieved(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: every answer digit predicted. ``logits [B, N, V]`` and ``labels [B, N]`` in
    global order (``hf_ring.unshard`` the logits of a context-parallel prefill)."""
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    ok = (pred == target) | (target == IGNORE_INDEX)
    return ok.all(-1)
