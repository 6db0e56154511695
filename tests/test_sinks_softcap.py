"""Attention sinks and logit soft-capping inside the ring, against float64 attention over the whole
sequence: forward, dQ/dK/dV and the sinks' gradient, P = 1..4, GQA, head_dim 80, lengths that are not
multiples of 2P per chunk, packed documents; the block kernels alone; flash-attn's ``softcap`` through
its stand-in."""

from __future__ import annotations

import time

import pytest
import torch
from torch import Tensor

from hf_ring.ops.kernels import ReferenceKernel, TorchCPUKernel, get_kernel
from hf_ring.ops.ring import ring_attention
from hf_ring.ops.schedule import document_schedule
from hf_ring.ops.zigzag import shard, unshard
from testkit.oracle import attention, rel_err
from testkit.spawn import run_ranks

NAMES = ("out", "dq", "dk", "dv", "dsinks")


def starts(row: list[int]) -> list[int]:
    return [sum(row[:i]) for i in range(len(row))]


def ring_errors(
    n: int, hq: int, hkv: int, d: int, softcap: float | None, sinks: str | None, docs: list[list[int]] | None,
    dtype_name: str = "float32", backend: str = "auto", head_groups: int = 1,
) -> dict[str, float]:  # fmt: skip
    """This rank's ring attention against float64 (gathered over the ranks; per-head sinks' gradient
    summed over them, as the DP x CP gradient reduction sums it), and the same-dtype one-process eager
    attention as a yardstick (``eager_*``). ``sinks``: ``"head"`` ``[Hq]``, ``"row"`` ``[B, N, Hq]``, or None."""
    dtype = getattr(torch, dtype_name)
    size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if size > 1 else 0
    b = len(docs) if docs else 2
    g = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(b, n, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    q = q * 3.0  # scores well past the cap, so soft-capping changes them
    snk = torch.randn(*((b, n) if sinks == "row" else ()), hq, generator=g, dtype=torch.float64) if sinks else None
    loc = [shard(t.to(dtype), dim=1).detach().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    loc_sinks = None
    if sinks:
        loc_sinks = (shard(snk.to(dtype), dim=1) if sinks == "row" else snk.to(dtype)).detach().requires_grad_()
    sched = document_schedule([starts(r) for r in docs], n, rank, size) if docs else None
    kernel = backend
    if backend.startswith("flash_attn:"):
        from testkit.cuda_standins import make_kernel

        kernel = make_kernel(backend)
    out = ring_attention(*loc[:3], schedule=sched, softcap=softcap, sinks=loc_sinks, backend=kernel,
                         head_groups=head_groups)  # fmt: skip
    out.backward(loc[3])
    got = [unshard(t, dim=1) for t in (out, loc[0].grad, loc[1].grad, loc[2].grad)]
    if sinks == "row":
        got.append(unshard(loc_sinks.grad, dim=1))
    elif sinks:
        dsinks = loc_sinks.grad.double().clone()
        if size > 1:
            torch.distributed.all_reduce(dsinks)
        got.append(dsinks)
    doc_starts = [starts(r) for r in docs] if docs else None

    def grads(dt: torch.dtype) -> list[Tensor]:
        xs = [t.to(dtype).to(dt).requires_grad_() for t in (q, k, v)]
        s_in = snk.to(dtype).to(dt).requires_grad_() if sinks else None
        o = attention(*xs, True, starts=doc_starts, softcap=softcap, sinks=s_in, dtype=dt)
        o.backward(dout.to(dtype).to(dt))
        return [o, *(t.grad for t in xs), *((s_in.grad,) if sinks else ())]

    want = grads(torch.float64)
    errs = {name: rel_err(a, w) for name, a, w in zip(NAMES, got, want)}
    if dtype != torch.float32:
        errs.update({f"eager_{name}": rel_err(a, w) for name, a, w in zip(NAMES, grads(dtype), want)})
    return errs


# N = 2P * 7 or 2P * 5 per chunk: odd chunks, so N is not a multiple of 4P
SHAPES = {1: 14, 2: 28, 3: 30, 4: 40}
DOCS = {1: [[3, 9, 2], [14]], 2: [[5, 1, 13, 9]], 3: [[7, 11, 1, 11]], 4: [[17, 3, 9, 11], [2, 38]]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "softcap, sinks",
    [(5.0, None), (None, "head"), (5.0, "head"), (None, "row")],
    ids=["softcap", "sinks", "both", "row_sinks"],
)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_ring_matches_float64(world: int, softcap: float | None, sinks: str | None, packed: bool) -> None:
    """fp32 ring (torch kernel, or the reference one where soft-capped) within 1e-5 of float64: GQA 6/2,
    head_dim 80, output, dQ/dK/dV and the sinks' gradient summed over the ranks."""
    n = SHAPES[world] if not packed else sum(DOCS[world][0])
    docs = DOCS[world] if packed else None
    for r in run_ranks(world, ring_errors, n, 6, 2, 80, softcap, sinks, docs):
        assert max(r.values()) <= 1e-5, r


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_within_twice_one_process(world: int) -> None:
    """bf16 ring with sinks and soft-capping within 2x of one-process bf16 eager attention."""
    for r in run_ranks(world, ring_errors, SHAPES[world] * 2, 4, 2, 16, 5.0, "head", None, "bfloat16"):
        for name in NAMES:
            assert r[name] <= 2 * r[f"eager_{name}"] + 1e-3, (name, r)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_flash_attn_softcap_through_standin(world: int, packed: bool) -> None:
    """flash-attn's ``softcap`` argument, through the stand-in with the 2.7/2.8 call contract (dense and
    varlen entry points), with sinks: exact against float64."""
    n = SHAPES[world] if not packed else sum(DOCS[world][0])
    docs = DOCS[world] if packed else None
    for version in ("2.8-custom-op", "2.7-plain"):
        for r in run_ranks(world, ring_errors, n, 6, 2, 80, 5.0, "head", docs, "float32", f"flash_attn:{version}"):
            assert max(r.values()) <= 1e-5, (version, r)


def test_one_process_without_distributed() -> None:
    assert not torch.distributed.is_initialized()
    r = ring_errors(14, 4, 4, 32, 5.0, "head", None)
    assert max(r.values()) <= 1e-5, r


@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernel_tiles(causal: bool) -> None:
    """The reference kernel over query tiles (a small ``tile_elems``: several rows per tile and a ragged
    last tile) equals one tile, forward and backward, with soft-capping and a non-square block."""
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 13, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 13 if causal else 9, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    whole, tiled = ReferenceKernel(), ReferenceKernel(tile_elems=2 * 4 * k.shape[1] * 3)
    assert len(tiled._tiles(q, k)) == 5
    kw = dict(causal=causal, scale=0.25, softcap=2.0)
    o1, l1 = whole.forward(q, k, v, **kw)
    o2, l2 = tiled.forward(q, k, v, **kw)
    torch.testing.assert_close(o2, o1)
    torch.testing.assert_close(l2, l1)
    for a, b in zip(whole.backward(dout, q, k, v, o1, l1, **kw), tiled.backward(dout, q, k, v, o1, l1, **kw)):
        torch.testing.assert_close(b, a)


def test_kernel_choice_and_refusals() -> None:
    cpu = torch.device("cpu")
    assert isinstance(get_kernel("auto", cpu, torch.float32, softcap=True), ReferenceKernel)
    assert isinstance(get_kernel("auto", cpu, torch.float32), TorchCPUKernel)
    with pytest.raises(ValueError, match="soft-capping"):
        get_kernel("torch", cpu, torch.float32, softcap=True)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="soft-capping"):
        ring_attention(q, q, q, softcap=5.0, backend=TorchCPUKernel())
    with pytest.raises(ValueError, match="positive"):
        ring_attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        ring_attention(q, q, q, sinks=torch.zeros(3))


def test_softcap_cost_on_cpu() -> None:
    """What soft-capping costs on CPU, where torch's fused op has no cap and the reference kernel runs:
    recorded, and bounded loosely (the measured figure is in the changelog)."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 512, 8, 64, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 512, 2, 64, generator=g) for _ in range(2))

    def step(softcap: float | None) -> float:
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        t0 = time.perf_counter()
        ring_attention(*xs, softcap=softcap).backward(dout)
        return time.perf_counter() - t0

    fused = min(step(None) for _ in range(3))
    capped = min(step(30.0) for _ in range(3))
    assert capped < 50 * fused, (capped, fused)


def ulysses_errors(ulysses_size: int, n: int, hq: int, hkv: int, d: int, per_row: bool) -> dict[str, float]:
    """Sinks and soft-capping through ``hf_ring.ring_attention`` on a Ulysses x ring grid (the sinks cut
    to each rank's heads), against float64; the sinks' gradient summed over the grid."""
    import hf_ring
    from hf_ring.parallel import reset_context_parallel

    world = torch.distributed.get_world_size()
    hf_ring.setup_context_parallel(world, ulysses_size=ulysses_size)
    try:
        g = torch.Generator().manual_seed(5)
        q, dout = (torch.randn(2, n, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
        q = q * 3.0
        snk = torch.randn(*((2, n) if per_row else ()), hq, generator=g, dtype=torch.float64)
        loc = [hf_ring.shard(t.float()).detach().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        loc_sinks = (hf_ring.shard(snk.float()) if per_row else snk.float()).detach().requires_grad_()
        out = hf_ring.ring_attention(*loc[:3], softcap=5.0, sinks=loc_sinks)
        out.backward(loc[3])
        got = [hf_ring.unshard(t) for t in (out, loc[0].grad, loc[1].grad, loc[2].grad)]
        if per_row:
            got.append(hf_ring.unshard(loc_sinks.grad))
        else:
            dsinks = loc_sinks.grad.double().clone()
            torch.distributed.all_reduce(dsinks)
            got.append(dsinks)
    finally:
        reset_context_parallel()
    xs = [t.float().double().requires_grad_() for t in (q, k, v, snk)]
    ref = attention(*xs[:3], True, softcap=5.0, sinks=xs[3])
    ref.backward(dout.float().double())
    return {name: rel_err(a, w) for name, a, w in zip(NAMES, got, [ref, *(t.grad for t in xs)])}


@pytest.mark.parametrize("per_row", [False, True], ids=["head_sinks", "row_sinks"])
@pytest.mark.parametrize("ulysses", [2, 4], ids=["U2xR2", "U4"])
def test_ulysses_grid_matches_float64(ulysses: int, per_row: bool) -> None:
    for r in run_ranks(4, ulysses_errors, ulysses, 40, 8, 2, 80, per_row):
        assert max(r.values()) <= 1e-5, r


def packed_model_errors(family: str, lengths: list[int]) -> dict[str, float]:
    """A packed row (position_ids restarting per document) of a model with sinks or soft-capping at
    CP = world, float64, against each document run alone in one process with eager attention;
    gradients averaged over the group as DDP would (the sinks' included)."""
    import hf_ring
    from testkit.families import tiny_config
    from testkit.models import cp_grad_error, documents_alone_loss
    from testkit.sweep_rank import build_model

    config = tiny_config(family)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), generator=g)
    labels = ids.clone()
    labels[0, 10:13] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ring, ref = (  # a config each: building a model sets its attention implementation on the config
        build_model(family, tiny_config(family), attn, 0, torch.float64).train() for attn in ("ring", "eager")
    )
    out = ring(**hf_ring.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions}))
    out.loss.backward()
    want = documents_alone_loss(ref, ids, labels, lengths)
    want.backward()
    return {"loss": abs(out.loss.item() - want.item()) / want.item(), "grads": cp_grad_error(ring, ref)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_packed_documents_model_step(family: str, world: int) -> None:
    for r in run_ranks(world, packed_model_errors, family, [9, 13, 5, 14]):
        assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cuda_kernels_with_sinks_and_softcap(dtype_name: str) -> None:
    """On a GPU (scripts/gpu_check.sh runs it): "auto" picks flash-attn with its own softcap for bf16
    where it is installed, the reference kernel otherwise; one process against float64 (fp32: 1e-5,
    bf16: within 2x of one-process bf16 eager attention)."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(2)
    n, hq, hkv, d = 256, 8, 2, 80
    q, dout = ((torch.randn(2, n, hq, d, generator=g, dtype=torch.float64) * s) for s in (3.0, 1.0))
    k, v = (torch.randn(2, n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    snk = torch.randn(hq, generator=g, dtype=torch.float64)

    def grads(fn, dt: torch.dtype, device: str) -> list[Tensor]:
        xs = [t.to(dtype).to(dt).to(device).requires_grad_() for t in (q, k, v, snk)]
        o = fn(*xs)
        o.backward(dout.to(dtype).to(dt).to(device))
        return [x.detach().cpu().double() for x in (o, *(t.grad for t in xs))]

    want = grads(lambda a, b, c, s: attention(a, b, c, True, softcap=5.0, sinks=s), torch.float64, "cpu")
    got = grads(lambda a, b, c, s: ring_attention(a, b, c, softcap=5.0, sinks=s), dtype, "cuda")
    if dtype == torch.float32:
        for name, a, w in zip(NAMES, got, want):
            assert rel_err(a, w) <= 1e-5, (name, rel_err(a, w))
        return
    eager = grads(lambda a, b, c, s: attention(a, b, c, True, softcap=5.0, sinks=s, dtype=dtype), dtype, "cuda")
    for name, a, e, w in zip(NAMES, got, eager, want):
        assert rel_err(a, w) <= 2 * rel_err(e, w) + 1e-3, (name, rel_err(a, w), rel_err(e, w))
