"""Models without attention under context parallelism, model level, against one process in float64
(the sweep's oracle: transformers' float32 casts widened, ``testkit.mixers``): Mamba, Mamba2 and
Falcon-Mamba -- their convolutions and selective / SSD scans routed through ``hf_ring.ops.mixers``
-- exact with labels and without (the logits of a prefill), packed documents against each document
alone, with LoRA and activation checkpointing; a Qwen3.5 whose layers are all linear attention
exact; and refused, with labels and without, what hf_ring cannot compute: RWKV and xLSTM (no
context-parallel form of their mixer), BART-family decoders (positions numbered from the local
length). Jamba's Mamba layers keep their activation checkpointing after ``import hf_ring``."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.errors import RingNotSupported
from testkit.families import causal_lm_class, tiny_config
from testkit.mixers import float64_kernels, widened_casts
from testkit.models import cp_grad_error, documents_alone_loss, packed_batch, tiny_batch
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

DOCS = [1, 2, 9, 1, 14, 2, 1, 7, 3]  # 40 tokens: documents cross chunks and ranks
LORA = {"in_proj", "x_proj", "dt_proj"}  # PEFT refuses LoRA on a Mamba mixer's out_proj


def build(model_type: str, attn: str, lora: bool = False, ckpt: bool = False, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = causal_lm_class(model_type)
    experts = {"experts_implementation": "eager"}  # float64 MoE experts (Jamba)
    try:
        model = cls._from_config(tiny_config(model_type, **fields), attn_implementation=attn, **experts)
    except ValueError:  # no sdpa (Mamba): the one-process reference runs eager
        model = cls._from_config(tiny_config(model_type, **fields), attn_implementation="eager", **experts)
    model = model.to(torch.float64)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=sorted(names & LORA), init_lora_weights=False)
        model = get_peft_model(model, cfg)
    if ckpt:
        model.gradient_checkpointing_enable()
        if lora:
            model.enable_input_require_grads()
    return model.train()


def _alone_logits(model: torch.nn.Module, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(starts, starts[1:])], dim=1)


def step_errors(model_type: str, packed: bool = False, lora: bool = False, ckpt: bool = False, **fields) -> dict:
    """On every rank: a ring training step (loss, CP-averaged gradients) and a ring prefill (logits)
    against one process, all in float64 (float32 casts widened, but not under activation
    checkpointing: backward's recompute runs outside this thread's torch function modes)."""
    vocab = tiny_config(model_type, **fields).get_text_config().vocab_size
    with float64_kernels(), widened_casts() if not ckpt else contextlib.nullcontext():
        ring, ref = build(model_type, "ring", lora, ckpt, **fields), build(model_type, "sdpa", lora, ckpt, **fields)
        if packed:
            batch = packed_batch(DOCS, vocab)
            want = documents_alone_loss(ref, batch["input_ids"], batch["labels"], DOCS)
        else:
            batch = tiny_batch(2, 45, vocab=vocab)
            want = ref(**batch, use_cache=False).loss
        out = ring(**hf_ring.shard_batch(batch))
        out.loss.backward()
        want.backward()
        ring.eval(), ref.eval()
        prefill = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            kwargs = hf_ring.shard_batch(prefill)
            logits = kwargs["ring_context"].unshard(ring(**kwargs).logits)[:, : batch["input_ids"].shape[1]]
            alone = _alone_logits(ref, batch["input_ids"], DOCS) if packed else ref(**prefill, use_cache=False).logits
    calls = kwargs["ring_context"].cross_rank_calls.mixers
    return {"loss": rel_err(out.loss, want), "grads": cp_grad_error(ring, ref), "logits": rel_err(logits, alone),
            "mixer_calls": calls, "world": dist.get_world_size()}  # fmt: skip


def check(results: list[dict], tol: float = 1e-9) -> None:
    for r in results:
        assert r["loss"] <= tol and r["grads"] <= tol and r["logits"] <= tol, r
        assert r["mixer_calls"] > 0 or r["world"] == 1, r


def test_mamba_is_exact() -> None:
    """One sequence per row (the sweep runs the three families so at CP = 2 and 4 in float32)."""
    check(run_ranks(2, step_errors, "mamba"))


@pytest.mark.parametrize(("world", "model_type"), [(3, "mamba"), (2, "mamba2"), (4, "falcon_mamba"), (1, "mamba2")])
def test_mamba_packed_documents_equal_each_document_alone(world: int, model_type: str) -> None:
    check(run_ranks(world, step_errors, model_type, packed=True))


@pytest.mark.parametrize(("world", "model_type", "lora"), [(3, "mamba", True), (2, "jamba", False)])
def test_activation_checkpointing_recomputes_under_the_context(world: int, model_type: str, lora: bool) -> None:
    """The recompute in backward runs the routed scans again, for models whose layers never see the
    batch's keyword arguments (their checkpoint function carries the context)."""
    check(run_ranks(world, step_errors, model_type, lora=lora, ckpt=True), tol=1e-5)


def test_all_linear_attention_qwen3_5_runs() -> None:
    """No attention layer at all: the guard counts the Gated DeltaNet calls, not attention layers."""
    check(run_ranks(2, step_errors, "qwen3_5_text", layer_types=["linear_attention"] * 2, num_hidden_layers=2))


def refusals(model_type: str) -> dict[str, str]:
    torch.manual_seed(0)
    config = tiny_config(model_type)
    model = causal_lm_class(model_type)._from_config(config, attn_implementation="ring")
    batch = tiny_batch(2, 24, vocab=config.get_text_config().vocab_size)
    out = {}
    for name, b in (("labelled", batch), ("unlabelled", {"input_ids": batch["input_ids"]})):
        try:
            model(**hf_ring.shard_batch(b))
            out[name] = "no error"
        except RingNotSupported as e:
            out[name] = str(e)
    return out


@pytest.mark.parametrize(
    ("model_type", "labelled", "unlabelled"),
    [("rwkv", "never ran ring attention", "never ran ring attention"),
     ("xlstm", "never ran ring attention", "never ran ring attention"),
     ("bart", "numbers positions itself", "numbers positions itself")],
)  # fmt: skip
def test_what_has_no_context_parallel_form_is_refused_with_labels_and_without(
    model_type: str, labelled: str, unlabelled: str
) -> None:
    for r in run_ranks(2, refusals, model_type):
        assert labelled in r["labelled"] and unlabelled in r["unlabelled"], r


def test_jamba_mamba_layers_stay_checkpointed() -> None:
    """``import hf_ring`` leaves transformers' activation checkpointing of Jamba's Mamba decoder
    layers in place: backward runs their mixer again."""
    import transformers.models.jamba.modeling_jamba as jamba

    model = causal_lm_class("jamba")._from_config(tiny_config("jamba"), attn_implementation="sdpa")
    model.gradient_checkpointing_enable()
    model.train()
    calls = []
    handles = [m.register_forward_hook(lambda *_: calls.append(1)) for m in model.modules()
               if isinstance(m, jamba.JambaMambaMixer)]  # fmt: skip
    batch = tiny_batch(1, 12, vocab=tiny_config("jamba").vocab_size)
    loss = model(**batch, use_cache=False).loss
    forward = len(calls)
    loss.backward()
    for h in handles:
        h.remove()
    assert forward > 0 and len(calls) == 2 * forward, (forward, len(calls))


def test_fused_mamba_kernels_step_aside_under_the_context() -> None:
    """mamba-ssm's fused ``mamba_inner_fn`` (the training path of Mamba and Falcon-Mamba on GPUs) would
    scan the local shard alone: under a ``ring_context`` -- given, or carried by the model's forward --
    its route returns ``None`` and the mixer takes the routed convolution and scan."""
    from hf_ring.transformers import carry, mixers

    fused = mixers.MIXER_ROUTES["unfused"](lambda *args, **kwargs: "fused")
    packed = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    ctx = hf_ring.shard_batch(packed)["ring_context"]  # one rank, packed documents: the CP form runs
    assert fused(1) == "fused" and fused(1, ring_context=ctx) is None
    token = carry.ACTIVE.set(ctx)
    try:
        assert fused(1) is None
    finally:
        carry.ACTIVE.reset(token)
