"""``backend="auto"`` on CUDA picks, for every attention layer of every swept family, a kernel that runs it.

Each family's tiny model at its default head dims (Gemma 4's full-attention layers: 512) records what
its attention layers ask of a kernel (``testkit.attention_layers``: head dim, soft-capping, band blocks,
sinks). On faked sm_80, sm_90 and sm_100 GPUs, in bf16, fp16 and fp32, without flash-attn and with
flash-attn 2.6.3 or 2.8.3, the kernel "auto" picks for each request runs forward and backward through
the stand-ins of that GPU and release (which refuse what the real libraries refuse) and matches float64.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from hf_ring.ops import kernels as kernels_mod
from hf_ring.ops.kernels import (
    FlashAttnKernel,
    ReferenceKernel,
    TorchCUDAKernel,
    TorchEfficientKernel,
    get_kernel,
)
from testkit.attention_layers import LayerRequest, layer_requests
from testkit.cuda_standins import AtenCUDAStandIn, flash_module
from testkit.families import families
from testkit.oracle import rel_err

GPUS = [(8, 0), (9, 0), (10, 0)]  # A100, H100/H200, B200
FLASH = [None, (2, 6, 3), (2, 8, 3)]  # not installed; 2.6.3-2.7.2 (no sm_100); 2.7.3+
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CACHES = (kernels_mod._kernel, kernels_mod._choose, kernels_mod._capability, kernels_mod._warn_no_band,
          kernels_mod._warn_pre_ampere)  # fmt: skip


@functools.cache
def requests() -> dict[str, tuple[LayerRequest, ...]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {mt: layer_requests(mt) for mt in families()}
    return {mt: r for mt, r in out.items() if r}


def test_families_record_their_layers() -> None:
    """Most swept families run through the ring here; the ones that matter for the choice are among them."""
    got = requests()
    assert len(got) >= 0.75 * len(families()), sorted(set(families()) - set(got))
    assert LayerRequest(512, False, False, False) in got["gemma4_text"]  # global_head_dim
    assert LayerRequest(256, False, True, False) in got["gemma4_text"]
    assert LayerRequest(256, True, True, False) in got["gemma2"]  # soft-capping on sliding layers
    assert LayerRequest(64, False, True, True) in got["gpt_oss"]  # sinks on sliding layers
    assert {r.head_dim for r in got["llama"]} == {128}


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """``use(capability, flash)``: this process's CUDA devices report ``capability`` and flash-attn is
    ``flash`` (a release of the stand-in for that GPU, or not installed); ``get_kernel``'s caches start empty."""

    def use(capability: tuple[int, int], flash: tuple[int, int, int] | None) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        fa = (FlashAttnKernel(module=flash_module(flash, capability)), "") if flash else (None, "not installed")
        monkeypatch.setattr(kernels_mod, "_flash_attn", lambda: fa)
        for cache in CACHES:
            cache.cache_clear()

    yield use
    for cache in CACHES:
        cache.cache_clear()


def _on_standin(kernel, capability: tuple[int, int]):
    """``kernel`` calling the stand-ins of a GPU of ``capability`` (flash-attn's is already one)."""
    if isinstance(kernel, TorchEfficientKernel):
        return TorchEfficientKernel(ops=AtenCUDAStandIn(capability=capability), compute_dtype=kernel.compute_dtype)
    if isinstance(kernel, TorchCUDAKernel):
        return TorchCUDAKernel(ops=AtenCUDAStandIn(capability=capability))
    return kernel


def _runs(kernel, r: LayerRequest, dtype: torch.dtype) -> None:
    """Forward and backward of one block of layer ``r`` (5 queries, 7 keys, GQA 2 over 1; a band of 3
    keys with ``window``, a cap of 3 with ``softcap``) within the dtype's tolerance of float64."""
    g = torch.Generator().manual_seed(r.head_dim)
    q, dout = (torch.randn(1, 5, 2, r.head_dim, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 7, 1, r.head_dim, generator=g) for _ in range(2))
    extra = {"softcap": 3.0} if r.softcap else {}
    extra |= {"window": (2, 0)} if r.window else {}
    xs = [t.to(dtype) for t in (q, k, v, dout)]
    out, lse = kernel.forward(*xs[:3], causal=False, scale=0.2, **extra)
    grads = kernel.backward(xs[3], *xs[:3], out, lse, causal=False, scale=0.2, **extra)
    ref = ReferenceKernel()
    xd = [t.to(dtype).double() for t in (q, k, v, dout)]
    o_ref, l_ref = ref.forward(*xd[:3], causal=False, scale=0.2, **extra)
    g_ref = ref.backward(xd[3], *xd[:3], o_ref, l_ref, causal=False, scale=0.2, **extra)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and rel_err(out, o_ref) <= tol
    for got, want in zip(grads, g_ref):
        assert rel_err(got, want) <= tol


@pytest.mark.parametrize("flash", FLASH, ids=["no-flash-attn", "flash-attn-2.6.3", "flash-attn-2.8.3"])
@pytest.mark.parametrize("capability", GPUS, ids=[f"sm{c[0]}{c[1]}" for c in GPUS])
def test_auto_runs_every_layer_of_every_family(capability: tuple[int, int], flash, gpu) -> None:
    gpu(capability, flash)
    cuda = torch.device("cuda")
    layers = {r for rs in requests().values() for r in rs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "reference kernel for windowed layers" without flash-attn
        for dtype in DTYPES:
            for r in sorted(layers, key=lambda x: (x.head_dim, x.softcap, x.window, x.sinks)):
                kernel = get_kernel("auto", cuda, dtype, softcap=r.softcap, window=r.window, head_dim=r.head_dim)
                assert get_kernel("auto", cuda, dtype, r.softcap, r.window, r.head_dim) is kernel  # cached
                _runs(_on_standin(kernel, capability), r, dtype)
                half, small = dtype != torch.float32, r.head_dim <= 256
                flash_runs = flash is not None and (flash >= (2, 7, 3) or capability < (10, 0))
                if half and small and (flash_runs or not (r.softcap or r.window)):
                    assert not isinstance(kernel, ReferenceKernel), (r, dtype, kernel.name)  # a fused kernel
                if half and not small and not (r.softcap or r.window):
                    assert isinstance(kernel, TorchEfficientKernel), (r, dtype, kernel.name)


def test_head_dim_512_on_every_gpu_and_the_refusals(gpu) -> None:
    """Gemma 4's global layers in bf16: the memory-efficient op on sm_80/90/100; an explicit flash kernel
    refuses them up front; flash-attn 2.6.3 on sm_100 is passed over for torch's flash op."""
    cuda = torch.device("cuda")
    for capability in GPUS:
        gpu(capability, (2, 8, 3))
        assert isinstance(get_kernel("auto", cuda, torch.bfloat16, head_dim=512), TorchEfficientKernel)
        assert isinstance(get_kernel("auto", cuda, torch.bfloat16, head_dim=256), FlashAttnKernel)
        for backend in ("flash_attn", "torch"):
            with pytest.raises(ValueError, match=r"head_dim 512 > 256.*backend='auto'"):
                get_kernel(backend, cuda, torch.bfloat16, head_dim=512)
    gpu((10, 0), (2, 6, 3))
    assert isinstance(get_kernel("auto", cuda, torch.bfloat16, head_dim=128), TorchCUDAKernel)
    with pytest.raises(ValueError, match=r"flash-attn 2.6.3 does not run on sm_100"):
        get_kernel("flash_attn", cuda, torch.bfloat16, head_dim=128)
    with pytest.warns(RuntimeWarning, match="no sliding-window"):
        assert isinstance(get_kernel("auto", cuda, torch.bfloat16, window=True, head_dim=128), ReferenceKernel)
