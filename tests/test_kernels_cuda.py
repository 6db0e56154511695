"""The call contracts of the CUDA kernels (flash-attn, torch's flash and memory-efficient ops) against
stand-ins with the real signatures and checks, the ring through them, and flash-attn loading."""

from __future__ import annotations

import importlib
import itertools
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import hf_ring
from hf_ring.ops import kernels as kernels_mod
from hf_ring.ops.comm import Ring
from hf_ring.ops.kernels import (
    CudnnKernel,
    FlashAttnKernel,
    ReferenceKernel,
    TorchCUDAKernel,
    TorchEfficientKernel,
    available_backends,
    band_mask,
    get_kernel,
)
from hf_ring.ops.ring import _RingAttention
from hf_ring.ops.schedule import make_schedule
from testkit.cuda_standins import (
    FAKES,
    NEW_KERNELS,
    TOL,
    AtenCUDAStandIn,
    _bwd_op,
    _fwd_op,
    flash_attn_backward_26,
    flash_attn_forward_25,
    inputs,
    make_kernel,
)
from testkit.oracle import attention, reference, rel_err
from testkit.spawn import run_ranks

# --------------------------------------------------------------------------- FlashAttnKernel


def test_flash_attn_kernel_refuses_too_old_flash_attn() -> None:
    fa25 = SimpleNamespace(_flash_attn_forward=flash_attn_forward_25, _flash_attn_backward=flash_attn_backward_26)
    with pytest.raises(ImportError, match=r"install flash-attn >= 2.6"):
        FlashAttnKernel(module=fa25)


def test_flash_attn_kernel_detects_api_version() -> None:
    assert FlashAttnKernel(module=FAKES["2.6"]).legacy
    assert not FlashAttnKernel(module=FAKES["2.7-plain"]).legacy
    assert not FlashAttnKernel(module=FAKES["2.8-custom-op"]).legacy


def test_flash_attn_stand_in_keeps_the_cuda_checks() -> None:
    """The stand-in rejects what the CUDA op rejects, so passing through it means something."""
    q, k, v = (torch.randn(1, 4, 2, d) for d in (36, 36, 36))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        _fwd_op(q, k, v, 0.0, 1.0, False, -1, -1, 0.0, None, False)
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    out, lse, _, _ = _fwd_op(q, k, v, 0.0, 1.0, False, -1, -1, 0.0, None, False)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    options = (0.0, 1.0, False, -1, -1, 0.0, None, False, None)
    with pytest.raises(RuntimeError, match=r"softmax_lse \[B, H, Sq\]"):
        _bwd_op(out, q, k, v, out, lse.transpose(1, 2), dq, dk, dv, *options)
    softmax_d = _bwd_op(out, q, k, v, out, lse, dq, dk, dv, *options)
    assert softmax_d.shape == (1, 2, 128) and softmax_d.dtype == torch.float32


def test_flash_attn_stand_ins_declare_what_flash_attn_declares() -> None:
    """flash-attn 2.7.0 .. 2.8.3 register ``_flash_attn_forward`` / ``_flash_attn_varlen_forward`` with
    ``mutates_args=()`` and their backwards with ``("dq", "dk", "dv")``; the stand-in ops say the same."""

    def mutated(name: str) -> set[str]:
        schema = getattr(torch.ops.hf_ring_tests, name).default._schema
        return {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}

    assert mutated("flash_attn_forward") == mutated("flash_attn_varlen_forward") == set()
    assert mutated("flash_attn_backward") == mutated("flash_attn_varlen_backward") == {"dq", "dk", "dv"}


def ring_errors(name: str, causal: bool, dtype_name: str, d: int) -> list[float] | None:
    """On every rank: the whole ring through ``make_kernel(name)``; rank 0 returns the relative errors
    of out, dq, dk, dv against float64."""
    dist = torch.distributed
    size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    dtype = getattr(torch, dtype_name)
    b, n, hq, hkv = 1, 2 * size * 5, 8, 2
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    xs = [x.requires_grad_() for x in (q, k, v)]
    ref = attention(*xs, causal)
    ref_grads = torch.autograd.grad(ref, xs, dout)
    kernel = make_kernel(name)
    loc = [hf_ring.shard(x.detach().to(dtype)).requires_grad_() for x in (q, k, v)]
    out = _RingAttention.apply(*loc, d**-0.5, make_schedule("zigzag", causal, rank, size), kernel, Ring())
    grads = torch.autograd.grad(out, loc, hf_ring.shard(dout.to(dtype)))
    got = [hf_ring.unshard(t) for t in (out, *grads)]
    if rank:
        return None
    return [rel_err(x, r) for x, r in zip(got, (ref.detach(), *ref_grads))]


RING_KERNELS = [*(f"flash_attn:{v}" for v in FAKES), "torch_cuda", "torch_efficient", *NEW_KERNELS]
RING_CASES = [
    (name, causal, dtype, d)
    for name, causal, (dtype, d) in itertools.product(
        RING_KERNELS, (True, False), (("float32", 80), ("bfloat16", 80), ("float32", 36))
    )
]


@pytest.mark.parametrize("name, causal, dtype, d", RING_CASES)
def test_ring_through_cuda_kernel_contracts_single_process(name: str, causal: bool, dtype: str, d: int) -> None:
    assert not torch.distributed.is_initialized()
    errs = ring_errors(name, causal, dtype, d)
    for gname, err in zip(("out", "dq", "dk", "dv"), errs):
        assert err <= TOL[getattr(torch, dtype)], f"{gname} rel err {err:.2e}"


@pytest.mark.parametrize("world", [2, 3])
def test_ring_through_cuda_kernel_contracts(world: int) -> None:
    fast = ("flash_attn:2.8-custom-op", "flash_attn_3:custom-op")
    cases = [c for c in RING_CASES if c[0] in fast or c[2:] == ("float32", 80)]
    for name, causal, dtype, d in cases:
        errs, *_ = run_ranks(world, ring_errors, name, causal, dtype, d)
        for gname, err in zip(("out", "dq", "dk", "dv"), errs):
            assert err <= TOL[getattr(torch, dtype)], f"{name} causal={causal} {dtype} D={d}: {gname} {err:.2e}"


def test_flash_attn_interface_module_is_the_default() -> None:
    """Without a module argument FlashAttnKernel imports flash_attn.flash_attn_interface."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed")
    with pytest.raises(ModuleNotFoundError, match="flash_attn"):
        FlashAttnKernel()


# --------------------------------------------------------------------------- torch's CUDA ops: call contract


def _bhsd(b: int, h: int, s: int, d: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``[B, H, S, D]`` view of ``[B, S, H, D]`` memory, as the kernels pass them to the flash op."""
    return torch.randn(b, s, h, d).to(dtype).transpose(1, 2)


def test_aten_stand_in_keeps_the_cuda_checks() -> None:
    """The stand-in rejects what the CUDA ops reject, so passing through it means something."""
    aten = AtenCUDAStandIn()
    flash, flash_bwd = aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward
    q, k = _bhsd(1, 4, 6, 16), _bhsd(1, 2, 6, 16)
    res = flash(q, k, k, 0.0, False, False, scale=0.25)
    assert res[2] is None and res[3] is None  # dense forward: no cumulative lengths
    out, lse, rng = res[0], res[1], res[6:8]
    i64 = torch.empty(0, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):  # a defined tensor: varlen
        flash_bwd(out, q, k, k, out, lse, i64, i64, 6, 6, 0.0, False, i64, i64, scale=0.25)
    i32 = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="varlen"):
        flash_bwd(out, q, k, k, out, lse, i32, i32, 6, 6, 0.0, False, *rng, scale=0.25)
    with pytest.raises(RuntimeError, match=r"logsumexp \[B, H, Sq\]"):
        flash_bwd(out, q, k, k, out, lse.transpose(1, 2), None, None, 6, 6, 0.0, False, *rng, scale=0.25)
    dq, dk, dv = flash_bwd(out, q, k, k, out, lse, None, None, 6, 6, 0.0, False, *rng, scale=0.25)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape  # dK/dV with the K/V head count
    for (hq, hkv, d, dtype), msg in [
        ((4, 2, 36, torch.bfloat16), "multiple of 8"),
        ((4, 2, 264, torch.bfloat16), "at most 256"),
        ((6, 4, 16, torch.bfloat16), "must divide number of heads"),
        ((4, 2, 16, torch.float32), "only support fp16 and bf16"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            flash(_bhsd(1, hq, 6, d, dtype), *[_bhsd(1, hkv, 6, d, dtype)] * 2, scale=0.25)
    # memory-efficient op: [B, M, H, K] memory, equal head counts, LSE padded to 32
    q, k = torch.randn(2, 13, 4, 16), torch.randn(2, 13, 4, 16)
    eff, eff_bwd = aten._efficient_attention_forward, aten._efficient_attention_backward
    with pytest.raises(RuntimeError, match=r"query.size\(2\) == key.size\(2\)"):
        eff(q, k[:, :, :2], k[:, :, :2], None, None, None, None, None, 0.0, 1, True, scale=0.25)
    out, lse, seed, offset, _, _ = eff(q, k, k, None, None, None, None, None, 0.0, 1, True, scale=0.25)
    assert lse.shape == (2, 4, 32) and bool(torch.isposinf(lse[..., 13:]).all())
    args = (None, None, 13, 13)
    with pytest.raises(RuntimeError, match=r"LSE is not correctly aligned \(strideH\)"):
        eff_bwd(out, q, k, k, None, out, *args, lse[..., :13].contiguous(), 0.0, seed, offset, 1, False, scale=0.25)
    with pytest.raises(RuntimeError, match=r"out must be dense"):
        strided = torch.randn(2, 4, 13, 16).transpose(1, 2)
        eff_bwd(out, q, k, k, None, strided, *args, lse, 0.0, seed, offset, 1, False, scale=0.25)
    dq, dk, dv, _ = eff_bwd(out, q, k, k, None, out, *args, lse, 0.0, seed, offset, 1, False, scale=0.25)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_torch_cuda_kernel_call_contract() -> None:
    """K/V reach the op with their own head count, padded head dims, ``None`` cumulative lengths and the
    forward's own rng tensors; results come back unpadded with the input shapes."""
    aten = AtenCUDAStandIn(record=True)
    kernel = TorchCUDAKernel(ops=aten)
    q, k, v, dout = (x.bfloat16() for x in inputs((2, 13, 13, 8, 2, 36, True), torch.bfloat16))
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.2)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    fwd = aten.calls["flash_fwd"][0]
    assert fwd["k"].shape == (2, 13, 2, 40) and fwd["q"].shape == (2, 13, 8, 40)  # unexpanded, padded 36 -> 40
    rng = kernel._rng[q.device]
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    bwd = aten.calls["flash_bwd"][0]
    assert bwd["cum_seq_q"] is None and bwd["k"].shape[2] == 2
    assert bwd["philox"][0] is rng[0] and bwd["philox"][1] is rng[1]  # the forward's rng_state / unused
    # a backward before any forward on the device gets what the CUDA forward returns without dropout
    fresh = TorchCUDAKernel(ops=aten)
    fresh.backward(dout, q, k, v, out, lse, causal=True, scale=0.2)
    seed, offset = aten.calls["flash_bwd"][1]["philox"]
    assert (seed.dtype, seed.shape, offset.dtype, offset.shape) == (torch.uint64, (2,), torch.uint64, ())


def test_torch_efficient_kernel_call_contract() -> None:
    """K/V expanded to the query heads (the op's backward wants equal counts), LSE cut to ``Sq`` on the
    way out and rebuilt padded on the way in, ``out`` handed over dense."""
    aten = AtenCUDAStandIn(record=True)
    kernel = TorchEfficientKernel(ops=aten)
    q, k, v, dout = (x.float() for x in inputs((2, 13, 13, 8, 2, 36, True), torch.float32))
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.2)
    assert lse.shape == (2, 13, 8) and bool(torch.isfinite(lse).all())
    assert aten.calls["eff_fwd"][0]["k"].shape == (2, 13, 8, 40)
    merged_out = torch.randn(2, 8, 13, 36).transpose(1, 2)  # a strided view, like the ring's merged out
    dq, dk, dv = kernel.backward(dout, q, k, v, merged_out, lse, causal=True, scale=0.2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    bwd = aten.calls["eff_bwd"][0]
    assert bwd["lse"].shape == (2, 8, 32) and bool(torch.isposinf(bwd["lse"][..., 13:]).all())
    assert bwd["out"].is_contiguous() and bwd["k"].shape[2] == 8


@pytest.mark.parametrize("name", ["torch_cuda", "flash_attn:2.8-custom-op"])
def test_head_dim_above_256_is_a_clear_error(name: str) -> None:
    kernel = make_kernel(name)
    q, k, v, dout = (x.bfloat16() for x in inputs((1, 4, 4, 2, 1, 264, False), torch.bfloat16))
    with pytest.raises(ValueError, match=r"head_dim 264 > 256.*backend='torch_efficient'.*backend='reference'"):
        kernel.forward(q, k, v, causal=False, scale=0.1)
    with pytest.raises(ValueError, match=r"head_dim 264 > 256"):
        kernel.backward(dout, q, k, v, dout, torch.zeros(1, 4, 2), causal=False, scale=0.1)


def test_torch_efficient_kernel_takes_head_dims_above_256() -> None:
    shape = (1, 7, 9, 4, 2, 264, False)
    q, k, v, dout = (x.float() for x in inputs(shape, torch.float32, seed=2))
    kernel = make_kernel("torch_efficient")
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, False, 0.06)
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.06)
    assert rel_err(out, ref_out) <= 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    for g, r in zip(kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.06), ref_grads):
        assert rel_err(g, r) <= 1e-5


def sdpa_bf16(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float) -> list[Tensor]:
    """``[out, dq, dk, dv]`` of torch's CPU SDPA in bfloat16 (autograd): the bf16 yardstick."""
    xs = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=causal, scale=scale, enable_gqa=True)
    grads = torch.autograd.grad(out, xs, dout.transpose(1, 2))
    return [t.transpose(1, 2) for t in (out, *grads)]


@pytest.mark.parametrize("name", ["torch_cuda", "torch_efficient"])
@pytest.mark.parametrize(
    "shape", [(2, 19, 19, 8, 2, 80, True), (1, 11, 23, 6, 3, 36, False), (1, 21, 21, 8, 2, 72, True)]
)
def test_cuda_kernels_in_bf16_within_twice_sdpa_bf16(name: str, shape: tuple) -> None:
    """bf16 through the CUDA kernels' glue (padding, slicing, K/V expansion and group sums) loses at most
    twice what torch's own bf16 SDPA loses against float64 on the same rounded inputs."""
    causal, scale = shape[6], shape[5] ** -0.5
    q, k, v, dout = (x.bfloat16() for x in inputs(shape, torch.bfloat16, seed=7))
    ref = reference(q, k, v, dout, causal, scale)
    yard = sdpa_bf16(q, k, v, dout, causal, scale)
    kernel = make_kernel(name)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    got = [out, *kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)]
    for gname, g, y, r in zip(("out", "dq", "dk", "dv"), got, yard, (ref[0], *ref[2:])):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, r) <= 2 * rel_err(y, r), f"{gname}: {rel_err(g, r):.2e} vs sdpa {rel_err(y, r):.2e}"


# --------------------------------------------------------------------------- flash-attn loading, kernel cache

BROKEN_FLASH_ATTN = {
    # a wheel built against another torch: the package is found, its import fails
    "abi": {"__init__.py": 'raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n'},
    # imports, but older than hf_ring supports (no softcap)
    "too_old": {
        "__init__.py": "",
        "flash_attn_interface.py": (
            "def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,\n"
            "                        return_softmax):\n    raise AssertionError\n\n\n"
            "def _flash_attn_backward(*args):\n    raise AssertionError\n"
        ),
    },
}


@pytest.fixture
def fresh_kernel_caches():
    """Empty get_kernel's caches before and after (and forget any fake flash_attn package)."""
    caches = (
        kernels_mod._flash_attn,
        kernels_mod._kernel,
        kernels_mod._choose,
        kernels_mod._capability,
        kernels_mod._warn_pre_ampere,
        kernels_mod._warn_no_band,
    )
    for cache in caches:
        cache.cache_clear()
    yield
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    for cache in caches:
        cache.cache_clear()


@pytest.mark.parametrize("case", BROKEN_FLASH_ATTN)
def test_auto_falls_back_to_torch_when_flash_attn_is_unusable(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None
) -> None:
    (tmp_path / "flash_attn").mkdir()
    for fname, text in BROKEN_FLASH_ATTN[case].items():
        (tmp_path / "flash_attn" / fname).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("flash_attn") is not None
    cuda = torch.device("cuda")
    with pytest.warns(RuntimeWarning, match=r"flash_attn is installed but unusable.*torch's CUDA flash op instead"):
        kernel = get_kernel("auto", cuda, torch.bfloat16)
    assert isinstance(kernel, TorchCUDAKernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not once per call or layer
        assert isinstance(get_kernel("auto", torch.device("cuda", 1), torch.float16), TorchCUDAKernel)
        assert available_backends("cuda") == ["torch", "torch_efficient", "reference"]
        with pytest.raises(ValueError, match=r"backend='flash_attn' but flash_attn is installed but unusable"):
            get_kernel("flash_attn", cuda, torch.bfloat16)


def test_flash_attn_is_loaded_once_for_all_layers(monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None) -> None:
    """One FlashAttnKernel (one import, one signature inspection) however many layers ask for it."""
    made: list[FlashAttnKernel] = []

    class Counting(FlashAttnKernel):
        def __init__(self) -> None:
            made.append(self)
            super().__init__(module=FAKES["2.8-custom-op"])

    monkeypatch.setattr(kernels_mod, "FlashAttnKernel", Counting)
    monkeypatch.setattr(kernels_mod, "_flash_attn_importable", lambda: True)
    cuda = torch.device("cuda")
    layers = [get_kernel("auto", cuda, torch.bfloat16) for _ in range(32)]
    assert len(made) == 1 and all(k is made[0] for k in layers)
    assert get_kernel("flash_attn", cuda, torch.float16) is made[0]
    assert available_backends("cuda")[0] == "flash_attn"


# --------------------------------------------------------------------------- "auto" by compute capability

CAPABILITIES = [(7, 0), (7, 5), (8, 0), (8, 6), (9, 0)]  # V100, T4, A100, A10/RTX 30xx, H100/H200


def _fake_capability(monkeypatch: pytest.MonkeyPatch, capability) -> None:
    """This process's CUDA devices report ``capability`` (a tuple, or a dict by device index)."""

    def get_device_capability(device=None):
        return capability[device] if isinstance(capability, dict) else capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)


def _on(kernel, ops: AtenCUDAStandIn):
    """``kernel`` (from get_kernel) calling the aten stand-in ``ops`` instead of torch.ops.aten."""
    if isinstance(kernel, TorchEfficientKernel):
        return TorchEfficientKernel(ops=ops, compute_dtype=kernel.compute_dtype)
    if isinstance(kernel, TorchCUDAKernel):
        return TorchCUDAKernel(ops=ops)
    return kernel


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_auto_picks_a_kernel_that_runs_on_every_gpu(
    capability: tuple[int, int], monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None
) -> None:
    """flash-attn and torch's flash op refuse GPUs before Ampere; there "auto" takes torch's memory-efficient
    op for fp16/bf16 (bf16 computed in float32: the op has no bf16 kernel before sm_80), warning once. Every
    choice runs forward and backward against the stand-in of a GPU of that capability, exact against float64
    to the dtype's tolerance."""
    _fake_capability(monkeypatch, capability)
    gpu = AtenCUDAStandIn(capability=capability)
    old = capability < (8, 0)
    cuda = torch.device("cuda")
    shape = (1, 13, 13, 8, 2, 80, True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            layers = {id(get_kernel("auto", cuda, dtype)) for _ in range(32)}
            kernel = get_kernel("auto", cuda, dtype)
            assert len(layers) == 1  # one cached kernel for every layer and call
            want = TorchEfficientKernel if old or dtype == torch.float32 else TorchCUDAKernel
            assert type(kernel) is want, (capability, dtype, kernel)
            if isinstance(kernel, TorchEfficientKernel):
                assert kernel.compute_dtype == (torch.float32 if old and dtype == torch.bfloat16 else None)
            q, k, v, dout = (x.to(dtype) for x in inputs(shape, dtype, seed=3))
            ref_out, _, *ref_grads = reference(q, k, v, dout, True, 0.1)
            run = _on(kernel, gpu)
            out, lse = run.forward(q, k, v, causal=True, scale=0.1)
            grads = run.backward(dout, q, k, v, out, lse, causal=True, scale=0.1)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert out.dtype == dtype and rel_err(out, ref_out) <= tol
            for g, x, r in zip(grads, (q, k, v), ref_grads):
                assert g.dtype == dtype and g.shape == x.shape and rel_err(g, r) <= tol
    ampere = [w for w in caught if "older than Ampere" in str(w.message)]
    assert len(ampere) == (1 if old else 0), [str(w.message) for w in caught]
    if old:
        assert issubclass(ampere[0].category, RuntimeWarning) and f"sm_{capability[0]}{capability[1]}" in str(
            ampere[0].message
        )
        assert available_backends("cuda") == ["torch_efficient", "reference"]
        for backend in ("torch", "flash_attn"):
            with pytest.raises(ValueError, match=r"needs an Ampere or newer GPU.*backend='torch_efficient'"):
                get_kernel(backend, cuda, torch.float16)
        # what "auto" picked before it looked at the GPU: the stand-in refuses it, as the GPU would
        q, k, v, _ = (x.bfloat16() for x in inputs(shape, torch.bfloat16))
        with pytest.raises(RuntimeError, match="FlashAttention only supports Ampere GPUs or newer"):
            TorchCUDAKernel(ops=gpu).forward(q, k, v, causal=True, scale=0.1)
        with pytest.raises(RuntimeError, match="cutlassF: no kernel found"):
            TorchEfficientKernel(ops=gpu).forward(q, k, v, causal=True, scale=0.1)
    else:
        assert available_backends("cuda")[-3:] == ["torch", "torch_efficient", "reference"]


def test_auto_is_chosen_per_device(monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None) -> None:
    """A process that sees a T4 as cuda:0 and an H100 as cuda:1 gets each its own kernel; ``"cuda"`` is the
    current device."""
    _fake_capability(monkeypatch, {0: (7, 5), 1: (9, 0)})
    with pytest.warns(RuntimeWarning, match="sm_75, older than Ampere"):
        assert isinstance(get_kernel("auto", torch.device("cuda", 0), torch.bfloat16), TorchEfficientKernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(get_kernel("auto", torch.device("cuda", 1), torch.bfloat16), TorchCUDAKernel)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        assert isinstance(get_kernel("auto", "cuda", torch.bfloat16), TorchCUDAKernel)
        assert isinstance(get_kernel("auto", torch.device("cuda", 0), torch.float16), TorchEfficientKernel)


class _AtenProbe(TorchDispatchMode):
    """Records the aten attention ops reached from Python: by then each call has been bound to the op's
    real schema (argument order, kwargs, ``None`` for a ``Tensor`` argument). Answers
    ``_efficient_attention_backward`` itself: torch 2.13's meta function for it lacks the ``out`` argument."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func.overloadpacket.__name__
        if "attention" in name:
            self.calls[name] = (args, kwargs or {})
        if name == "_efficient_attention_backward":
            return torch.empty_like(args[1]), torch.empty_like(args[2]), torch.empty_like(args[3]), torch.empty(0)
        return func(*args, **(kwargs or {}))


def test_cuda_kernels_match_the_real_aten_schemas_on_meta_tensors() -> None:
    meta = torch.device("meta")
    q = torch.empty(2, 13, 8, 36, device=meta, dtype=torch.bfloat16)
    k = torch.empty(2, 13, 2, 36, device=meta, dtype=torch.bfloat16)
    with _AtenProbe() as probe:
        kernel = TorchCUDAKernel()  # torch.ops.aten
        out, lse = kernel.forward(q, k, k, causal=True, scale=0.2)
        grads = kernel.backward(out, q, k, k, out, lse, causal=True, scale=0.2)
        eff = TorchEfficientKernel()
        qf, kf = q.float(), k.float()
        out_f, lse_f = eff.forward(qf, kf, kf, causal=True, scale=0.2)
        grads_f = eff.backward(out_f, qf, kf, kf, out_f, lse_f, causal=True, scale=0.2)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, q.shape[:3], torch.float32)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    args, kwargs = probe.calls["_scaled_dot_product_flash_attention_backward"]
    assert args[6] is None and args[7] is None and kwargs == {"scale": 0.2}  # dense path
    assert args[2].shape == (2, 2, 13, 40) and args[12].dtype == torch.uint64  # unexpanded K, padded; rng_state
    assert (out_f.shape, lse_f.shape) == (qf.shape, qf.shape[:3]) and [g.shape for g in grads_f] == [
        qf.shape,
        kf.shape,
        kf.shape,
    ]
    args, kwargs = probe.calls["_efficient_attention_backward"]
    assert args[10].shape == (2, 8, 32) and args[14] == 1 and kwargs == {"scale": 0.2}  # padded LSE; top-left causal


def test_cudnn_kernel_matches_the_real_aten_schemas_on_meta_tensors() -> None:
    """torch 2.13's own cuDNN attention ops (their meta functions) take the kernel's calls: ``logsumexp
    [B, H, Sq, 1]`` back into the backward, ``None`` for the undefined ``attn_bias``/``cum_seq_*`` tensors,
    K/V with their own heads; the shapes it hands the ring are ``BlockKernel``'s."""
    meta = torch.device("meta")
    q = torch.empty(2, 13, 8, 36, device=meta, dtype=torch.bfloat16)
    k = torch.empty(2, 11, 2, 36, device=meta, dtype=torch.bfloat16)
    with _AtenProbe() as probe:
        kernel = CudnnKernel(version=91002)  # torch.ops.aten
        out, lse = kernel.forward(q, k, k, causal=False, scale=0.2)
        grads = kernel.backward(out, q, k, k, out, lse, causal=False, scale=0.2)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, q.shape[:3], torch.float32)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    args, kwargs = probe.calls["_scaled_dot_product_cudnn_attention_backward"]
    assert args[5].shape == (2, 8, 13, 1) and args[8:11] == (None, None, None) and kwargs == {"scale": 0.2}
    assert args[2].shape == (2, 2, 11, 40) and args[11:13] == (13, 11)  # unexpanded K, padded; max_q, max_k


# --------------------------------------------------------------------------- windowed blocks without flash-attn


@pytest.mark.parametrize("capability", [(7, 5), (9, 0)])
def test_auto_runs_windowed_blocks_without_flash_attn(
    capability: tuple[int, int], monkeypatch: pytest.MonkeyPatch, fresh_kernel_caches: None
) -> None:
    """torch's CUDA ops have no band: without flash-attn, "auto" gives the blocks of windowed layers the
    reference kernel, warning once per op it replaces (not per layer or call); layers without a window
    keep the fused op; an explicit backend without a band refuses. The kernel it picks is exact on a
    band (forward and gradients against float64)."""
    _fake_capability(monkeypatch, capability)
    monkeypatch.setattr(kernels_mod, "_flash_attn_importable", lambda: False)
    cuda, old = torch.device("cuda"), capability < (8, 0)
    fused = {torch.bfloat16: TorchEfficientKernel if old else TorchCUDAKernel, torch.float32: TorchEfficientKernel}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in (torch.bfloat16, torch.float32):
            for _ in range(8):  # every layer and call
                assert isinstance(get_kernel("auto", cuda, dtype, window=True), ReferenceKernel)
                assert isinstance(get_kernel("auto", cuda, dtype, softcap=True, window=True), ReferenceKernel)
                assert type(get_kernel("auto", cuda, dtype)) is fused[dtype]
    bands = [str(w.message) for w in caught if "no sliding-window (band) mask" in str(w.message)]
    replaced = {fused[dtype].name for dtype in fused}
    assert len(bands) == len(replaced), bands  # once per fused op replaced
    assert all("reference kernel" in m and "pip install hf-ring[flash]" in m for m in bands), bands
    for backend in ("torch_efficient",) if old else ("torch", "torch_efficient"):
        with pytest.raises(ValueError, match=r"no sliding-window \(band\) mask.*backend='auto'"):
            get_kernel(backend, cuda, torch.bfloat16, window=True)
    with pytest.raises(ValueError, match="no sliding-window"):  # a fused op handed a band refuses, too
        q, k, v, _ = (x.bfloat16() for x in inputs((1, 13, 13, 4, 2, 16, True), torch.bfloat16))
        TorchEfficientKernel(ops=AtenCUDAStandIn(capability=capability)).forward(
            q, k, v, causal=False, scale=0.25, window=(4, 0)
        )
    # the picked kernel on a band of 5 keys over a square block and a block with 4 more keys
    kernel = get_kernel("auto", cuda, torch.bfloat16, window=True)
    for sq, sk in ((13, 13), (13, 17)):
        g = torch.Generator().manual_seed(sk)
        q, dout = (torch.randn(2, sq, 6, 16, generator=g) for _ in range(2))
        k, v = (torch.randn(2, sk, 2, 16, generator=g) for _ in range(2))
        xs = [t.double().requires_grad_() for t in (q, k, v)]
        kx, vx = (t.repeat_interleave(3, 2) for t in xs[1:])
        s = torch.einsum("bqhd,bkhd->bhqk", xs[0], kx) * 0.25
        s = s.masked_fill(~band_mask(sq, sk, (4, 0)), float("-inf"))
        ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vx)
        ref.backward(dout.double())
        out, lse = kernel.forward(q, k, v, causal=False, scale=0.25, window=(4, 0))
        grads = kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.25, window=(4, 0))
        assert rel_err(out, ref) <= 1e-5
        for got, x in zip(grads, xs):
            assert rel_err(got, x.grad) <= 1e-5
