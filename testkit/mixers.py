"""Layouts and float64 oracles shared by the token-mixer tests: batches of one sequence per row and of
packed documents (1, 2 and more tokens, crossing chunk and rank boundaries), laid out over P ranks
exactly as ``shard_batch`` lays them out, and helpers to cut a full tensor into a rank's rows."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from hf_ring.ops.layout import ShardLayout, sequence_layout
from hf_ring.transformers.batch import _packed_layout

# Document lengths of one packed row; each layout kind has two batch rows (the second: long_and_short).
DOCS = {
    "short_ones": [1, 2, 1, 3, 1, 1, 2, 5, 8],  # 24 tokens
    "long_and_short": [2, 17, 1, 4],  # 24 tokens
    "odd": [1, 13, 2, 7],  # 23 tokens: not a multiple of 2P
}
KINDS = ("sequence", *DOCS)


def starts_of(lengths: list[int]) -> list[int]:
    out, s = [], 0
    for n in lengths:
        out.append(s)
        s += n
    return out


def make_layout(kind: str, size: int, ulysses: int = 1) -> tuple[ShardLayout, int]:
    """The layout of a 2-row batch of ``kind`` over ``size`` ranks, and its batch size. ``sequence``:
    one sequence of 24 tokens per row (zigzag); the others: packed rows (``DOCS[kind]`` and
    ``long_and_short``; ``odd`` has 23 tokens per row, ``[1, 13, 2, 7]`` and ``[23]``)."""
    if kind == "sequence":
        return sequence_layout(24, size // ulysses, ulysses), 2
    second = [23] if kind == "odd" else DOCS["long_and_short"]
    n = sum(DOCS[kind])
    return _packed_layout([starts_of(DOCS[kind]), starts_of(second)], n, size, ulysses)[0], 2


def documents(layout: ShardLayout, row: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of every document of batch row ``row`` (one sequence: the whole row)."""
    starts = list(layout.starts[row if len(layout.starts) > 1 else 0])
    return list(zip(starts, [*starts[1:], layout.n]))


def each_document_alone(
    fn: Callable[[list[Tensor], list[Tensor]], Tensor],
    xs: list[Tensor],
    w: Tensor,
    layout: ShardLayout,
    dtype: torch.dtype,
    params: list[Tensor] | None = None,
    params_dtype: torch.dtype | None = None,
    dim: int = 1,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """The token mixers' oracle: ``fn`` over every document of every batch row alone (from a zero
    state), on ``xs`` and ``params`` cast to ``dtype`` (``params_dtype``), and the gradients of
    ``sum(out * w)``. ``fn(parts, params)``: one document's output ``[1, L, ...]`` (``L`` along ``dim``)
    from its rows ``parts`` of ``xs`` (``[B, N, ...]`` along ``dim``). Returns the output ``[B, N, ...]``
    and the gradients of ``xs`` and ``params``, in float64."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in xs]
    pleaves = [t.detach().to(params_dtype or dtype).clone().requires_grad_() for t in params or []]
    out = torch.zeros_like(w)
    for row in range(w.shape[0]):
        for lo, hi in documents(layout, row):
            rows = (slice(row, row + 1), *[slice(None)] * (dim - 1), slice(lo, hi))
            out[rows] = fn([t[rows] for t in leaves], pleaves).to(dtype).double()
    (out * w).sum().backward()
    return out.detach(), [t.grad.double() for t in leaves], [t.grad.double() for t in pleaves]


def local_rows(full: Tensor, layout: ShardLayout, rank: int, dim: int = 1) -> Tensor:
    """``full`` (``[B, n, ...]`` along ``dim``) -> this rank's rows ``[B, S_local, ...]`` (zeros for padding rows)."""
    b = full.shape[0]
    index = layout.index(b)[rank].to(full.device)  # [B, S_local], n for padding
    moved = full.movedim(dim, 1)
    padded = torch.cat((moved, moved.new_zeros((b, 1, *moved.shape[2:]))), dim=1)
    idx = index.view(b, -1, *([1] * (moved.dim() - 2))).expand(b, index.shape[1], *moved.shape[2:])
    return padded.gather(1, idx).movedim(1, dim)


def real_rows(layout: ShardLayout, rank: int, batch: int) -> Tensor:
    """``[B, S_local]`` bool: the local rows that hold a token (not padding)."""
    return layout.index(batch)[rank] < layout.n


def mixer_errors(
    out: Tensor,
    want: Tensor,
    w: Tensor,
    layout: ShardLayout,
    rank: int,
    batch: int,
    inputs: list[tuple[str, Tensor, Tensor]],
    params: list[tuple[str, Tensor, Tensor]] | None = None,
    one_process: tuple[Tensor, list[Tensor]] | None = None,
) -> dict:
    """This rank's errors against a whole-sequence oracle, after ``backward`` of ``<out, w>``.

    ``out [B, S_local, ...]``: this rank's output; ``want``, ``w [B, N, ...]``: the oracle's output
    and the weights of the scalar loss; ``inputs``: (name, local leaf ``[B, S_local, ...]``, oracle
    gradient ``[B, N, ...]``); ``params``: (name, leaf, oracle gradient), their gradients summed over
    the CP group first. Padding rows are left out. ``one_process``: one process's output and
    gradients (``inputs`` then ``params``) in the run's dtype, recorded as ``one_process_<name>``
    errors against the oracle. Returns ``{"err": {name: max abs error}, "scale": {name: max abs}}``.
    """
    import torch.distributed as dist

    real = real_rows(layout, rank, batch)

    def masked(t: Tensor) -> Tensor:
        return t * real.view(batch, -1, *([1] * (t.dim() - 2)))

    (masked(out.double() * local_rows(w, layout, rank))).sum().backward()
    err = {"out": float(masked(out.double() - local_rows(want, layout, rank)).abs().max())}
    scale = {"out": float(want.abs().max())}
    for name, leaf, ref in inputs:
        err[name] = float(masked(leaf.grad.double() - local_rows(ref, layout, rank)).abs().max())
        scale[name] = float(ref.abs().max())
    params = params or []
    for name, leaf, ref in params:
        mine = leaf.grad.double().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(mine)
        err[name] = float((mine - ref).abs().max())
        scale[name] = float(ref.abs().max())
    if one_process is not None:
        base_out, base_grads = one_process
        err["one_process_out"] = float((base_out - want).abs().max())
        for (name, _, ref), g1 in zip([*inputs, *params], base_grads):
            err[f"one_process_{name}"] = float((g1 - ref).abs().max())
    return {"err": err, "scale": scale}


def assert_within_twice_one_process(result: dict, names: tuple[str, ...]) -> None:
    """Each error of ``result`` (from ``mixer_errors``) within 2x one process's in the same dtype."""
    for name in names:
        err, base, scale = result["err"][name], result["err"][f"one_process_{name}"], result["scale"][name]
        assert err <= 2 * base + 1e-3 * scale, (name, result)


def delta_rule_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule token by token, in the inputs' dtype (float64 for the oracle), with the
    signature of transformers' ``torch_chunk_gated_delta_rule`` (``chunk_size`` ignored).

    ``query``/``key [B, L, Hk, Dk]``, ``value [B, L, Hv, Dv]``, ``g`` (log decay) ``[B, L, Hv]`` or
    per channel ``[B, L, Hv, Dk]`` (KDA), ``beta [B, L, Hv]``, ``initial_state [B, Hv, Dk, Dv]``.
    Per token: ``S <- diag(exp g) S``, ``S <- S + beta k (v - S^T k)^T``, ``o = S^T q / sqrt(Dk)``."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (query, key, value, g, beta))
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    b, n, h, dk = q.shape
    s = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(n):
        decay = g[:, t].exp()
        s = s * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    out = torch.stack(outs, 1) if outs else v.new_zeros(b, 0, h, v.shape[-1])
    return out.to(query.dtype), (s if output_final_state else None)


def ssd_reference(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int = 64,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **_: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba2's SSD scan token by token, in float32 or the inputs' wider dtype (float64 for the
    oracle), with the signature of transformers' ``mamba2_chunk_scan`` (``chunk_size`` ignored).

    ``hidden_states [B, L, H, P]``, ``dt [B, L, H]``, ``A [H]``, ``B``/``C [B, L, G, N]``, ``D [H]``,
    ``initial_states [B, H, P, N]``. Per token: ``dt = clamp(softplus(dt + dt_bias))``,
    ``S <- exp(dt A) S + dt x B^T``, ``y = S C + D x``."""
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    x, dt, b_, c_ = (t.to(dtype) for t in (hidden_states, dt, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    h = x.shape[2]
    b_ = b_.repeat_interleave(h // b_.shape[2], dim=2)
    c_ = c_.repeat_interleave(h // c_.shape[2], dim=2)
    batch, n = x.shape[:2]
    s = x.new_zeros(batch, h, x.shape[3], b_.shape[3]) if initial_states is None else initial_states.to(dtype)
    outs = []
    for t in range(n):
        a = torch.exp(dt[:, t] * A.to(dtype))  # [B, H]
        s = s * a[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * b_[:, t, :, None, :]
        outs.append(torch.einsum("bhpn,bhn->bhp", s, c_[:, t]))
    out = torch.stack(outs, 1) if outs else x.new_zeros(batch, 0, h, x.shape[3])
    if D is not None:
        out = out + x * D.to(dtype)[:, None]
    return (out, s) if return_final_states else out


def selective_scan_reference(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **_: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba's selective scan token by token, in float32 or the inputs' wider dtype (float64 for the
    oracle), with the signature of transformers' ``mamba_selective_scan``.

    ``hidden_states``/``dt``/``z [B, D, L]``, ``A [D, N]``, ``B``/``C [B, N, L]``, ``D``/``delta_bias
    [D]``. Per token: ``dt = softplus(dt + delta_bias)``, ``S <- exp(dt A) S + dt x B``,
    ``y = (S . C + D x) silu(z)``."""
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    u, dt, b_, c_ = (t.to(dtype) for t in (hidden_states, dt, B, C))
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[:, None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    a = A.to(dtype)
    s = u.new_zeros(u.shape[0], u.shape[1], a.shape[1])
    outs = []
    for t in range(u.shape[2]):
        s = torch.exp(dt[:, :, t, None] * a) * s + (dt[:, :, t] * u[:, :, t])[..., None] * b_[:, None, :, t]
        outs.append((s * c_[:, None, :, t]).sum(-1))
    out = torch.stack(outs, -1) if outs else u.new_zeros(u.shape)
    if D is not None:
        out = out + u * D.to(dtype)[:, None]
    if z is not None:
        out = out * torch.nn.functional.silu(z.to(dtype))
    return (out, s) if return_last_state else out


# transformers' torch fallbacks that compute in float32 whatever their inputs -> a float64 stand-in
FLOAT64_KERNELS = {
    "torch_chunk_gated_delta_rule": delta_rule_reference,
    "chunk_kimi_delta_attention": delta_rule_reference,
    "mamba2_chunk_scan": ssd_reference,
}


@contextmanager
def float64_kernels() -> Iterator[None]:
    """Within: every routed modeling module's kernel named in ``FLOAT64_KERNELS`` is the float64
    stand-in, for direct calls and under hf_ring's dispatcher alike (a float64 check that rounds
    to float32 inside the kernel cannot tell the ring from rounding)."""
    from hf_ring.transformers import install, mixers

    saved = []
    for short, family in mixers.MIXER_FAMILIES.items():
        try:
            module = importlib.import_module("transformers.models." + short)
        except ImportError:
            continue
        install.install_module(module)  # what is restored on the way out: hf_ring's dispatchers
        for name, route in family.functions.items():
            if name in FLOAT64_KERNELS and hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                stand_in = mixers.MIXER_ROUTES[route](FLOAT64_KERNELS[name])
                stand_in.hf_ring_original = FLOAT64_KERNELS[name]  # type: ignore[attr-defined]
                setattr(module, name, stand_in)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


class _WidenedCasts(TorchFunctionMode):
    """``x.float()`` / ``x.to(torch.float32)`` of a float64 ``x`` return ``x`` (see ``widened_casts``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func in (Tensor.float, Tensor.to) and isinstance(x, Tensor) and x.dtype == torch.float64:
            wanted = [a for a in (*args[1:], kwargs.get("dtype")) if isinstance(a, torch.dtype)]
            device = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
            if (func is Tensor.float or wanted == [torch.float32]) and not device:
                return x
        return func(*args, **kwargs)


@contextmanager
def widened_casts() -> Iterator[None]:
    """Within: a float32 cast of a float64 tensor leaves it float64 (``.float()``, ``.to(torch.float32)``).

    transformers' Gated DeltaNet kernels and gated RMSNorm (Qwen3.5, Qwen3-Next, OLMo-Hybrid, Kimi
    Linear, ...) cast to float32 whatever their input: in a float64 check, the decay parameters'
    (``A_log``, ``dt_bias``) gradients then carry ~1e-4 of cancellation error in one process already,
    which hides what the ring adds. For the test harness only (a ``TorchFunctionMode`` of this thread)."""
    with _WidenedCasts():
        yield


def judged_in_float64(model_type: str) -> bool:
    """The family's routed mixers include a gated delta rule (``testkit.sweep`` judges it in float64,
    casts widened: ``widened_casts``)."""
    from hf_ring.transformers.mixers import MIXER_FAMILIES

    from .families import causal_lm_class

    cls = causal_lm_class(model_type)
    family = MIXER_FAMILIES.get(cls.__module__.removeprefix("transformers.models.")) if cls is not None else None
    return family is not None and "delta" in family.functions.values()


def hybrid(model_type: str) -> bool:
    """The family's causal LM has token mixers that hf_ring routes (``hf_ring.transformers.mixers``)."""
    from hf_ring.transformers.mixers import routed_classes

    from .families import causal_lm_class

    cls = causal_lm_class(model_type)
    return cls is not None and bool(routed_classes(cls.__module__))
