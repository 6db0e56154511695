"""The stand-ins of the mixer kernels do what the libraries do (``docs/standins.md``, "Token-mixer
kernels"): their checks, defaults, dtypes and which gradients flow -- mamba-ssm's selective scan drops
its last state's gradient, the SSD scan, fla's rules and causal-conv1d differentiate their final
states, fla's recurrent rule has no backward -- each against the float64 references."""

from __future__ import annotations

import pytest
import torch

from testkit import mamba_standins as mamba
from testkit import mixer_standins as fla_conv
from testkit.mixers import delta_rule_reference, ssd_reference

G = torch.Generator().manual_seed(0)


def rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=G) * scale).to(dtype).requires_grad_()


def test_selective_scan_drops_the_last_state_gradient() -> None:
    u, dt, z = (
        rand(2, 4, 9, dtype=torch.bfloat16),
        rand(2, 4, 9, dtype=torch.bfloat16),
        rand(2, 4, 9, dtype=torch.bfloat16),
    )
    a = (-torch.rand(4, 3, generator=G) - 0.1).requires_grad_()
    b, c = rand(2, 3, 9, dtype=torch.bfloat16), rand(2, 3, 9, dtype=torch.bfloat16)
    d, bias = rand(4), rand(4)
    out, state = mamba.selective_scan_fn(u, dt, a, b, c, D=d, z=z, delta_bias=bias, delta_softplus=True,
                                         return_last_state=True)  # fmt: skip
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32 and state.requires_grad
    grads = torch.autograd.grad(state.sum(), (u, dt, a, b, bias), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)  # the state's gradient never reaches the inputs
    with pytest.raises(AssertionError, match="float32"):
        mamba.selective_scan_fn(u, dt, a, b, c, D=d.double())
    with pytest.raises(AssertionError, match="u must be"):
        mamba.selective_scan_fn(u.double(), dt.double(), a, b.double(), c.double())


def test_ssd_scan_final_states_seq_idx_and_clamp() -> None:
    x, dt, b, c = rand(1, 10, 2, 3), rand(1, 10, 2), rand(1, 10, 1, 4), rand(1, 10, 1, 4)
    a, bias = (-torch.rand(2, generator=G) - 0.5).requires_grad_(), rand(2)
    h0 = rand(1, 2, 3, 4)
    kw = {"dt_bias": bias, "dt_softplus": True, "dt_limit": (0.2, 0.9)}
    out, state = mamba.mamba_chunk_scan_combined(x, dt, a, b, c, 4, initial_states=h0, return_final_states=True, **kw)
    ref, ref_state = ssd_reference(x, dt, a, b, c, initial_states=h0, return_final_states=True, **kw)
    assert state.dtype == torch.float32 and (out - ref).abs().max() < 1e-6 and (state - ref_state).abs().max() < 1e-6
    grads = torch.autograd.grad(state.sum(), (x, dt, a, bias, h0))  # differentiable, clamp included
    want = torch.autograd.grad(ref_state.sum(), (x, dt, a, bias, h0))
    assert all((g - w).abs().max() < 1e-5 for g, w in zip(grads, want))
    # seq_idx: the state restarts where it changes; the initial state reaches the tokens of sequence 0
    seq = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]], dtype=torch.int32)
    out, state = mamba.mamba_chunk_scan_combined(x, dt, a, b, c, 4, initial_states=h0, seq_idx=seq,
                                                 return_final_states=True, **kw)  # fmt: skip
    for lo, hi in ((0, 3), (3, 7), (7, 10)):
        part = ssd_reference(x[:, lo:hi], dt[:, lo:hi], a, b[:, lo:hi], c[:, lo:hi], return_final_states=True,
                             initial_states=h0 if lo == 0 else None, **kw)  # fmt: skip
        assert (out[:, lo:hi] - part[0]).abs().max() < 1e-6
    assert (state - part[1]).abs().max() < 1e-6


def test_causal_conv1d_rules() -> None:
    x, w, bias = rand(2, 8, 11), rand(8, 4), rand(8)
    with pytest.raises(NotImplementedError):
        fla_conv.causal_conv1d_fn(x, w, bias, activation="relu")
    with pytest.raises(AssertionError, match="width between 2 and 4"):
        fla_conv.causal_conv1d_fn(x, rand(8, 5), bias)
    with pytest.raises(AssertionError, match="divisible by 8"):  # channel-last needs dim % 8 == 0
        fla_conv.causal_conv1d_fn(rand(2, 11, 6).transpose(1, 2), rand(6, 4))
    last = x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # channel-last
    out = fla_conv.causal_conv1d_fn(last, w, bias, activation="silu")
    # initial states + final states: two halves equal the whole, gradients through the passed states
    first, states = fla_conv.causal_conv1d_fn(last[..., :5], w, bias, return_final_states=True, activation="silu")
    second = fla_conv.causal_conv1d_fn(last[..., 5:], w, bias, initial_states=states, activation="silu")
    assert states.dtype == x.dtype and (torch.cat((first, second), -1) - out).abs().max() < 1e-6
    g1 = torch.autograd.grad(out.square().sum(), (last, w, bias))
    g2 = torch.autograd.grad(torch.cat((first, second), -1).square().sum(), (last, w, bias))
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(g1, g2))
    seq = torch.tensor([[0] * 4 + [1] * 7, [0] * 11], dtype=torch.int32)
    cut = fla_conv.causal_conv1d_fn(last, w, bias, seq_idx=seq)
    alone = fla_conv.causal_conv1d_fn(last[:1, :, 4:], w, bias)
    assert (cut[:1, :, 4:] - alone).abs().max() < 1e-6


def test_fla_rules() -> None:
    q, k = rand(1, 7, 2, 4), rand(1, 7, 2, 4)
    v, g, beta = rand(1, 7, 4, 3), rand(1, 7, 4, scale=0.1), torch.rand(1, 7, 4, generator=G).requires_grad_()
    # float32 is accepted (fla 0.5-0.6 have no such refusal); the final state is float32 and differentiable
    o, state = fla_conv.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_q, ref_k = (t / (t.square().sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k))
    ref_o, ref_state = delta_rule_reference(ref_q, ref_k, v, g, beta, output_final_state=True)
    assert state.dtype == torch.float32 and (o - ref_o).abs().max() < 1e-6
    grads, want = (
        torch.autograd.grad(a.sum() + s.sum(), (q, k, v, g, beta)) for a, s in ((o, state), (ref_o, ref_state))
    )
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(grads, want))
    with pytest.raises(DeprecationWarning):
        fla_conv.chunk_gated_delta_rule(q, k, v, g, beta, head_first=False)
    with pytest.raises(ValueError, match="batch size"):
        two = [t.expand(2, *t.shape[1:]) for t in (q, k, v, g, beta)]
        fla_conv.chunk_gated_delta_rule(*two, cu_seqlens=torch.tensor([0, 7]))
    gk = rand(1, 7, 4, 4, scale=0.1)
    with pytest.raises(AssertionError, match="float32"):
        fla_conv.chunk_kda(q, k, v, gk, beta, initial_state=torch.zeros(1, 4, 4, 3, dtype=torch.bfloat16))
    o, _ = fla_conv.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta)
    with pytest.raises(NotImplementedError):
        o.sum().backward()
