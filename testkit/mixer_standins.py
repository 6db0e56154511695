"""CPU stand-ins for the CUDA kernels of hybrid mixers that transformers 5.24 calls, and the fake
packages that make transformers pick them up: flash-linear-attention (``fla``, 0.5.0 .. 0.6.0:
``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``, ``chunk_kda``) and causal-conv1d
(1.4.0 .. 1.7.0: ``causal_conv1d_fn``) here; mamba-ssm's in ``testkit.mamba_standins``.

Each applies the library's argument preprocessing, defaults, checks, dtype rules and gradient
behaviour; every rule cites the file and the lines at the two ends of the version range (``a / b``:
fla 0.5.0 / 0.6.0 under ``fla/``, causal-conv1d 1.4.0 / 1.7.0; one number: the same in both).
``docs/standins.md`` lists them in one table. They compute in float32 (the kernels accumulate in
float32) through the token-by-token references of ``testkit.mixers``, and refuse what they do not
model. ``fake_packages()`` puts ``fla``, ``causal_conv1d`` and ``mamba_ssm`` modules with them in
``sys.modules``; ``kernel_like_transformers(torch_fn, name, package)`` then wraps a transformers torch
fallback exactly as transformers does at import when the package is installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from .mixers import delta_rule_reference

CALLS: list[tuple[str, dict]] = []  # (kernel, shapes and flags) of every call, for tests to inspect
TRANSFORMERS_KERNELS = {  # transformers' routed name -> (the kernel's name, its package)
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
    "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla"),
    "chunk_kimi_delta_attention": ("chunk_kda", "fla"),
    "mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm"),
    "mamba2_split_conv1d_scan_combined": ("mamba_split_conv1d_scan_combined", "mamba_ssm"),
    "mamba_selective_scan": ("selective_scan_fn", "mamba_ssm"),
}
HALF_OR_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def check(cond: bool, msg: str) -> None:
    """The libraries' ``assert`` / ``TORCH_CHECK`` (both raise; an AssertionError here)."""
    if not cond:
        raise AssertionError(msg)


def record(name: str, **info: object) -> None:
    CALLS.append((name, info))


def _l2norm(x: Tensor) -> Tensor:
    """fla's ``l2norm_fwd`` (``modules/l2norm.py`` L137-148 / ``modules/norm/l2norm.py`` L112-119):
    ``x / sqrt(sum x^2 + 1e-6)`` in float32, stored in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _delta(q, k, v, g, beta, scale, initial_state, l2norm, cu_seqlens) -> tuple[Tensor, Tensor]:
    """The delta rule in float32: ``(o float32, final state float32)``, differentiable in both."""
    if l2norm:  # in the kernel, before anything else (ops/gated_delta_rule/chunk.py L276-278 / L282-284)
        q, k = _l2norm(q), _l2norm(k)
    # the reference scales q by K ** -0.5: fold any other scale into q
    q = q.float() * (scale / q.shape[-1] ** -0.5)
    f32 = [q, k.float(), v.float(), g.float(), beta.float()]
    h0 = None if initial_state is None else initial_state.float()
    if cu_seqlens is None:
        return delta_rule_reference(*f32, initial_state=h0, output_final_state=True)
    outs, states = [], []
    for i, (a, e) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
        o, s = delta_rule_reference(*(x[:, a:e] for x in f32), initial_state=None if h0 is None else h0[i : i + 1],
                                    output_final_state=True)  # fmt: skip
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    cp_context: object | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_gated_delta_rule``: q/k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g (log decay) and
    beta ``[B, T, HV]``, ``initial_state [N, HV, K, V]``. Returns ``(o, final state float32 | None)``."""
    path = "ops/gated_delta_rule/chunk.py"
    # ``chunk_gated_delta_rule`` L453-463 / L521-531: ValueError on head counts
    if q.shape[2] != k.shape[2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"{path}: q/k heads {q.shape[2]}/{k.shape[2]}, value heads {v.shape[2]}")
    if "head_first" in kwargs:  # L465-468 / L533-536
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    # 0.6.0 L538-540 (``chunk_size`` read from **kwargs; transformers' wrapper never passes it)
    check(kwargs.get("chunk_size", 64) in (16, 32, 64), "`chunk_size` must be 16, 32, or 64")
    # no float32 refusal here (``chunk_gated_delta_rule`` L353-515 / L397-593 has none); only
    # ops/delta_rule/chunk.py L290 / L303 and ops/gated_delta_product/chunk.py L300 / L365 keep one [F8]
    not_modelled = use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first or cp_context is not None
    not_modelled = not_modelled or bool(kwargs.get("use_gate_in_kernel"))
    check(not not_modelled, "the stand-in: no in-kernel gate or beta, no CP context, the [K, V] state layout")
    b, t, h, dk = q.shape
    hv = v.shape[2]
    check(k.shape == q.shape and g.shape == (b, t, hv) and beta.shape == (b, t, hv), f"g {g.shape} beta {beta.shape}")
    if cu_seqlens is not None:  # L478-488 / L550-560
        if b != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {b} when using `cu_seqlens`.")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError("The number of initial states is expected to be equal to the number of input sequences")
    n = b if cu_seqlens is None else len(cu_seqlens) - 1
    check(initial_state is None or initial_state.shape == (n, hv, dk, v.shape[-1]), "initial_state [N, HV, K, V]")
    scale = dk**-0.5 if scale is None else scale  # L495-496 / L569-570
    record("chunk_gated_delta_rule", shape=tuple(q.shape), v=tuple(v.shape), h0=initial_state is not None,
           final=output_final_state, varlen=cu_seqlens is not None)  # fmt: skip
    o, state = _delta(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)
    # L309 / L335: ``o.to(q.dtype)``; ops/common/chunk_delta_h.py L692-695 / L720-723: the final state is
    # float32; the backward reads its gradient (``backward(ctx, do, dht)``, L314-317 / L340-343) and gives
    # the initial state's in float32 (chunk_delta_h.py L756 / L795)
    return o.to(q.dtype), (state if output_final_state else None)


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    gv: Tensor | None = None,
    beta: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """fla's ``fused_recurrent_gated_delta_rule`` (transformers: decoding with a cache only). Forward
    only: its backward raises (ops/gated_delta_rule/fused_recurrent.py L304-309 / L301-306)."""
    check(gk is None and gv is None and g is not None and not kwargs, "the stand-in: a scalar gate g only")
    scale = k.shape[-1] ** -0.5 if scale is None else scale  # L423-424 / L441-442
    beta = torch.ones_like(q[..., 0]) if beta is None else beta  # L425-426 / L443-444
    record("fused_recurrent_gated_delta_rule", shape=tuple(q.shape), h0=initial_state is not None)
    o, state = _delta(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)
    # L216 / L210: o = empty_like(v); L219-221 / L213-215: the final state float32
    o, state = _NoBackward.apply(o.to(v.dtype), state)
    return o, (state if output_final_state else None)


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, state):  # type: ignore[override]
        return o.clone(), state.clone()

    @staticmethod
    def backward(ctx, do, dht):  # type: ignore[override]
        raise NotImplementedError("Backward pass is not implemented yet and we do not have plans to implement it")


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_kda`` (the gate precomputed, ``use_gate_in_kernel=False``): g ``[B, T, HV, K]``."""
    check(not use_gate_in_kernel and kwargs.get("cp_context") is None, "the stand-in: the decay precomputed, no CP")
    # ops/kda/chunk.py L337-338 / L465-466: a float32 initial state (made contiguous by ``input_guard``)
    check(initial_state is None or initial_state.dtype == torch.float32, "initial_state must be in float32.")
    check(kwargs.get("chunk_size", 64) in (32, 64), "`chunk_size` must be either 32 or 64 for KDA")  # 0.6.0 L475-476
    b, t, h, dk = q.shape
    hv = v.shape[2]
    # L353-360 / L488-495
    check(q.shape == k.shape, f"q and k must have the same shape, got q={q.shape} vs k={k.shape}")
    check(dk <= 256, f"Currently we only support key headdim <=256 for KDA, got {dk}.")
    check(hv % h == 0, f"For GVA, num_v_heads (HV={hv}) must be evenly divisible by num_qk_heads (H={h})")
    check(g.shape == (b, t, hv, dk) and beta.shape == (b, t, hv), f"g {g.shape} / beta {beta.shape}")
    if initial_state is not None:
        check(initial_state.shape == (b if cu_seqlens is None else len(cu_seqlens) - 1, hv, dk, v.shape[-1]),
              f"initial_state {initial_state.shape}")  # fmt: skip
    scale = dk**-0.5 if scale is None else scale  # L362-363 / L497-498
    record("chunk_kda", shape=tuple(q.shape), h0=initial_state is not None, final=output_final_state)
    o, state = _delta(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)
    # L103 / L158: ``o.type_as(q)``; the final state float32 (ops/kda/chunk_fwd.py: chunk_delta_h), its
    # gradient read by the backward (L108-111 / L163)
    return o.to(q.dtype), (state if output_final_state else None)


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: Tensor | None = None,
    activation: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """causal-conv1d's ``causal_conv1d_fn``: x ``[B, D, L]``, weight ``[D, W]``, bias ``[D]``,
    ``seq_idx [B, L]`` int32, ``initial_states [B, D, W - 1]``. Lines: ``causal_conv1d_interface.py``
    (``I``) and ``csrc/causal_conv1d.cpp`` (``C``)."""
    if activation not in (None, "silu", "swish"):  # I L23-24 / L22-23
        raise NotImplementedError("activation must be None, silu, or swish")
    if x.stride(2) != 1 and x.stride(1) != 1:  # I L25-26 / L24-25
        x = x.contiguous()
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    # C L139-140 / L160-161: x and weight fp32/fp16/bf16 (each its own); C L165 / L186: bias in weight's dtype
    check(x.dtype in HALF_OR_FLOAT and weight.dtype in HALF_OR_FLOAT, f"x {x.dtype} weight {weight.dtype}")
    check(weight.shape == (dim, width), f"weight {tuple(weight.shape)} for x {tuple(x.shape)}")
    check(bias is None or (bias.dtype == weight.dtype and bias.shape == (dim,)), "bias: [D] in weight's dtype")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1  # C L155 / L176
    if channel_last:  # C L157-159 / L178-181
        check(dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        strides = "causal_conv1d with channel last layout requires strides (x.stride(0) and x.stride(2))"
        check(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, strides + " to be multiples of 8")
    check(2 <= width <= 4, "causal_conv1d only supports width between 2 and 4")  # C L161 / L182
    if seq_idx is not None:  # I L28-34 / L27-30; C L172-174 / L193-195
        check(not return_final_states, "If seq_idx is not None, we don't return final_states_out")
        check(channel_last, "seq_idx is only supported for channel last layout")
        check(seq_idx.dtype == torch.int32 and seq_idx.shape == (batch, seqlen), "seq_idx: int32 [B, L]")
        # 1.4.0 I L29-31 asserts ``initial_states is None`` (1.7.0 allows it): refused in the whole range
        check(initial_states is None, "initial_states must be None if seq_idx is not None")
        check(bool((seq_idx >= 0).all()), "the stand-in: no padding tokens (seq_idx < 0)")
    if initial_states is not None:  # C L193-199 / L212-218
        check(channel_last, "initial_states is only supported for channel last layout")
        check(initial_states.dtype == x.dtype and initial_states.shape == (batch, dim, width - 1), "initial_states")
    if return_final_states:  # I L40-43 / L36-39
        check(x.stride(1) == 1, "Only channel-last layout support returning final_states_out")
        check(final_states_out is None, "the stand-in: final states are returned, not written into a buffer")
    record("causal_conv1d_fn", shape=tuple(x.shape), width=width)
    # the kernel (csrc/causal_conv1d_fwd.cu, 1.7.0 L81-123): weights, bias and sums in float32; a row
    # reads only rows of its own seq_idx (L304-331); before row 0: initial_states, else zeros
    pad = x.new_zeros((batch, dim, width - 1)) if initial_states is None else initial_states
    xp = torch.cat((pad, x), -1).float()
    w = weight.float()
    out = torch.zeros((batch, dim, seqlen), dtype=torch.float32, device=x.device)
    for j in range(width):  # tap j reads the row width - 1 - j before
        term = w[:, j, None] * xp[..., j : j + seqlen]
        if seq_idx is not None:
            lag = width - 1 - j
            same = torch.zeros_like(seq_idx, dtype=torch.bool)
            same[:, lag:] = seq_idx[:, lag:] == seq_idx[:, : seqlen - lag]
            term = term * same[:, None, :]
        out = out + term
    if bias is not None:
        out = out + bias.float()[:, None]
    if activation is not None:
        out = F.silu(out)
    out = out.to(x.dtype)  # C L180 / cpp_functions.py L103: ``empty_like(x)``
    if not return_final_states:
        return out
    # I L51-53 / L47-49: the last W - 1 inputs, in x's dtype, channel-last; the backward reads their
    # gradient (I L70 / L66), gives dweight / dbias in float32 cast to weight's dtype (cpp_functions.py
    # L134-159) and the initial states' only when they require it (I L62-64 / L58-60)
    final = torch.cat((pad, x), -1)[..., seqlen:].transpose(1, 2).contiguous().transpose(1, 2)
    return out, final


@contextmanager
def fake_packages() -> Iterator[None]:
    """``fla``, ``causal_conv1d`` and ``mamba_ssm`` in ``sys.modules`` with the stand-ins, while inside."""
    from . import mamba_standins

    fla, conv, mamba = ModuleType("fla"), ModuleType("causal_conv1d"), ModuleType("mamba_ssm")
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_kda):
        setattr(fla, fn.__name__, fn)
    conv.causal_conv1d_fn = causal_conv1d_fn  # type: ignore[attr-defined]
    for name in ("mamba_chunk_scan_combined", "selective_scan_fn", "mamba_split_conv1d_scan_combined"):
        setattr(mamba, name, getattr(mamba_standins, name))
    fakes = {"fla": fla, "causal_conv1d": conv, "mamba_ssm": mamba}
    saved = {name: sys.modules.get(name) for name in fakes}
    sys.modules.update(fakes)
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def torch_function(fn: Callable) -> Callable:
    """transformers' torch function under its decorators: ``functools.wraps`` layers, and the
    ``kernels`` hub wrapper (an ``nn.Module`` named ``Func`` holding the function in its forward's
    closure, ``kernels/_internals/layer/layer.py`` ``_create_func_module``) that transformers >= 5.25
    puts around every ``use_kernel_func_from_hub_with_fallback`` function when ``kernels`` is installed."""
    import inspect

    if isinstance(fn, torch.nn.Module):
        cells = type(fn).forward.__closure__ or ()
        fn = next(c.cell_contents for c in cells if callable(c.cell_contents))
    return inspect.unwrap(fn)


def kernel_like_transformers(torch_fn: Callable, name: str, package: str) -> Callable:
    """``torch_fn`` wrapped by transformers' ``use_kernel_func_from_hub_with_fallback(name, package)``
    while the fake packages are installed: what a modeling module holds on a machine with them. Since
    transformers 5.25 that wrapper sends inputs on devices outside ``_PACKAGE_SUPPORTED_DEVICES``
    (``integrations/hub_kernels.py`` L96-100: CUDA for causal-conv1d and mamba-ssm) to the torch
    function; here the CPU plays the GPU, so it is listed for the package while the wrapper is made
    (the wrapper reads the table once, when it is made)."""
    from transformers.integrations import hub_kernels
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    saved = devices.get(package) if devices is not None else None
    try:
        if devices is not None and saved is not None:
            devices[package] = (*saved, "cpu")
        with fake_packages():
            return use_kernel_func_from_hub_with_fallback(name, package)(torch_fn)
    finally:
        if devices is not None and saved is not None:
            devices[package] = saved


@contextmanager
def routed_kernels(modeling_module: ModuleType, kernels: str) -> Iterator[None]:
    """Within: every function hf_ring routes in ``modeling_module`` calls ``kernels``: ``"standins"``
    (this module's, wrapped as transformers wraps installed packages) or ``"torch"`` (transformers'
    own torch fallbacks, undecorated), behind hf_ring's dispatchers as ``install`` binds them."""

    from hf_ring.transformers import install, mixers

    install.install_module(modeling_module)  # what is restored on the way out: hf_ring's dispatchers
    family = mixers.MIXER_FAMILIES[modeling_module.__name__.removeprefix("transformers.models.")]
    saved = []
    for name, route in family.functions.items():
        if install.original(modeling_module, name) is None or name not in TRANSFORMERS_KERNELS:
            continue  # a kernel this transformers leaves unset, or mamba-ssm's mamba_inner_fn (no stand-in;
            # tests/test_attention_free.py covers its route)
        torch_fn = torch_function(install.original(modeling_module, name))  # transformers' torch fallback
        kernel = torch_fn if kernels == "torch" else kernel_like_transformers(torch_fn, *TRANSFORMERS_KERNELS[name])
        dispatcher = mixers.MIXER_ROUTES[route](kernel)
        dispatcher.hf_ring_original = kernel  # type: ignore[attr-defined]
        saved.append((name, getattr(modeling_module, name)))
        setattr(modeling_module, name, dispatcher)
    try:
        yield
    finally:
        for name, fn in saved:
            setattr(modeling_module, name, fn)
