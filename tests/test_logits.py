"""The chunked loss computes a model's own logits: what a model does between its LM head and its logits
(soft-caps, multipliers, scales, casts) is found by probing its forward once
(``hf_ring.transformers.logits``, over the recorder of ``hf_ring.ops.tail``) and applied to every
chunk; what the probe cannot reproduce chunk by chunk is refused, naming the switch that turns the
chunked loss off. RecurrentGemma, Gemma 2, Falcon-H1, Cohere and Granite, with settings that change
the loss, at CP = 2: loss and every gradient equal to the one-process full-logits path (also with
LoRA on the head added after the chunked loss, and with DDP); ``hf-ring eval ppl`` too."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM

import hf_ring
from hf_ring.ops.cross_entropy import chunked_causal_lm_loss
from hf_ring.ops.tail import Recorder
from hf_ring.transformers.logits import logits_transform
from hf_ring.transformers.loss import CHUNKED
from hf_ring.transformers.patches import decoder
from hf_ring.transformers.support import RingNotSupported
from testkit.families import causal_lm_class, tiny_config
from testkit.models import tiny_batch
from testkit.models import tiny_config as llama_config
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

# family -> (settings under which its logits transform changes the loss, the same settings neutral)
TRANSFORMS = {
    "recurrent_gemma": ({"logits_soft_cap": 3.0}, {"logits_soft_cap": 1e9}),
    "gemma2": ({"final_logit_softcapping": 3.0}, {"final_logit_softcapping": None}),
    "falcon_h1": ({"lm_head_multiplier": 4.0}, {"lm_head_multiplier": 1.0}),
    "cohere": ({"logit_scale": 4.0}, {"logit_scale": 1.0}),
    "granite": ({"logits_scaling": 0.25}, {"logits_scaling": 1.0}),
}
STEPS = {
    "recurrent_gemma": ["div(3.0)", "tanh", "mul(3.0)"],
    "gemma2": ["div(3.0)", "tanh", "mul(3.0)"],
    "falcon_h1": ["mul(4.0)"],
    "cohere": ["mul(4.0)"],
    "granite": ["div(0.25)"],
}


# --- the recorder ---------------------------------------------------------------------------------


def test_replay_runs_the_recorded_calls_on_other_shapes() -> None:
    z = torch.randn(2, 3, 11, dtype=torch.float64)
    bias = torch.randn(11, dtype=torch.float64)
    with Recorder(z) as rec:
        capped = torch.tanh(z / 7.0) * 7.0
        _ = z.sum()  # not on the way to the result: left out
        out = (capped + bias).float()
        out.mul_(2.0)
    replay = rec.replay(out)
    assert replay.steps == ["div(7.0)", "tanh", "mul(7.0)", "add(tensor[11])", "float", "mul_(2.0)"], replay
    x = torch.randn(5, 11, dtype=torch.float64)
    kept = x.clone()
    assert torch.equal(replay(x), ((torch.tanh(x / 7.0) * 7.0 + bias).float() * 2.0))
    assert torch.equal(x, kept)  # an in-place call works on a copy
    assert rec.replay(z) is None
    with pytest.raises(LookupError):
        rec.replay(torch.ones(1))


# --- the op -----------------------------------------------------------------------------------------


class Wrapped(nn.Module):
    """A head that is not an nn.Linear (the checkpointed path)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.inner = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _softcap(z: torch.Tensor) -> torch.Tensor:
    return torch.tanh(z * 4.0 / 2.0) * 2.0


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("chunk", [1, 6, None])
def test_chunked_loss_applies_the_transform_like_full_logits(fused: bool, chunk: int | None) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(16, 53, bias=True)
    head = linear if fused else Wrapped(linear)
    hidden = torch.randn(2, 23, 16, requires_grad=True)
    labels = torch.randint(0, 53, (2, 23))
    labels[:, :4] = -100
    h64 = hidden.detach().double().requires_grad_()
    w64, b64 = (t.detach().double().requires_grad_() for t in (linear.weight, linear.bias))
    want = F.cross_entropy(_softcap(F.linear(h64, w64, b64)).flatten(0, 1), labels.flatten(), ignore_index=-100)
    want.backward()
    loss = chunked_causal_lm_loss(hidden, head, labels, chunk_size=chunk, logits_transform=_softcap)
    loss.backward()
    plain = chunked_causal_lm_loss(hidden.detach(), head, labels, chunk_size=chunk)
    assert abs(plain.item() - want.item()) > 1e-2  # the transform matters here
    pairs = [(loss, want), (hidden.grad, h64.grad), (linear.weight.grad, w64.grad), (linear.bias.grad, b64.grad)]
    for got, ref in pairs:
        assert rel_err(got, ref) < 1e-6, (got, ref)


# --- the probe ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(TRANSFORMS))
def test_probe_finds_each_family_transform(family: str) -> None:
    settings, _ = TRANSFORMS[family]
    model = causal_lm_class(family)._from_config(tiny_config(family, **settings))
    replay = logits_transform(model, decoder(model, "test"), "test")
    assert replay is not None and replay.steps == STEPS[family], replay
    plain = causal_lm_class("llama")._from_config(tiny_config("llama"))
    assert logits_transform(plain, decoder(plain, "test"), "test") is None


class MixesPositions(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits - out.logits.mean(dim=1, keepdim=True)
        return out


class WithoutItsHead(LlamaForCausalLM):
    def forward(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return super().forward(input_ids=input_ids, **kwargs).__class__(logits=F.linear(hidden, self.lm_head.weight))


class TrainsOtherLogits(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0 if self.training else out.logits
        return out


class LearnsItsScale(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.scale
        return out


@pytest.mark.parametrize(
    ("cls", "message"),
    [(MixesPositions, "mixes positions"), (WithoutItsHead, "does not compute its logits from its output embedding"),
     (TrainsOtherLogits, "one way in training"), (LearnsItsScale, "trainable")],
)  # fmt: skip
def test_probe_refuses_what_it_cannot_reproduce(cls: type, message: str) -> None:
    model = cls(llama_config("llama"))
    with pytest.raises(RingNotSupported, match=message) as e:
        hf_ring.enable_chunked_loss(model)
    assert type(model).__name__ in str(e.value) and "chunked_loss=False" in str(e.value)
    model.train()
    assert model.training and model.model.training  # the probe leaves the modes as they were


def test_training_arguments_probe_the_model(tmp_path) -> None:
    from hf_ring.trainer.arguments import RingTrainingArguments, apply_model_options

    args = RingTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.chunked_loss  # on by default
    with pytest.raises(RingNotSupported, match="chunked_loss=False"):
        apply_model_options(MixesPositions(llama_config("llama")), args)
    args.chunked_loss = False
    apply_model_options(MixesPositions(llama_config("llama")), args)
    args.chunked_loss = True
    model = apply_model_options(causal_lm_class("gemma2")._from_config(tiny_config("gemma2")), args)
    assert CHUNKED[model].transform is not None


def test_eval_ppl_applies_the_model_transform() -> None:
    from hf_ring.evaluation import position_nll

    torch.manual_seed(0)
    settings, _ = TRANSFORMS["gemma2"]
    model = causal_lm_class("gemma2")._from_config(tiny_config("gemma2", **settings), attn_implementation="ring")
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    got = position_nll(model, ids, bucket_size=10, chunk_size=7)
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
    nll = (logits[:-1].logsumexp(-1) - logits[:-1].gather(1, ids[1:, None]).squeeze(1)).view(-1)
    want = torch.stack([torch.zeros(4, dtype=torch.float64).index_add_(0, torch.arange(1, 40) // 10, nll),
                        torch.bincount(torch.arange(1, 40) // 10, minlength=4).double()])  # fmt: skip
    assert torch.allclose(got, want, rtol=1e-5), (got, want)


# --- inside models at CP = 2 ------------------------------------------------------------------------


def transformed_errors(family: str, lora: bool, ddp: bool) -> dict:
    """On every rank: the ring step with the chunked loss against the one-process full-logits step."""
    settings, neutral = TRANSFORMS[family]

    def build(attn: str, **fields) -> nn.Module:
        torch.manual_seed(0)
        cls, config = causal_lm_class(family), tiny_config(family, **fields)
        try:
            return cls._from_config(config, attn_implementation=attn)
        except ValueError:  # no sdpa with soft-capped attention (Gemma 2): eager
            return cls._from_config(tiny_config(family, **fields), attn_implementation="eager")

    ref, ring = build("sdpa", **settings), build("ring", **settings)
    ring.load_state_dict(ref.state_dict())
    hf_ring.enable_chunked_loss(ring, chunk_size=7)  # before LoRA wraps the head: the hook follows it
    if lora:
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
        torch.manual_seed(5)
        ref = get_peft_model(ref, cfg)
        torch.manual_seed(5)
        ring = get_peft_model(ring, cfg)
    if ddp:
        ring = nn.parallel.DistributedDataParallel(ring)
    ref.train(), ring.train()
    batch = tiny_batch(2, 37, vocab=tiny_config(family).get_text_config().vocab_size)
    want = ref(**batch, use_cache=False).loss
    want.backward()
    out = ring(**hf_ring.shard_batch(batch))
    out.loss.backward()
    errors = {"loss": rel_err(out.loss, want), "positions": out.logits.shape[1]}
    inner = ring.module if ddp else ring
    for (name, p), q in zip(inner.named_parameters(), ref.parameters()):
        if q.grad is None:
            continue
        g = p.grad.double()
        if not ddp:  # DDP averages over the world itself
            dist.all_reduce(g)
            g /= dist.get_world_size()
        errors[name] = rel_err(g, q.grad)
    plain = build("sdpa", **neutral)
    plain.load_state_dict({k: v for k, v in build("sdpa", **settings).state_dict().items()})
    with torch.no_grad():
        base = plain.train()(**batch, use_cache=False).loss.item()
    errors["effect"] = abs(base - want.item()) / want.item()
    return errors


@pytest.mark.parametrize(("family", "lora", "ddp"), [
    ("recurrent_gemma", False, False), ("recurrent_gemma", True, False), ("gemma2", False, False),
    ("falcon_h1", False, False), ("falcon_h1", False, True), ("cohere", False, False), ("granite", False, False),
])  # fmt: skip
def test_chunked_loss_of_transformed_logits_is_exact_at_cp2(family: str, lora: bool, ddp: bool) -> None:
    for errors in run_ranks(2, transformed_errors, family, lora, ddp):
        assert errors.pop("positions") == 0, "the chunked path must not compute logits"
        assert errors.pop("effect") > 1e-3, "the transform must change this loss"
        worst = max(errors.items(), key=lambda kv: kv[1] if math.isfinite(kv[1]) else math.inf)
        assert worst[1] <= 1e-5, worst
