"""The chunked LM-head + cross-entropy: the same loss and gradients as the full logits path (fp32,
against float64), on its own and inside ring models with CP = 2 (plain, tied, LoRA + checkpointing,
DDP); logits stay available when asked for; and a step with a 50K vocabulary stays far below the
memory that full logits need."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_ring
from hf_ring.ops.cross_entropy import chunked_causal_lm_loss
from testkit.live_tensors import LiveTensorBytes
from testkit.mixed_precision import GemmDtypes, confident_model, grad_errors
from testkit.models import tiny_batch, tiny_model
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

# --- the function ---------------------------------------------------------------------------------


def _labels(shape: tuple[int, ...], vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, shape, generator=g)
    y[..., :3] = -100
    y[..., -1] = -100
    y.view(-1)[7::5] = -100
    return y


def _reference(hidden, weight, bias, labels, num_items):
    """Full logits in float64: (loss, d hidden, d weight, d bias)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = bias.detach().double().requires_grad_() if bias is not None else None
    logits = F.linear(h, w, b)
    loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")
    loss = loss / (num_items if num_items is not None else (labels != -100).sum())
    loss.backward()
    return loss, h.grad, w.grad, b.grad if b is not None else None


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_items", [None, 50])
def test_linear_head_matches_full_logits_fp32(chunk, bias, num_items):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 301, bias=bias)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    labels = _labels((2, 37), 301)
    ref_loss, ref_h, ref_w, ref_b = _reference(hidden, head.weight, head.bias, labels, num_items)
    loss = chunked_causal_lm_loss(hidden, head, labels, num_items_in_batch=num_items, chunk_size=chunk)
    loss.backward()
    assert loss.dtype == torch.float32
    assert rel_err(loss, ref_loss) < 1e-6
    assert rel_err(hidden.grad, ref_h) < 1e-6
    assert rel_err(head.weight.grad, ref_w) < 1e-6
    if bias:
        assert rel_err(head.bias.grad, ref_b) < 1e-6
    assert hidden.grad[labels == -100].abs().max() == 0  # rows without a target get no gradient


def test_other_heads_take_the_checkpointed_path():
    """A head that is not a plain nn.Linear (here: Linear + a LoRA-style update) is run per chunk."""

    class LoraHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(16, 101, bias=False)
            self.a = torch.nn.Parameter(torch.randn(4, 16) * 0.1)
            self.b = torch.nn.Parameter(torch.randn(101, 4) * 0.1)

        def forward(self, x):
            return self.base(x) + x @ self.a.t() @ self.b.t()

    torch.manual_seed(0)
    head = LoraHead()
    hidden = torch.randn(1, 29, 16, requires_grad=True)
    labels = _labels((1, 29), 101, seed=1)
    loss = chunked_causal_lm_loss(hidden, head, labels, chunk_size=6)
    loss.backward()
    h = hidden.detach().double().requires_grad_()
    params = [p.detach().double().requires_grad_() for p in (head.base.weight, head.a, head.b)]
    logits = h @ params[0].t() + h @ params[1].t() @ params[2].t()
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref.backward()
    assert rel_err(loss, ref) < 1e-6
    assert rel_err(hidden.grad, h.grad) < 1e-6
    for p, r in zip((head.base.weight, head.a, head.b), params):
        assert rel_err(p.grad, r.grad) < 1e-6


def test_bf16_is_as_close_as_the_full_path():
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 257, bias=False).to(torch.bfloat16)
    hidden = torch.randn(1, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    labels = _labels((1, 64), 257)
    ref_loss, ref_h, ref_w, _ = _reference(hidden, head.weight, None, labels, None)
    # the full path as transformers runs it: bf16 logits, upcast, float32 cross-entropy
    h_full = hidden.detach().clone().requires_grad_()
    w_full = head.weight.detach().clone().requires_grad_()
    full = F.cross_entropy(F.linear(h_full, w_full).float().flatten(0, 1), labels.flatten())
    full.backward()
    loss = chunked_causal_lm_loss(hidden, head, labels, chunk_size=16)
    loss.backward()
    assert hidden.grad.dtype == head.weight.grad.dtype == torch.bfloat16
    assert rel_err(loss, ref_loss) <= max(2 * rel_err(full, ref_loss), 1e-5)
    assert rel_err(hidden.grad, ref_h) <= 1.5 * rel_err(h_full.grad, ref_h)
    assert rel_err(head.weight.grad, ref_w) <= 1.5 * rel_err(w_full.grad, ref_w)


def _confident_head(t: int, hdim: int, vocab: int, bias: bool, seed: int = 0):
    """``(hidden [t, hdim], head, targets [t])`` with targets the head predicts with median
    probability above 0.95 (float32 weights)."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(hdim, vocab, bias=bias)
    hidden = torch.randn(t, hdim)
    logits = F.linear(hidden.double(), head.weight.double(), None if head.bias is None else head.bias.double())
    target = logits.argmax(-1)
    scale = 1.0
    while F.softmax(logits * scale, -1).gather(1, target[:, None]).median() < 0.95:
        scale *= 1.25
    return (hidden * scale).requires_grad_(), head, target


def _errors_vs_float64(hidden, head, target, loss_fn, dtype):
    """Relative errors of the loss and of d hidden, d weight (, d bias) of ``loss_fn(hidden, head,
    target)`` under CPU autocast to ``dtype``, against float64 without autocast."""
    params = [p for p in head.parameters()]
    ref_head = copy.deepcopy(head).double()
    h64 = hidden.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_head(h64), target)
    ref_grads = torch.autograd.grad(ref, [h64, *ref_head.parameters()])
    h = hidden.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype):
        loss = loss_fn(h, head, target)
    grads = torch.autograd.grad(loss, [h, *params])
    return [rel_err(loss, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]


def _full_path(h, head, target):  # transformers' ForCausalLMLoss on full logits
    return F.cross_entropy(head(h).float(), target)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_autocast_with_confident_targets_is_as_close_as_the_full_path(dtype, bias):
    """Under autocast with float32 weights and targets predicted with p ~ 0.95, the chunked loss's
    gradients are as close to float64 as those of the full path under the same autocast: backward
    recomputes the logits in the forward's autocast dtype (a float32 recompute against a bf16
    log-sum-exp gave a softmax that does not sum to 1). Its GEMMs run in the autocast dtype."""
    hidden, head, target = _confident_head(67, 48, 1031, bias)

    def chunked(h, head, y):
        return chunked_causal_lm_loss(h, head, y, chunk_size=16)

    full = _errors_vs_float64(hidden, head, target, _full_path, dtype)
    got = _errors_vs_float64(hidden, head, target, chunked, dtype)
    names = ["loss", "hidden", "weight", "bias"]
    for name, e, ref in zip(names, got, full):
        assert e <= 2 * ref + 1e-6, f"{name}: chunked {e:.2e} vs full path {ref:.2e}"
    h = hidden.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype):
        loss = chunked(h, head, target)
    with GemmDtypes() as rec:
        loss.backward()
    assert len(rec.gemms) == 3 * 5  # 5 chunks: the logits' recompute, d hidden, d weight
    assert all(set(dtypes) == {dtype} for _, dtypes in rec.gemms), rec.gemms


def test_autocast_other_heads_recompute_in_the_forward_dtype():
    """A head that is not an nn.Linear runs under checkpointing, which re-enters the forward's
    autocast state: as close to float64 as the full path."""

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    hidden, head, target = _confident_head(45, 32, 257, True, seed=1)
    head = Wrapped(head)

    def chunked(h, head, y):
        return chunked_causal_lm_loss(h, head, y, chunk_size=8)

    full = _errors_vs_float64(hidden, head, target, _full_path, torch.bfloat16)
    got = _errors_vs_float64(hidden, head, target, chunked, torch.bfloat16)
    for name, e, ref in zip(["loss", "hidden", "weight", "bias"], got, full):
        assert e <= 2 * ref + 1e-6, f"{name}: chunked {e:.2e} vs full path {ref:.2e}"


def test_autocast_model_with_confident_targets_within_twice_the_full_path():
    """A tiny float32 Llama trained until it predicts its batch with median p > 0.95, one step under
    CPU bf16 autocast: every parameter gradient of the chunked loss within 2x of the full path's
    error against float64 (before the chunked loss kept the forward's autocast state: 20x on the
    worst parameter, ``python -m benchmarks.bench_autocast``)."""
    model, batch, median = confident_model(vocab=256, confidence=0.95)
    plain = grad_errors(model, batch)
    chunked = grad_errors(model, batch, lambda m: hf_ring.enable_chunked_loss(m, chunk_size=32))
    for name, ref in plain.items():
        assert chunked[name] <= 2 * ref + 1e-6, f"{name}: chunked {chunked[name]:.3f} vs full path {ref:.3f}"
    assert max(plain.values()) < 0.5  # the step is meaningful at all under bf16


def test_frozen_head_and_no_targets():
    head = torch.nn.Linear(8, 11, bias=False).requires_grad_(False)
    hidden = torch.randn(1, 9, 8, requires_grad=True)
    loss = chunked_causal_lm_loss(hidden, head, _labels((1, 9), 11), chunk_size=2)
    loss.backward()
    assert head.weight.grad is None and hidden.grad is not None
    none = torch.full((1, 9), -100)
    assert chunked_causal_lm_loss(hidden, head, none, num_items_in_batch=4).item() == 0.0
    with pytest.raises(ValueError, match="shifted"):
        chunked_causal_lm_loss(hidden, head, none[:, :5])


def test_a_shard_without_targets_stays_in_the_graph():
    """A rank whose shard holds no target (answer-only SFT, passkey data) must still run a backward
    that reaches the head and the hidden states, with zero gradients, whatever the head: else DDP and
    FSDP, which reduce gradients across ranks, would raise or hang on that rank."""

    class Wrapped(torch.nn.Module):  # a head that is not an nn.Linear: the checkpointed path
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(8, 11)

        def forward(self, x):
            return self.inner(x)

    class SubLinear(torch.nn.Linear):  # a subclass with the stock forward, like FSDP2's FSDPLinear
        pass

    none = torch.full((1, 9), -100)
    for head in (torch.nn.Linear(8, 11), SubLinear(8, 11), Wrapped()):
        hidden = torch.randn(1, 9, 8, requires_grad=True)
        loss = chunked_causal_lm_loss(hidden, head, none, num_items_in_batch=5)
        assert loss.item() == 0.0 and loss.requires_grad, type(head).__name__
        loss.backward()
        assert hidden.grad is not None and hidden.grad.abs().max() == 0
        grads = [p.grad for p in head.parameters()]
        assert all(g is not None and g.abs().max() == 0 for g in grads), type(head).__name__


def test_linear_subclasses_take_the_fused_path():
    """An nn.Linear subclass with the stock forward (FSDP2's FSDPLinear) reads its weight directly;
    one whose forward is replaced on the instance runs as a module."""

    class SubLinear(torch.nn.Linear):
        pass

    torch.manual_seed(0)
    head = SubLinear(16, 101)
    hidden = torch.randn(1, 29, 16, requires_grad=True)
    labels = _labels((1, 29), 101, seed=2)
    ref, *_ = _reference(hidden, head.weight, head.bias, labels, None)
    loss = chunked_causal_lm_loss(hidden, head, labels, chunk_size=6)
    assert loss.grad_fn.name().startswith("_ChunkedLinearCE") and rel_err(loss, ref) < 1e-6
    head.forward = lambda x: F.linear(x, head.weight, head.bias) * 2.0  # an instance-level forward
    doubled = chunked_causal_lm_loss(hidden, head, labels, chunk_size=6)
    assert not doubled.grad_fn.name().startswith("_ChunkedLinearCE") and abs(doubled.item() - ref.item()) > 0.1


# --- inside a model ---------------------------------------------------------------------------


def test_eval_logits_and_full_logits_switch():
    """Hooked models still return logits when there are no labels, and with shard_batch(full_logits=True)."""
    batch = tiny_batch(2, 21)
    model = tiny_model("llama", "ring")
    hf_ring.enable_chunked_loss(model, chunk_size=5)
    hf_ring.enable_chunked_loss(model, chunk_size=5)  # idempotent
    out = model(**hf_ring.shard_batch(batch))
    assert out.logits.shape == (2, 0, 97) and out.loss.isfinite()
    no_labels = model(**hf_ring.shard_batch({"input_ids": batch["input_ids"]}))
    assert no_labels.logits.shape == (2, 22, 97)  # padded to a multiple of 2P = 2
    full = model(**hf_ring.shard_batch(batch, full_logits=True))
    assert full.logits.shape == (2, 22, 97)
    assert torch.allclose(full.loss, out.loss, rtol=1e-6)
    hf_ring.disable_chunked_loss(model)
    assert model(**hf_ring.shard_batch(batch)).logits.shape == (2, 22, 97)
    plain = model(**batch)  # no shard_batch: transformers' own path, untouched
    assert plain.logits.shape == (2, 21, 97)


def _float64_reference(family: str, batch: dict, tie: bool, lora: bool):
    """Loss and gradients of the full sequence in float64 (sdpa, one process, loss by hand)."""
    model = tiny_model(family, "sdpa", torch.float64, tie_word_embeddings=tie)
    if lora:
        model = _lora(model)
    logits = model(input_ids=batch["input_ids"]).logits
    labels = torch.cat((batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)), dim=1)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, cfg)


def chunked_model_errors(cases: list[dict]) -> list[dict]:
    """On every rank of a CP group of the whole world: ring + chunked loss, vs float64."""
    out = []
    for c in cases:
        batch = tiny_batch(2, 37, seed=c.get("seed", 1))
        ref_loss, ref_grads = _float64_reference(c["family"], batch, c["tie"], c["lora"])
        model = tiny_model(c["family"], "ring", torch.float32, tie_word_embeddings=c["tie"])
        if c["lora"]:
            model = _lora(model)
        if c["ckpt"]:
            hf_ring.enable_activation_checkpointing(model)
            if c["lora"]:
                model.enable_input_require_grads()
        hf_ring.enable_chunked_loss(model, chunk_size=c["chunk"])
        if c["ddp"]:
            model = torch.nn.parallel.DistributedDataParallel(model)
        model.train()
        res = model(**hf_ring.shard_batch(batch))
        res.loss.backward()
        errs = {"loss": rel_err(res.loss, ref_loss), "logits_positions": res.logits.shape[1]}
        inner = model.module if c["ddp"] else model
        for name, p in inner.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.double()
            if not c["ddp"]:  # DDP averages over the world itself
                dist.all_reduce(g)
                g /= dist.get_world_size()
            errs[name] = rel_err(g, ref_grads[name])
        assert len(errs) - 2 == len(ref_grads), (sorted(errs), sorted(ref_grads))
        out.append(errs)
    return out


CASES = [
    dict(family="llama", tie=False, lora=False, ckpt=False, ddp=False, chunk=5),
    dict(family="qwen2", tie=True, lora=False, ckpt=False, ddp=False, chunk=None),
    dict(family="llama", tie=False, lora=True, ckpt=True, ddp=False, chunk=8),
    dict(family="qwen3", tie=False, lora=False, ckpt=True, ddp=True, chunk=3),
]


def test_chunked_loss_with_cp2_matches_float64_full_logits():
    per_rank = run_ranks(2, chunked_model_errors, CASES)
    for rank, results in enumerate(per_rank):
        for case, errs in zip(CASES, results):
            assert errs.pop("logits_positions") == 0, "the chunked path must not compute logits"
            for name, e in errs.items():
                assert e <= 1e-5, f"rank {rank} {case}: {name} rel err {e:.2e}"


# --- memory -------------------------------------------------------------------------------------------


def _step_peak(chunked: bool, n: int, vocab: int) -> tuple[float, int]:
    model = tiny_model("llama", "ring", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    if chunked:
        hf_ring.enable_chunked_loss(model, chunk_size=128)
    batch = tiny_batch(1, n, vocab=vocab)
    kwargs = hf_ring.shard_batch(batch)
    with LiveTensorBytes() as mem:
        out = model(**kwargs)
        out.loss.backward()
        del out
    return mem.peak, sum(p.numel() * 4 for p in model.parameters())


def test_large_vocabulary_step_stays_far_below_full_logits():
    n, vocab = 2048, 50_000
    logits_bytes = n * vocab * 4  # one float32 copy of the full logits: 410 MB
    peak, param_bytes = _step_peak(True, n, vocab)
    # what remains: the embedding and head gradients (2 x 6.4 MB), one 128-token chunk of logits and
    # its gradient (2 x 25.6 MB), and small per-token activations
    assert peak < 0.25 * logits_bytes, f"peak {peak / 1e6:.0f} MB vs full logits {logits_bytes / 1e6:.0f} MB"
    assert peak < 2 * param_bytes + 3 * 128 * vocab * 4 + 4 * 2**20
    full_peak, _ = _step_peak(False, n // 4, vocab)  # the full path needs >= 2 logits copies
    assert full_peak > 2 * (n // 4) * vocab * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_head_gradient_accumulates_in_float32_in_blocks(dtype: torch.dtype) -> None:
    """``_add_product``: ``acc += a @ b`` in float32, in blocks of rows when the operands are 16-bit
    (here 7 rows a block), equal to the whole product rounded as the GEMM rounds it."""
    from hf_ring.ops.cross_entropy import _add_product

    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 9, generator=g).to(dtype).t()  # [9, 40] strided, as dlogits.t()
    b = torch.randn(40, 6, generator=g).to(dtype)
    acc = torch.randn(9, 6, generator=g)
    want = acc + (a @ b).float()
    _add_product(acc, a, b, budget=7 * 6 * (a.element_size() + 4))
    assert (acc - want).abs().max() <= 1e-6 * want.abs().max()


def test_bf16_head_gradient_has_no_vocab_by_hidden_temporaries(monkeypatch) -> None:
    """The backward of a bf16 head holds the float32 head gradient and blocks of at most
    ``PRODUCT_BLOCK_BYTES`` of the per-chunk product: no ``[V, H]`` bf16 product, no float32 copy of it."""
    import hf_ring.ops.cross_entropy as ce

    vocab, hdim, t, chunk = 8192, 256, 64, 32
    monkeypatch.setattr(ce, "PRODUCT_BLOCK_BYTES", 2**18)  # 256 KiB blocks
    torch.manual_seed(0)
    head = torch.nn.Linear(hdim, vocab, bias=False).to(torch.bfloat16)
    hidden = torch.randn(1, t, hdim, dtype=torch.bfloat16, requires_grad=True)
    loss = chunked_causal_lm_loss(hidden, head, _labels((1, t), vocab), chunk_size=chunk)
    with LiveTensorBytes() as mem:
        loss.backward()
    dw32, dw16, chunk_buffers = vocab * hdim * 4, vocab * hdim * 2, chunk * vocab * (4 + 2)
    assert mem.peak <= dw32 + max(dw16, 2**18 + chunk_buffers) + 2**16, mem.peak
