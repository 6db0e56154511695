"""Tiny vision-language models from transformers' config classes (nothing downloaded), batches with
images, and one training step with and without context parallelism, for the exactness tests."""

from __future__ import annotations

import torch

import hf_ring
from testkit.models import named_grads

VOCAB = 96
IMAGE, VIDEO, START, END = 90, 91, 92, 93  # special token ids of the tiny models
FAMILIES = ("qwen3_vl", "qwen3_5", "qwen3_5_moe", "llama4", "gemma3")


def _qwen_vision(**extra) -> dict:
    return dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=2,
                temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
                **extra)  # fmt: skip


def tiny_config(family: str):
    """A config of ``family`` with a 2-layer text decoder (hidden 32) and a 2-layer vision encoder."""
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)  # fmt: skip
    mrope = dict(rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig(text_config={**text, "rope_parameters": mrope},
                             vision_config=_qwen_vision(deepstack_visual_indexes=[0]), **ids)  # fmt: skip
    if family == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeConfig

        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
        return Qwen3VLMoeConfig(text_config={**text, **moe, "rope_parameters": mrope},
                                vision_config=_qwen_vision(deepstack_visual_indexes=[0]), **ids)  # fmt: skip
    if family in ("qwen3_5", "qwen3_5_moe"):
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig

        hybrid = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_conv_kernel_dim=4, rope_parameters={**mrope, "partial_rotary_factor": 0.5})  # fmt: skip
        if family == "qwen3_5":
            return Qwen3_5Config(text_config={**text, **hybrid}, vision_config=_qwen_vision(), **ids)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
        return Qwen3_5MoeConfig(text_config={**text, **hybrid, **moe}, vision_config=_qwen_vision(), **ids)
    from testkit.families import tiny_config as text_config

    if family == "llama4":  # chunked attention over 8 tokens, NoPE layer, MoE
        from transformers import Llama4Config

        text = text_config("llama4_text", attention_chunk_size=8).to_dict() | {"vocab_size": VOCAB}
        vision = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=8,
                      patch_size=2, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)  # fmt: skip
        return Llama4Config(text_config=text, vision_config=vision, image_token_index=IMAGE, boi_token_index=START,
                            eoi_token_index=END)  # fmt: skip
    if family == "gemma3":  # sliding windows of 8 tokens
        from transformers import Gemma3Config

        text = text_config("gemma3_text", sliding_window=8).to_dict() | {"vocab_size": VOCAB}
        vision = dict(model_type="siglip_vision_model", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, image_size=8, patch_size=2)  # fmt: skip
        return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
                            boi_token_index=START, eoi_token_index=END)  # fmt: skip
    raise ValueError(family)


def as_images(batch: dict[str, torch.Tensor], first: int = 0) -> dict[str, torch.Tensor]:
    """A batch of ``qwen_batch``, ``packed_batch`` or ``documents`` for Llama 4 and Gemma 3 (built with
    images of 4x4 patches: 4 image tokens each): image ``i`` (counted from ``first``) a ``[3, 8, 8]``
    array of its own, no ``token_type_ids`` (Gemma 3 then attends causally; the tests add them for its image
    blocks)."""
    out = {k: v for k, v in batch.items() if k not in ("image_grid_thw", "pixel_values", "mm_token_type_ids")}
    count = len(batch["image_grid_thw"])
    out["pixel_values"] = torch.stack(
        [torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(100 + first + i)) for i in range(count)]
    ).double()
    return out


def encoder(model) -> torch.nn.Module:
    """The vision encoder of a model of ``FAMILIES`` (or of a PEFT model of one)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    inner = getattr(model, "model", model)
    for name in ("visual", "vision_tower", "vision_model"):
        for owner in (inner, model):
            if isinstance(getattr(owner, name, None), torch.nn.Module):
                return getattr(owner, name)
    raise ValueError(type(model).__name__)


def tiny_model(family: str, attn: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """The same weights for every ``attn`` given the same ``seed``."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(
        tiny_config(family), attn_implementation=attn, experts_implementation="eager"
    )
    return model.to(dtype)


def qwen_batch(rows: list[list[tuple[str, int]]], seed: int = 1) -> dict[str, torch.Tensor]:
    """A Qwen-style batch: each row a list of pieces, ``("text", n)`` (``n`` random tokens) or
    ``("image", s)`` (an ``s x s``-patch image: start, ``s*s/4`` image tokens, end), ``("video", s)`` (4
    frames of ``s x s`` patches: per 2 frames a timestamp token, start, ``s*s/4`` video tokens, end;
    ``("video", s, t)``: ``2 t`` frames); rows
    padded on the
    right to one length (``attention_mask``). Labels: the text tokens (``-100`` on image tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids_rows, types_rows, grids, pixels, video_grids, video_pixels = [], [], [], [], [], []
    for row in rows:
        ids, types = [], []
        for kind, size, *length in row:
            if kind == "text":
                ids += torch.randint(0, 80, (size,), generator=g).tolist()
                types += [0] * size
            elif kind == "image":
                tokens = size * size // 4
                ids += [START, *([IMAGE] * tokens), END]
                types += [0, *([1] * tokens), 0]
                grids.append([1, size, size])
                pixels.append(torch.randn(size * size, 3 * 2 * 2 * 2, generator=g))
            else:  # a video of 2 t frames: t temporal patches, each after a timestamp token (as Qwen's processor)
                tokens, t = size * size // 4, length[0] if length else 2
                for _ in range(t):
                    ids += [int(torch.randint(0, 80, (1,), generator=g)), START, *([VIDEO] * tokens), END]
                    types += [0, 0, *([2] * tokens), 0]
                video_grids.append([t, size, size])
                video_pixels.append(torch.randn(t * size * size, 3 * 2 * 2 * 2, generator=g))
        ids_rows.append(ids)
        types_rows.append(types)
    n = max(len(r) for r in ids_rows)
    mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in ids_rows])
    input_ids = torch.tensor([r + [0] * (n - len(r)) for r in ids_rows])
    types = torch.tensor([r + [0] * (n - len(r)) for r in types_rows])
    labels = input_ids.masked_fill((types != 0) | (mask == 0), -100)
    out = {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "mm_token_type_ids": types}
    if grids:
        out |= {"pixel_values": torch.cat(pixels).double(), "image_grid_thw": torch.tensor(grids)}
    if video_grids:
        out |= {"pixel_values_videos": torch.cat(video_pixels).double(), "video_grid_thw": torch.tensor(video_grids)}
    return out


def step(model, batch: dict, *, cp: bool, group=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients (by parameter name, float64) of one training step; with ``cp`` the batch goes
    through ``shard_batch`` and gradients are averaged over the world, as DDP would."""
    model.train()
    out = model(**(hf_ring.shard_batch(batch, group=group) if cp else batch))
    out.loss.backward()
    return out.loss.detach().double(), named_grads(model, cp)


def packed_batch(rows: list[list[tuple[str, int]]], model=None, seed: int = 1) -> dict[str, torch.Tensor]:
    """The rows of ``qwen_batch`` packed into one row as documents (``hf_ring.data.images``):
    ``position_ids [1, N]`` restarting at 0, or with ``model`` (a Qwen VL model) ``[4, 1, N]``: the
    text row, then each document's own M-RoPE rows."""
    from hf_ring.data.images import pack_multimodal

    return pack_multimodal(documents(rows, text_positions=False, seed=seed), rope_model=model)


def documents(rows: list[list[tuple[str, int]]], text_positions: bool, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Each row of ``qwen_batch(rows)`` alone, as its own batch (what a packed row of them must equal);
    ``text_positions``: with ``position_ids`` 0, 1, 2, ... (else the model computes its M-RoPE rows)."""
    full = qwen_batch(rows, seed)
    sizes = full["image_grid_thw"].prod(-1).tolist()
    out, image, pixel = [], 0, 0
    for i, r in enumerate(full["attention_mask"].bool()):
        doc = {k: full[k][i : i + 1, r] for k in ("input_ids", "labels", "mm_token_type_ids")}
        count = int((doc["input_ids"] == START).sum())
        n_pix = sum(sizes[image : image + count])
        doc["pixel_values"] = full["pixel_values"][pixel : pixel + n_pix]
        doc["image_grid_thw"] = full["image_grid_thw"][image : image + count]
        image, pixel = image + count, pixel + n_pix
        if text_positions:
            doc["position_ids"] = torch.arange(doc["input_ids"].shape[1])[None]
        out.append(doc)
    return out


def documents_step(model, docs: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of ``docs`` run one by one, the loss over all their targets."""
    model.train()
    counts = [int((d["labels"][:, 1:] != -100).sum()) for d in docs]
    loss = sum(model(**d).loss * c for d, c in zip(docs, counts)) / sum(counts)
    loss.backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach().double(), grads


def tiny_processor():
    """A ``Qwen3VLProcessor`` for ``tiny_model("qwen3_vl", ...)`` (nothing downloaded): a word-level
    tokenizer (``w0`` ... ``w76`` are ids 3 ... 79, ``<pad>`` 0, ``</s>`` 1) whose vision tokens have the
    tiny config's ids, and the PIL image processor with the tiny encoder's patches (2 x 2 pixels, 2
    frames, 2 x 2 merged into one token: an ``8 x 12`` image is 6 tokens). No video processor (it needs
    torchvision): images only."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    special = {"<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO, "<|vision_start|>": START, "<|vision_end|>": END}
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(77)}, **special}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                  additional_special_tokens=list(special))  # fmt: skip
    images = Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 16, "longest_edge": 4096})  # fmt: skip

    class ImagesOnly(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # noqa: ANN001, ANN202
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ImagesOnly(image_processor=images, tokenizer=tok, video_processor=None)


def tiny_gemma3_processor():
    """A ``Gemma3Processor`` for ``tiny_model("gemma3", ...)`` (nothing downloaded): the word-level tokenizer of
    ``tiny_processor`` (``w0`` ... ``w76`` are ids 3 ... 79) whose ``<start_of_image>``, ``<image_soft_token>``,
    ``<end_of_image>`` have the tiny config's ids, and the PIL image processor resizing each image to the tiny
    encoder's ``8 x 8`` (4 image tokens, ``mm_tokens_per_image``). The processor's ``token_type_ids`` mark the
    image tokens (1), as Gemma 3's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    special = {"<image_soft_token>": IMAGE, "<start_of_image>": START, "<end_of_image>": END}
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(77)}, **special}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                  extra_special_tokens={"image_token": "<image_soft_token>",
                                                        "boi_token": "<start_of_image>",
                                                        "eoi_token": "<end_of_image>"})  # fmt: skip
    images = Gemma3ImageProcessorPil(size={"height": 8, "width": 8})
    return Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4)
