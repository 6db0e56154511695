"""``backend="auto"`` on CUDA picks, for every attention layer of every swept family, a kernel that runs it.

Each family's tiny model at its default head dims (Gemma 4's full-attention layers: 512) records what
its attention layers ask of a kernel (``testkit.attention_layers``: head dim, soft-capping, band blocks,
sinks). On faked sm_80, sm_90 and sm_100 GPUs, in bf16, fp16 and fp32, without flash-attn and with
flash-attn 2.6.3 or 2.8.3, the kernel "auto" picks for each request runs forward and backward through
the stand-ins of that GPU and release (which refuse what the real libraries refuse) and matches float64.
With every combination of flash-attn 2, flash-attn 3, flash-attn 4 and cuDNN installed or not, it is the
fastest kernel that takes the layer on that GPU (``kernels.CANDIDATES``), said once per choice in the log;
``hf_ring.set_attention_backend`` (and ``RingTrainingArguments.attention_backend``) pins one.
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings

import pytest
import torch

import hf_ring
from hf_ring.ops import kernels as kernels_mod
from hf_ring.ops.kernels import (
    CudnnKernel,
    FlashAttn3Kernel,
    FlashAttn4Kernel,
    FlashAttnKernel,
    ReferenceKernel,
    TorchCUDAKernel,
    TorchEfficientKernel,
    get_kernel,
)
from testkit.attention_layers import LayerRequest, layer_requests
from testkit.cuda_standins import AtenCUDAStandIn, flash_module
from testkit.cudnn_standin import CudnnStandIn
from testkit.families import families
from testkit.flash3_standin import FlashAttn3StandIn
from testkit.flash4_standin import FlashAttn4StandIn
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

    def use(capability: tuple[int, int], flash: tuple[int, int, int] | None, more: tuple[str, ...] = ()) -> None:
        """``more``: which of flash-attn 3 and 4 and cuDNN are installed too (stand-ins of that GPU)."""
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        fa = (FlashAttnKernel(module=flash_module(flash, capability)), "") if flash else (None, "not installed")
        monkeypatch.setattr(kernels_mod, "_flash_attn", lambda: fa)
        made = {
            "flash_attn_3": lambda: FlashAttn3Kernel(module=FlashAttn3StandIn(capability).module()),
            "flash_attn_4": lambda: FlashAttn4Kernel(module=FlashAttn4StandIn(capability).module()),
            "cudnn": lambda: CudnnKernel(ops=CudnnStandIn(capability), version=91002),
        }
        for name, make in made.items():
            got = (make(), "") if name in more else (None, f"{name} is not installed")
            monkeypatch.setattr(kernels_mod, f"_{name}", lambda got=got: got)
        for cache in CACHES:
            cache.cache_clear()

    yield use
    for cache in CACHES:
        cache.cache_clear()


def _on_standin(kernel, capability: tuple[int, int]):
    """``kernel`` calling the stand-ins of a GPU of ``capability`` (flash-attn's, flash-attn 3's and 4's and cuDNN's
    are stand-ins of that GPU already)."""
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


# --------------------------------------------------------------------------- flash-attn 3 and 4, cuDNN

LIBS = ("flash_attn", "flash_attn_3", "flash_attn_4", "cudnn")
COMBOS = [c for n in range(len(LIBS) + 1) for c in itertools.combinations(LIBS, n)]


def fastest(capability: tuple[int, int], libs: tuple[str, ...], r: LayerRequest) -> str:
    """The kernel "auto" must pick for layer ``r`` in bf16: the first of the GPU's candidates that is installed and
    takes it (flash-attn 3: sm_90, head dims <= 256; flash-attn 4: sm_100, <= 128; cuDNN: <= 128, no cap, no band;
    flash-attn 2.8.3: <= 256), else torch's flash op (no cap, no band, <= 256), its memory-efficient op, the
    reference kernel."""
    plain, d = not (r.softcap or r.window), r.head_dim
    takes = {"flash_attn_3": d <= 256, "flash_attn_4": d <= 128, "cudnn": d <= 128 and plain, "flash_attn": d <= 256}
    order = {(8, 0): ["flash_attn"], (9, 0): ["flash_attn_3", "cudnn", "flash_attn"],
             (10, 0): ["flash_attn_4", "cudnn", "flash_attn"]}[capability]  # fmt: skip
    for name in order:
        if name in libs and takes[name]:
            return name
    if plain:
        return "torch" if d <= 256 else "torch_efficient"
    return "reference"


@pytest.mark.parametrize("capability", GPUS, ids=[f"sm{c[0]}{c[1]}" for c in GPUS])
def test_auto_takes_the_fastest_installed_kernel_for_every_layer(capability: tuple[int, int], gpu) -> None:
    """Every combination of flash-attn 2 (2.8.3), flash-attn 3, flash-attn 4 and cuDNN, installed or not: each
    family's layers (bf16) get the fastest kernel that takes them on this GPU, and it runs forward and backward
    through the stand-ins of that GPU within bf16's tolerance of float64 (fp16: the layers' first kernel only)."""
    cuda = torch.device("cuda")
    layers = sorted({r for rs in requests().values() for r in rs}, key=lambda x: (x.head_dim, x.softcap, x.window))
    ran: set[tuple[str, LayerRequest]] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "reference kernel for windowed layers"
        for libs in COMBOS:
            gpu(capability, (2, 8, 3) if "flash_attn" in libs else None, libs)
            for r in layers:
                kernel = get_kernel(
                    "auto", cuda, torch.bfloat16, softcap=r.softcap, window=r.window, head_dim=r.head_dim
                )
                assert kernel.name == fastest(capability, libs, r), (libs, r, kernel.name)
                if (kernel.name, r) not in ran:  # each kernel on each kind of layer once is enough
                    ran.add((kernel.name, r))
                    _runs(_on_standin(kernel, capability), r, torch.bfloat16)
    assert {name for name, _ in ran} >= {"torch", "reference", "flash_attn"} | (
        {"flash_attn_3", "cudnn"} if capability == (9, 0) else {"flash_attn_4", "cudnn"} if capability == (10, 0)
        else set()
    )  # fmt: skip


def test_auto_says_once_which_kernel_runs_each_kind_of_layer(gpu, caplog: pytest.LogCaptureFixture) -> None:
    """One log line per process and choice: 32 layers of one kind, then a second kind, give two lines."""
    gpu((9, 0), (2, 8, 3), ("flash_attn_3", "cudnn"))
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="hf_ring"):
        for _ in range(32):
            get_kernel("auto", cuda, torch.bfloat16, head_dim=128)
        get_kernel("auto", cuda, torch.bfloat16, window=True, head_dim=256)
    lines = [r.getMessage() for r in caplog.records if "backend='auto' runs layers" in r.getMessage()]
    assert len(lines) == 2 and all("flash_attn_3" in m for m in lines), lines


def test_a_pinned_backend_runs_every_call_that_names_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """``set_attention_backend`` pins the kernel of ``hf_ring.ring_attention`` without ``backend=`` and of the
    transformers attention function (a tiny Llama forward through ``attn_implementation="ring"`` on a
    ``shard_batch`` batch, a CP group of one): the same
    output as SDPA, every kernel call on the pinned kernel; a misspelt name is refused naming the closest one,
    in ``RingTrainingArguments`` too (a user error)."""
    from hf_ring.errors import UserError
    from hf_ring.trainer import RingTrainingArguments
    from testkit.models import tiny_batch, tiny_model

    calls: list[str] = []
    forward = ReferenceKernel.forward

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append("reference")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ReferenceKernel, "forward", counted)
    assert hf_ring.set_attention_backend("reference") == "auto"
    try:
        q, k, v = (torch.randn(1, 12, h, 16) for h in (4, 2, 2))
        hf_ring.ring_attention(q, k, v)
        assert calls == ["reference"]
        ring, sdpa = tiny_model("llama", "ring"), tiny_model("llama", "sdpa")
        batch = tiny_batch(1, 24)
        with torch.no_grad():
            got, want = ring(**hf_ring.shard_batch(batch)).logits, sdpa(**batch).logits
        assert len(calls) == 1 + ring.config.num_hidden_layers and torch.allclose(got, want, atol=1e-5)
        with pytest.raises(ValueError, match=r"unknown attention backend 'flash_atn_3' \(did you mean 'flash_attn_3'"):
            hf_ring.set_attention_backend("flash_atn_3")
        assert hf_ring.parallel.attention_backend() == "reference"
    finally:
        hf_ring.set_attention_backend("auto")
    with pytest.raises(UserError, match=r"attention_backend: unknown attention backend 'cdnn' \(did you mean 'cudnn'"):
        RingTrainingArguments(output_dir="unused", attention_backend="cdnn", use_cpu=True)
    assert (
        RingTrainingArguments(output_dir="unused", attention_backend="cudnn", use_cpu=True).attention_backend == "cudnn"
    )
