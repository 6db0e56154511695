"""Tokenised text packed into fixed-length sequences, for the GPU recipes.

``path`` is a JSON-lines file with ``input_ids`` (pre-tokenised) per line. Documents are joined
(separated by nothing: add an EOS token when tokenising) and cut into ``seq_len`` windows; labels
are the inputs (the loss shifts them once, on the full sequence).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import Dataset


class PackedTokens(Dataset):
    def __init__(self, path: str | Path, seq_len: int, seed: int = 0) -> None:
        ids: list[int] = []
        with open(path) as f:
            for line in f:
                ids.extend(json.loads(line)["input_ids"])
        n = len(ids) // seq_len
        if n == 0:
            raise ValueError(f"{path}: {len(ids)} tokens is less than one sequence of {seq_len}")
        self.tokens = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[self.order[i % len(self.order)]]
        return {"input_ids": ids, "labels": ids.clone()}
