"""cuDNN attention as torch ships it: the three rules of its releases that decide which blocks the cuDNN kernel
keeps off cuDNN (``docs/standins.md`` rows D10-D12), on the stand-in (``testkit/cudnn_standin.py``) and through
``get_kernel`` against the float64 oracle, on odd shapes (GQA 6 over 2, head dim 36, lengths not multiples of 8)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_ring.ops import kernels as kernels_mod
from hf_ring.ops.kernels import CudnnKernel, get_kernel
from hf_ring.ops.kernels_cudnn import RAGGED_ENV, decode_disabled, lse_nan_backward, ragged_env
from testkit.cudnn_standin import CudnnStandIn
from testkit.oracle import reference, rel_err

CUDA = torch.device("cuda")
OVERFLOW = math.log(torch.finfo(torch.float32).max)  # 88.72


@pytest.fixture
def fresh_kernel_caches():
    """get_kernel's caches emptied before and after."""
    caches = (kernels_mod._kernel, kernels_mod._choose, kernels_mod._capability)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def _through_get_kernel(monkeypatch: pytest.MonkeyPatch, ops: CudnnStandIn) -> CudnnKernel:
    """``get_kernel("cudnn")`` on a GPU of the stand-in's capability whose torch has the stand-in's cuDNN."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: ops.capability)
    monkeypatch.setattr(kernels_mod, "_cudnn", lambda: (CudnnKernel(ops=ops, version=ops.version), ""))
    kernel = get_kernel("cudnn", CUDA, torch.bfloat16)
    assert isinstance(kernel, CudnnKernel)
    return kernel


def _inputs(b: int, sq: int, sk: int, hq: int = 6, hkv: int = 2, d: int = 36, low: tuple[int, ...] = (), seed: int = 0):
    """float32 ``q, k, v, dout``; query rows ``low`` see every key at a scaled score near -100, so their
    log-sum-exp is near ``-100 + ln(sk)``, below ``-ln(FLT_MAX)``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=g) * 0.3 for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    if low:
        scale = d**-0.5
        k[..., 0] = -100.0 / scale
        q[..., 0] = 0.0
        q[:, list(low), :, 0] = 1.0
        q[:, list(low), :, 1:] = 0.0  # score = scale * k[..., 0] = -100 exactly
    return q, k, v, dout


def _check_exact(kernel: CudnnKernel, b: int, sq: int, sk: int, causal: bool, low: tuple[int, ...] = (), **kw) -> None:
    q, k, v, dout = _inputs(b, sq, sk, low=low, **kw)
    scale = q.shape[-1] ** -0.5
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    ref = reference(q, k, v, dout, causal, scale)
    if low:
        assert float(ref[1][:, list(low)].max()) < -OVERFLOW  # the rows the rule is about
    assert rel_err(out, ref[0]) <= 1e-5 and float((lse.double() - ref[1]).abs().max()) <= 1e-4
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert torch.isfinite(g).all(), f"{name} has NaN or inf"
        assert rel_err(g, r) <= 1e-5, f"{name} rel err {rel_err(g, r):.2e}"


# --------------------------------------------------------------------------- D10: NaN dQ below the overflow LSE


def test_standin_backward_nan_rows_on_key_lengths_64_mod_128() -> None:
    """[D10] below cuDNN 9.26 on sm_90, a key length ``64 mod 128`` gives NaN in the dQ rows whose LSE is below
    ``-ln(FLT_MAX)``, and only those (dK, dV, the forward and other rows are right); other key lengths, cuDNN 9.26
    and other GPUs are clean."""
    low = (0, 3, 4)
    for capability, version, sk, nan in [((9, 0), 91900, 192, True), ((9, 0), 92501, 64, True),
                                         ((9, 0), 91002, 320, True), ((9, 0), 91900, 128, False),
                                         ((9, 0), 91900, 200, False), ((9, 0), 92600, 192, False),
                                         ((10, 0), 91900, 192, False)]:  # fmt: skip
        ops = CudnnStandIn(capability, version, allow_fp32=True, avoid_recompile=False)
        q, k, v, dout = (t.transpose(1, 2) for t in _inputs(2, 7, sk, d=32, low=low))
        out, lse4 = ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, scale=32**-0.5)[:2]
        assert torch.isfinite(out).all() and float(lse4[:, :, list(low)].max()) < -OVERFLOW
        dq, dk, dv = ops._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse4, None, None, None, None, None, 7, sk, 0.0, False, scale=32**-0.5
        )
        assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
        rows_nan = torch.isnan(dq).any(-1).any(1).any(0)  # [Sq]
        assert rows_nan.tolist() == [nan and i in low for i in range(7)], (capability, version, sk)


def test_kernel_keeps_backwards_of_those_key_lengths_off_cudnn(
    monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None
) -> None:
    """[D10] through ``get_kernel`` on an H100 with torch 2.11's cuDNN 9.19: a block whose key length is
    ``64 mod 128`` runs its backward on torch's flash op, exactly, even for rows whose LSE is below
    ``-ln(FLT_MAX)`` (plain and causal, GQA, a padded head dim); the forward and other key lengths stay on
    cuDNN; from cuDNN 9.26 the backward does too."""
    ops = CudnnStandIn((9, 0), 91900, allow_fp32=True, avoid_recompile=False)
    kernel = _through_get_kernel(monkeypatch, ops)
    _check_exact(kernel, 2, 37, 192, False, low=(0, 5, 36))
    _check_exact(kernel, 1, 64, 64, True, low=(9, 63))
    assert len(ops.aten.calls["flash_bwd"]) == 2 and "bwd" not in ops.calls and len(ops.calls["fwd"]) == 2
    _check_exact(kernel, 2, 37, 200, False, low=(0, 5, 36))
    assert len(ops.aten.calls["flash_bwd"]) == 2 and len(ops.calls["bwd"]) == 1
    assert lse_nan_backward(91900, (9, 0), 192) and not lse_nan_backward(92600, (9, 0), 192)
    assert lse_nan_backward(91900, None, 64) and not lse_nan_backward(91900, (10, 0), 64)


# --------------------------------------------------------------------------- D11: one query row on Blackwell


def test_standin_refuses_one_query_row_where_torch_does() -> None:
    """[D11] ``check_cudnn_sdpa_decode``: a query of one row raises, forward and backward, on sm_10x/sm_11x with
    cuDNN 9.19 to 9.25.0 except 9.24.1; elsewhere, and for longer queries, it runs."""
    q, k, v, dout = (t.transpose(1, 2) for t in _inputs(2, 1, 29, d=24))
    lse = torch.zeros(2, 6, 1, 1)
    for capability, version, refused in [((10, 0), 91900, True), ((11, 0), 92500, True), ((10, 3), 92400, True),
                                         ((10, 0), 92401, False), ((10, 0), 92501, False), ((10, 0), 91802, False),
                                         ((9, 0), 91900, False), ((12, 0), 92000, False)]:  # fmt: skip
        ops = CudnnStandIn(capability, version, allow_fp32=True, avoid_recompile=False)
        fwd = lambda ops=ops: ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, scale=0.2)  # noqa: E731
        bwd = lambda ops=ops: ops._scaled_dot_product_cudnn_attention_backward(  # noqa: E731
            dout, q, k, v, q, lse, None, None, None, None, None, 1, 29, 0.0, False, scale=0.2
        )
        for call in (fwd, bwd):
            if refused:
                with pytest.raises(RuntimeError, match=r"decode is disabled for cuDNN versions 9\.19-9\.25\.0"):
                    call()
            else:
                call()
    ops = CudnnStandIn((10, 0), 91900, allow_fp32=True, avoid_recompile=False)
    q2, k2, v2, _ = (t.transpose(1, 2) for t in _inputs(2, 2, 29, d=24))
    ops._scaled_dot_product_cudnn_attention(q2, k2, v2, None, True, 0.0, False, scale=0.2)


def test_kernel_runs_one_query_row_blocks_elsewhere_on_blackwell(
    monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None
) -> None:
    """[D11] through ``get_kernel`` on a B200 with cuDNN 9.19: a block of one query row runs on torch's flash op,
    forward and backward, exactly; a block of two rows stays on cuDNN; on an H100 one row stays on cuDNN."""
    ops = CudnnStandIn((10, 0), 91900, allow_fp32=True, avoid_recompile=False)
    kernel = _through_get_kernel(monkeypatch, ops)
    _check_exact(kernel, 2, 1, 29, False, d=24)
    assert len(ops.aten.calls["flash_fwd"]) == 1 and len(ops.aten.calls["flash_bwd"]) == 1 and not ops.calls
    _check_exact(kernel, 2, 2, 29, False, d=24)
    assert len(ops.calls["fwd"]) == 1 and len(ops.calls["bwd"]) == 1
    assert decode_disabled(91900, None) and not decode_disabled(91900, (9, 0)) and not decode_disabled(92401, (10, 0))


def test_one_query_row_stays_on_cudnn_on_hopper(monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None) -> None:
    ops = CudnnStandIn((9, 0), 91900, allow_fp32=True, avoid_recompile=False)
    _check_exact(_through_get_kernel(monkeypatch, ops), 2, 1, 29, False, d=24)
    assert len(ops.calls["fwd"]) == 1 and len(ops.calls["bwd"]) == 1 and not ops.aten.calls


# --------------------------------------------------------------------------- D12: TORCH_CUDNN_SDPA_AVOID_RECOMPILE


def test_standin_ragged_path_lays_stats_out_by_token() -> None:
    """[D12] with the variable set and ``[B, S, H, D]`` memory the forward's stats are ``[B, Sq, H, 1]`` memory
    (seen as ``[B, H, Sq, 1]``), otherwise ``[B, H, Sq, 1]``; the backward reads batch row ``b`` from
    ``b * Sq * stats.stride(-2)``, so the contiguous layout gives batch rows after the first other rows' LSE."""
    ops = CudnnStandIn((9, 0), 91900, allow_fp32=True, avoid_recompile=True)
    q, k, v, dout = _inputs(2, 7, 9, d=40)
    bhsd = [t.transpose(1, 2) for t in (q, k, v)]
    out, lse4 = ops._scaled_dot_product_cudnn_attention(*bhsd, None, True, 0.0, False, scale=0.3)[:2]
    assert lse4.shape == (2, 6, 7, 1) and lse4.stride() == (7 * 6, 1, 6, 1)
    contiguous = [t.contiguous() for t in bhsd]  # [B, H, S, D] memory: not the ragged path
    lse_c = ops._scaled_dot_product_cudnn_attention(*contiguous, None, True, 0.0, False, scale=0.3)[1]
    assert lse_c.stride() == (6 * 7, 7, 1, 1) and torch.equal(lse_c, lse4)
    rest = (None, None, None, None, None, 7, 9, 0.0, False)
    ref = reference(q, k, v, dout, False, 0.3)
    good = ops._scaled_dot_product_cudnn_attention_backward(dout.transpose(1, 2), *bhsd, out, lse4, *rest, scale=0.3)
    bad = ops._scaled_dot_product_cudnn_attention_backward(
        dout.transpose(1, 2), *bhsd, out, lse4.contiguous(), *rest, scale=0.3
    )
    for g, b_, r in zip(good, bad, ref[2:]):
        assert rel_err(g.transpose(1, 2), r) <= 1e-5
        assert rel_err(b_.transpose(1, 2)[:1], r[:1]) <= 1e-5 and rel_err(b_.transpose(1, 2)[1:], r[1:]) > 1e-2


def test_kernel_hands_the_backward_the_stats_layout_torch_reads(
    monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None
) -> None:
    """[D12] with ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` in the environment (torch reads it once; hf_ring reads
    it the same way and never sets it), ``get_kernel("cudnn")`` is exact at ``B > 1``: the backward gets the
    stats as ``[B, Sq, H, 1]`` memory."""
    monkeypatch.setenv(RAGGED_ENV, "1")
    ops = CudnnStandIn((9, 0), 91900, allow_fp32=True)
    assert ops.avoid_recompile
    kernel = _through_get_kernel(monkeypatch, ops)
    _check_exact(kernel, 3, 13, 29, False)
    _check_exact(kernel, 2, 19, 19, True)
    assert ops.calls["bwd"][0]["lse"].stride() == (13 * 6, 1, 6, 1)


def test_kernel_refuses_a_forward_that_took_the_other_path() -> None:
    """[D12] a forward whose stats show torch took the other path than the kernel read (the variable changed
    after torch read it) raises, naming the variable and the fix; one head, or one query row, cannot tell."""
    for standin, read in ((True, False), (False, True)):
        ops = CudnnStandIn((9, 0), 91900, allow_fp32=True, avoid_recompile=standin)
        kernel = CudnnKernel(ops=ops, version=91900, capability=(9, 0), avoid_recompile=read)
        q, k, v, _ = _inputs(2, 13, 29)
        with pytest.raises(RuntimeError, match=f"{RAGGED_ENV} before the first attention call"):
            kernel.forward(q, k, v, causal=False, scale=0.2)
        q1, k1, v1, _ = _inputs(2, 13, 29, hq=1, hkv=1)
        kernel.forward(q1, k1, v1, causal=False, scale=0.2)
    kernel = CudnnKernel(ops=CudnnStandIn(allow_fp32=True, avoid_recompile=True), version=91002, avoid_recompile=True)
    q, k, v, _ = _inputs(2, 13, 29)
    kernel.forward(q[:, ::2], k, v, causal=False, scale=0.2)  # not [B, S, H, D] memory: the dense path, both agree


@pytest.mark.parametrize(("value", "set_"), [("1", True), ("0", False), ("true", False), (None, False)])
def test_the_variable_is_read_as_torch_reads_it(monkeypatch: pytest.MonkeyPatch, value: str | None, set_: bool) -> None:
    """``c10::utils::check_env``: ``"1"`` is true, ``"0"`` false, anything else unset (with a warning)."""
    if value is None:
        monkeypatch.delenv(RAGGED_ENV, raising=False)
    else:
        monkeypatch.setenv(RAGGED_ENV, value)
    assert ragged_env() is set_
    assert CudnnKernel(ops=CudnnStandIn(), version=91002).ragged is set_
    assert CudnnStandIn().avoid_recompile is set_
