"""CPU stand-ins for mamba-ssm 2.2.2 .. 2.3.2.post1's kernels, as transformers 5.24 calls them:
``selective_scan_fn`` (Jamba, Zamba), ``mamba_chunk_scan_combined`` and the fused
``mamba_split_conv1d_scan_combined`` (Nemotron-H, Bamba, Granite 4 hybrid, Falcon-H1, Zamba2).

Each applies the library's argument checks, dtype rules and gradient behaviour; every rule cites
the library file and the lines at the two ends of the version range (``a / b``: 2.2.2 / 2.3.2.post1;
one number: the same in both). Paths are under ``mamba_ssm/ops/`` unless they start with ``csrc/``.
``docs/standins.md`` lists the rules in one table. Computation is float32 (the kernels accumulate
in float32), through the token-by-token references of ``testkit.mixers``. What a stand-in does not
model (complex ``A``, grouped ``B``/``C`` in the selective scan, varlen states, the fused mixer's
extra MLP part) it refuses, so that no test passes on behaviour nobody checked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .mixer_standins import check, record
from .mixers import selective_scan_reference, ssd_reference

HALF_OR_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


class _DroppedGradient(torch.autograd.Function):
    """``value`` as an output of ``anchor``'s graph whose gradient is never read: what an autograd
    Function does with an output its ``backward(ctx, dout, *args)`` ignores (zero into ``anchor``)."""

    @staticmethod
    def forward(ctx, value, anchor):  # type: ignore[override]
        ctx.like = (anchor.shape, anchor.dtype, anchor.device)
        return value.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        shape, dtype, device = ctx.like
        return None, torch.zeros(shape, dtype=dtype, device=device)


def selective_scan_fn(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """mamba-ssm's ``selective_scan_fn``: u/delta/z ``[B, D, L]``, A ``[D, N]``, B/C ``[B, N, L]``."""
    batch, dim, seqlen = u.shape
    itype = u.dtype
    # csrc/selective_scan/selective_scan.cpp L235-236: u fp32/fp16/bf16; A float32 (complex A: not modelled)
    check(itype in HALF_OR_FLOAT, f"selective_scan: u must be float32, float16 or bfloat16, got {itype}")
    check(A.dtype == torch.float32 and A.shape[0] == dim, f"selective_scan: A must be float32 [D, N], got {A.dtype}")
    # selective_scan.cpp L242-244: delta, and B / C when they vary along the sequence, in u's dtype
    check(delta.dtype == itype and delta.shape == u.shape, f"selective_scan: delta {delta.dtype} {tuple(delta.shape)}")
    check(B.dim() == 3 and C.dim() == 3, "selective_scan stand-in: B and C [B, N, L] only (not grouped, not constant)")
    check(B.dtype == itype and C.dtype == itype, f"selective_scan: B {B.dtype} / C {C.dtype} must be {itype}")
    check(B.shape == (batch, A.shape[1], seqlen) and C.shape == B.shape, f"selective_scan: B {B.shape} C {C.shape}")
    check(A.shape[1] <= 256, "selective_scan only supports state dimension <= 256")  # selective_scan.cpp L262
    # selective_scan.cpp L282, L290: D and delta_bias float32 [D]; L300: z in u's dtype
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        ok = t is None or (t.dtype == torch.float32 and t.shape == (dim,))
        check(ok, f"selective_scan: {name} must be float32 [D]")
    check(z is None or (z.dtype == itype and z.shape == u.shape), "selective_scan: z must be [B, D, L] in u's dtype")
    record("selective_scan_fn", shape=tuple(u.shape), final=return_last_state)
    # the kernel (csrc/selective_scan/selective_scan_fwd_kernel.cuh L158-160): float32, delta + bias,
    # softplus for delta <= 20 (torch's softplus threshold); out = empty_like(delta) / empty_like(z)
    # (selective_scan.cpp L311 / L304): u's dtype
    out, state = selective_scan_reference(
        u.float(), delta.float(), A, B.float(), C.float(), D=D, z=None if z is None else z.float(),
        delta_bias=delta_bias, delta_softplus=delta_softplus, return_last_state=True,
    )  # fmt: skip
    out = out.to(itype)
    if not return_last_state:
        return out
    # selective_scan_interface.py L45 / L49: the last state is a float32 slice of the saved scan
    # states; L55 / L59 ``backward(ctx, dout, *args)`` never reads ``args``: its gradient is dropped
    # (documented at L85 / L109: "the gradient of the last state is not considered in the backward pass")
    return out, _DroppedGradient.apply(state.detach(), out)


def _segments(ids: list[int]) -> list[tuple[int, int]]:
    cuts = [0, *(t for t in range(1, len(ids)) if ids[t] != ids[t - 1]), len(ids)]
    return list(zip(cuts, cuts[1:]))


def mamba_chunk_scan_combined(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """mamba-ssm's ``mamba_chunk_scan_combined``: x ``[B, L, H, P]``, dt ``[B, L, H]``, A ``[H]``,
    B/C ``[B, L, G, N]``, D ``[H]`` or ``[H, P]``, z like x, ``initial_states [B, H, P, N]``,
    ``seq_idx [B, L]`` (non-decreasing)."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    # triton/ssd_combined.py ``_mamba_chunk_scan_combined_fwd`` L284-307 / L346-369: the shape asserts
    check(nheads % ngroups == 0, "nheads must be a multiple of ngroups")
    check(B.shape == (batch, seqlen, ngroups, dstate) and C.shape == B.shape, f"B {B.shape} C {C.shape}")
    check(dt.shape == (batch, seqlen, nheads) and A.shape == (nheads,), f"dt {dt.shape} A {A.shape}")
    check(z is None or z.shape == x.shape, f"z {None if z is None else z.shape} != x {x.shape}")
    check(D is None or D.shape in ((nheads, headdim), (nheads,)), f"D {None if D is None else D.shape}")
    check(seq_idx is None or seq_idx.shape == (batch, seqlen), "seq_idx must be [B, L]")
    if initial_states is not None:
        check(initial_states.shape == (batch, nheads, headdim, dstate), f"initial_states {initial_states.shape}")
    # ssd_combined.py L556 / L618: the backward asserts ``not return_varlen_states`` (not modelled here)
    check(not return_varlen_states and cu_seqlens is None, "the stand-in: no varlen states")
    record("mamba_chunk_scan_combined", shape=tuple(x.shape), h0=initial_states is not None, final=return_final_states)
    out, state = _ssd(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit)
    return (out, state) if return_final_states else out


def _ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    initial_states: Tensor | None,
    seq_idx: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> tuple[Tensor, Tensor]:
    """``mamba_chunk_scan_combined`` after its checks: ``(out, final states)``."""
    batch = x.shape[0]
    # triton/ssd_chunk_state.py ``_chunk_cumsum_fwd_kernel`` L71-74 / L77-80: dt in float32, + dt_bias,
    # softplus (for dt <= 20), then always clamped to dt_limit; the backward (L145-151 / L152-158) zeroes
    # the gradient where the clamp bit -- torch.clamp's rule. Everything in float32 (L671-672 / L724-725).
    f32 = (x.float(), dt.float(), A.float(), B.float(), C.float())
    h0 = None if initial_states is None else initial_states.float()

    def scan(part: slice, rows: slice, state: Tensor | None) -> tuple[Tensor, Tensor]:
        xs, dts, a, bs, cs = (t if t.dim() == 1 else t[rows, part] for t in f32)
        return ssd_reference(xs, dts, a, bs, cs, chunk_size, D=None, dt_bias=dt_bias, initial_states=state,
                             dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True)  # fmt: skip

    if seq_idx is None:
        out, state = scan(slice(None), slice(None), h0)
    else:
        # triton/ssd_state_passing.py L69-77 / L71-79 and ssd_chunk_scan.py L92-107 / L98-113: the state
        # is zeroed where seq_idx changes; the initial state reaches the tokens whose seq_idx is 0
        outs, states = [], []
        for b in range(batch):
            ids = seq_idx[b].tolist()
            state = h0[b : b + 1] if h0 is not None and ids and ids[0] == 0 else None
            pieces = []
            for lo, hi in _segments(ids):
                o, state = scan(slice(lo, hi), slice(b, b + 1), state if lo == 0 else None)
                pieces.append(o)
            outs.append(torch.cat(pieces, 1))
            states.append(state)
        out, state = torch.cat(outs), torch.cat(states)
    if D is not None:
        out = out + f32[0] * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:  # ssd_chunk_scan.py L162-169 / L169-176: out_x keeps the ungated output; out *= silu(z)
        out = out * F.silu(z.float())
    # ssd_chunk_scan.py ``_chunk_scan_fwd`` L1247 / L1276: out in x's dtype; ssd_state_passing.py L206 / L208:
    # final states float32; ssd_combined.py L554-557 / L616-619: the backward reads their gradient (args[0])
    return out.to(x.dtype), state


def mamba_split_conv1d_scan_combined(
    zxbcdt: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    chunk_size: int,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    activation: str = "silu",
    rmsnorm_weight: Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: Tensor | None = None,
    outproj_bias: Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """mamba-ssm's fused Mamba2 mixer after ``in_proj``: split, convolution, scan, gated norm, out_proj."""
    from .mixer_standins import causal_conv1d_fn

    # triton/ssd_combined.py ``MambaSplitConv1dScanCombinedFn.forward`` L761-775 / L822-836
    check(activation in (None, "silu", "swish"), "activation must be None, silu or swish")
    check(D.dim() == 2 or headdim is not None, "headdim must be given when D is [H]")
    nheads = A.shape[0]
    headdim = headdim if D.dim() == 1 else D.shape[1]
    dim = nheads * headdim
    check(nheads % ngroups == 0 and dt_bias.shape == (nheads,) and A.shape == (nheads,), "dt_bias / A must be [H]")
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    check(zxbcdt.shape[-1] == 2 * dim + 2 * ngroups * dstate + nheads, "the stand-in: no extra MLP part in zxbcdt")
    check(seq_idx is None, "the stand-in: no seq_idx")
    check(rmsnorm_weight is not None and not norm_before_gate, "the stand-in: the gated norm after the gate")
    record("mamba_split_conv1d_scan_combined", shape=tuple(zxbcdt.shape))
    batch, seqlen = zxbcdt.shape[:2]
    z, xbc, dt = zxbcdt.split([dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    # L779-783 / L840-844: the convolution runs channel-last on the split (same checks as causal_conv1d_fn)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, activation=activation).transpose(1, 2)
    x, b, c = xbc.float().split([dim, ngroups * dstate, ngroups * dstate], dim=-1)
    # L789 / L850: dt_softplus=True always, dt_limit clamps; the final states' gradient is read (L838 / L899)
    y, state = _ssd(x.reshape(batch, seqlen, nheads, headdim), dt.float(), A.float(),
                    b.reshape(batch, seqlen, ngroups, dstate), c.reshape(batch, seqlen, ngroups, dstate), chunk_size,
                    D.float(), None, dt_bias.float(), initial_states, None, True, dt_limit)  # fmt: skip
    y = y.reshape(batch, seqlen, ngroups, dim // ngroups) * F.silu(z.float().reshape(batch, seqlen, ngroups, -1))
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + rmsnorm_eps)).reshape(batch, seqlen, dim)
    y = (y * rmsnorm_weight.float()).to(zxbcdt.dtype)
    out = F.linear(y, outproj_weight, outproj_bias) if outproj_weight is not None else y
    return (out, state) if return_final_states else out
