"""TRL 1.16's ``VLLMClient`` (``trl/generation/vllm_client.py``), the client of a vLLM server, without
the server: the methods ``GRPOTrainer``'s server mode calls, with their signatures, defaults and
return shapes, and completions that are a fixed function of the prompt and the sample's index (a
stand-in for sampling), so that two runs asking for the same prompts get the same completions.

Rules, each from ``trl/generation/vllm_client.py`` at v1.16.0:

- ``__init__(base_url=None, host="0.0.0.0", server_port=8000, group_port=51216,
  connection_timeout=0.0)`` (lines 205-211); ``VLLMGeneration`` builds it on the main process only
  (``trl/generation/vllm_generation.py`` 300-309) and calls ``init_communicator(device)`` (726).
- ``get_server_info() -> dict``: the server's ``vllm_config`` JSON tree (303-318); ``GRPOTrainer``
  reads ``["model_config"]["logprobs_mode"]`` (``trl/trainer/grpo_trainer.py`` 1142-1147).
- ``generate(prompts, features=None, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0,
  top_k=0, min_p=0.0, max_tokens=16, logprobs=0, structured_outputs_regex=None,
  generation_kwargs=None)`` (370-384) returns ``{"prompt_ids": [len(prompts)][prompt_len],
  "completion_ids": [len(prompts) * n][<= max_tokens], "logprobs": [len(prompts) * n][len][1 +
  logprobs], "logprob_token_ids": same shape}``, prompt-major: the ``n`` completions of a prompt
  come before those of the next (455-466); ``logprobs=0``: one value per token, the sampled
  token's (the docstring, 403-406); ``logprobs=None``: none (here: ``None`` lists).
- ``image_features(images, max_concurrent_requests=64)`` (326-368): one entry per prompt, ``None`` where the
  prompt has no images, else the server's processed images; ``VLLMGeneration`` asks for every gathered prompt's
  images (``all_images[::num_generations]``) and reads only ``["mm_placeholders"]["image"]`` (one entry per
  image), which it replaces by the image-token runs of the prompt (``trl/generation/vllm_generation.py``
  519-548, 611-615). Here: ``{"mm_hashes": {"image": [...]}, "mm_placeholders": {"image": [...]}}``, a hash of
  each image's pixels (the processed data depends on the image alone, 333-335).
- ``generate(..., features=...)``: token-id prompts only, one request per prompt, ``prompt_ids`` echoed back
  unchanged (445-446, 468-506); here the completions are a fixed function of the prompt and its images' hashes.
- ``update_named_params(metadata, named_params)`` streams the weights (821); here it consumes them.
- ``reset_prefix_cache()`` (875).

``VLLMClientStandIn.requests`` keeps every ``generate`` call's prompts and ``image_requests`` every
``image_features`` call's image counts per prompt (the tests check what reached the server).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["VLLMClientStandIn"]


class VLLMClientStandIn:
    """``trl.generation.vllm_client.VLLMClient`` (TRL 1.16) without a server; see the module docstring.
    ``vocab``: token ids are drawn from ``[3, vocab)``; ``eos``: appended to odd-length completions."""

    vocab = 64
    eos = 1
    requests: list[list[list[int]]] = []
    image_requests: list[list[int]] = []
    synced: list[int] = []

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
    ) -> None:
        self.base_url = base_url or f"http://{host}:{server_port}"
        self.group_port = group_port

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        self.device = device

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def update_named_params(
        self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]
    ) -> None:
        type(self).synced.append(sum(1 for _ in named_params))

    def reset_prefix_cache(self) -> None:
        pass

    def image_features(self, images: list[list | None], max_concurrent_requests: int = 64) -> list[dict | None]:
        type(self).image_requests.append([len(i) if i else 0 for i in images])

        def one(pics: list) -> dict:
            hashes = [int(sum(hashlib.sha256(image.tobytes()).digest()[:4])) for image in pics]
            return {"mm_hashes": {"image": hashes},
                    "mm_placeholders": {"image": [{"offset": 0, "length": 0} for _ in pics]}}  # fmt: skip

        return [one(pics) if pics else None for pics in images]

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        features: list[dict | None] | None = None,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
    ) -> dict[str, Any]:
        if any(isinstance(p, str) for p in prompts) or logprobs not in (0, None):
            raise NotImplementedError("VLLMClientStandIn: token-id prompts, logprobs 0 or None")
        if features is not None and len(features) != len(prompts):
            raise ValueError(f"VLLMClientStandIn: {len(features)} features for {len(prompts)} prompts")
        type(self).requests.append([list(p) for p in prompts])
        completions, values = [], []
        for i, p in enumerate(prompts):
            feats = features[i] if features is not None else None
            seen = sum(feats["mm_hashes"]["image"]) if feats else 0  # the images' hashes
            for j in range(n):  # prompt-major, as the server returns its choices
                g = torch.Generator().manual_seed(int(sum(p)) * 31 + j + 7 * seen)
                k = int(torch.randint(2, max(3, max_tokens), (1,), generator=g))
                ids = torch.randint(3, self.vocab, (k,), generator=g).tolist()
                ids = (ids + [self.eos])[:max_tokens] if k % 2 else ids
                completions.append(ids)
                values.append([-math.log(self.vocab) * (0.9 + 0.2 * (t % 3) / 2) for t in ids])
        return {
            "prompt_ids": [list(p) for p in prompts],
            "completion_ids": completions,
            "logprobs": None if logprobs is None else [[[v] for v in seq] for seq in values],
            "logprob_token_ids": None if logprobs is None else [[[t] for t in seq] for seq in completions],
        }
