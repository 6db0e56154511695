"""Sliding windows and chunked attention through the ring and the border exchange, against a float64
oracle: out and dq/dk/dv at P = 1..4, one sequence and packed documents, Ulysses 2 x ring 2, GQA,
head_dim 80, lengths that the layout pads; bf16 within 2x of one-process bf16; the plans themselves
(no call outside the band, fewer ring steps, border traffic flat in N)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from hf_ring.ops.attention_call import AttentionCall
from hf_ring.ops.kernels import ReferenceKernel, TorchCPUKernel, band_mask
from hf_ring.ops.layout import ShardLayout, sequence_layout
from hf_ring.ops.ulysses import ulysses_ring_attention
from hf_ring.ops.windows import mask_plan, masked_attention
from testkit.flash_blocks import packed_layout
from testkit.grouped import grouped_attention
from testkit.oracle import attention, visible
from testkit.spawn import run_ranks

N = 48  # one sequence: 2P chunks for P = 1..4 (and 2 x U x R for U = R = 2)
DOCS = [[7, 1, 20, 13, 5], [29, 17]]  # packed, two rows that differ; 46 tokens: the layout pads
# short documents only (none is cut into 2P pieces): a rank needs only its neighbour's keys, so the
# ring stops after 2 of P steps and the dK/dV accumulators jump straight home
SHORT_DOCS = [[2, 1, 2, 2, 1, 2, 2, 2, 1, 2, 2, 1, 2, 2, 2, 1, 2, 2, 1, 2] * 3]  # 99 tokens, none >= N / 8P


def rel_err(x: Tensor, ref: Tensor) -> float:
    """``|x - ref| / max(|ref|, 1)``: relative, and absolute for gradients that are exactly 0 (a window
    of one key: every score's gradient vanishes)."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm()) / max(float(ref.norm()), 1.0)


def allowed(layout: ShardLayout, batch: int, window: int | None, chunk: int | None) -> Tensor:
    """``[B, N, N]`` bool: key j visible to query i (same document, j <= i, in the window and chunk)."""
    starts = [layout.starts[b if len(layout.starts) > 1 else 0] for b in range(batch)]
    return visible(layout.n, window=window, starts=starts, chunk=chunk)


def _groups(ulysses: int) -> tuple:
    """(Ulysses group, ring group) of this rank on a grid of ``world / ulysses`` ring positions."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = [None, None]
    for r0 in range(0, world, ulysses):
        g = dist.new_group(list(range(r0, r0 + ulysses)))
        if r0 <= rank < r0 + ulysses:
            mine[0] = g
    for u in range(ulysses):
        g = dist.new_group(list(range(u, world, ulysses)))
        if rank % ulysses == u:
            mine[1] = g
    return mine[0], mine[1]


def mask_errors(
    packed: bool, masks: list[tuple], hq: int, hkv: int, d: int, ulysses: int = 1, dtype: str = "float64",
    tile: int | None = None, softcap: float = 0.0, sinks: str | None = None, head_groups: int = 1,
    functional: bool = False,
) -> list[dict]:  # fmt: skip
    """For every ``(window, chunk, route)`` of ``masks``: this rank's errors against float64 (out on its
    real rows, dq/dk/dv gathered whole), the route taken, the ring steps and the rows sent. ``tile``:
    band tiles of that many query rows (``schedule.TILE``). ``softcap``: logit soft-capping;
    ``sinks``: ``"head"`` (one logit per query head) or ``"row"`` (one per row and head), with their
    gradient (``dsinks``: summed over the ranks, or gathered whole). ``head_groups``: the ops' head
    groups; ``functional``: the same groups one after the other through ``AttentionCall.forward`` /
    ``backward`` (the tiled layer's path, ``testkit.grouped``)."""
    from hf_ring.ops import schedule

    saved = schedule.TILE
    schedule.TILE = tile or saved
    try:
        return _mask_errors(packed, masks, hq, hkv, d, ulysses, dtype, softcap, sinks, head_groups, functional)
    finally:
        schedule.TILE = saved


def _mask_errors(
    packed: bool, masks: list[tuple], hq: int, hkv: int, d: int, ulysses: int, dtype: str, softcap: float = 0.0,
    sinks: str | None = None, head_groups: int = 1, functional: bool = False,
) -> list[dict]:  # fmt: skip
    world, rank = dist.get_world_size(), dist.get_rank()
    ring = world // ulysses
    docs = SHORT_DOCS if packed == "short" else DOCS
    layout = packed_layout(docs, ring, ulysses) if packed else sequence_layout(N, ring, ulysses)
    b = len(docs) if packed else 2
    n = layout.n
    groups = _groups(ulysses) if ulysses > 1 else (None, None)
    g = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(b, n, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    sink = None
    if sinks is not None:  # logits of the size of the scores' (some rows lean on the sink, some not)
        sink = torch.randn(hq, generator=g, dtype=torch.float64) if sinks == "head" else None
        sink = 2 * torch.randn(b, n, hq, generator=g, dtype=torch.float64) if sinks == "row" else sink
    index = layout.index(b)  # [P, B, local], n for padding rows
    real = index[rank] < n

    def take(t: Tensor, r: int = rank) -> Tensor:
        full = torch.cat((t, t.new_zeros(t.shape[0], 1, *t.shape[2:])), dim=1)
        return full.gather(1, index[r][..., None, None].expand(-1, -1, *t.shape[2:])).contiguous()

    dt = getattr(torch, dtype)
    results = []
    for window, chunk, route in masks:
        plan = mask_plan(layout, b, rank // ulysses, window=window, chunk=chunk, route=route)
        loc = [take(t).to(dt).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        extra: dict = {"softcap": softcap or None}
        if sink is not None:
            extra["sinks"] = (
                (sink.clone() if sink.dim() == 1 else take(sink[..., None])[..., 0]).to(dt).requires_grad_()
            )
        if functional:
            call = AttentionCall(group=groups[1], ulysses_group=groups[0], ulysses=ulysses > 1, plan=plan,
                                 softcap=extra["softcap"])  # fmt: skip
            out = grouped_attention(call, *loc[:3], extra.get("sinks"), head_groups)
        elif ulysses > 1:
            out = ulysses_ring_attention(*loc[:3], ulysses_group=groups[0], ring_group=groups[1], mask=plan,
                                         head_groups=head_groups, **extra)  # fmt: skip
        else:
            out = masked_attention(*loc[:3], plan, head_groups=head_groups, **extra)
        out.backward(loc[3])
        mask = allowed(layout, b, window, chunk)
        ref_in = [t.to(dt).double().clone().requires_grad_() for t in (q, k, v)]
        ref_sink = None if sink is None else sink.to(dt).double().clone().requires_grad_()
        ref = attention(*ref_in, mask=mask, softcap=softcap, sinks=ref_sink)
        ref.backward(dout.to(dt).double())
        errs = {"out": rel_err(out[real], take(ref.detach())[real])}
        if ref_sink is not None and sink.dim() == 1:  # each rank's rows' share, summed over the group
            got = extra["sinks"].grad.double().clone()
            dist.all_reduce(got)
            errs["dsinks"] = rel_err(got, ref_sink.grad)
        elif ref_sink is not None:
            got = extra["sinks"].grad[..., None]  # [B, S, Hq, 1]: gathered as the gradients below
            parts = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(parts, got.contiguous())
            full = torch.zeros(b, n + 1, hq, 1, dtype=torch.float64)
            for r, part in enumerate(parts):
                full.scatter_(1, index[r][..., None, None].expand_as(part), part.double())
            errs["dsinks"] = rel_err(full[:, :n, :, 0], ref_sink.grad)
        for name, got, want in zip(("dq", "dk", "dv"), (t.grad for t in loc[:3]), (t.grad for t in ref_in)):
            parts = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(parts, got.contiguous())
            full = torch.zeros(b, n + 1, *got.shape[2:], dtype=torch.float64)
            for r, part in enumerate(parts):
                full.scatter_(1, index[r][..., None, None].expand_as(part), part.double())
            errs[name] = rel_err(full[:, :n], want)
        if dtype != "float64":  # the one-process yardstick: SDPA in the same dtype with the same mask
            yq, yk, yv = (t.to(dt).detach().requires_grad_() for t in (q, k, v))
            rep = hq // hkv
            y = F.scaled_dot_product_attention(
                yq.transpose(1, 2), yk.repeat_interleave(rep, 2).transpose(1, 2),
                yv.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=mask[:, None],
            ).transpose(1, 2)  # fmt: skip
            y.backward(dout.to(dt))
            errs["yard_out"] = rel_err(y, ref)
            for name, got, want in zip(("dq", "dk", "dv"), (yq.grad, yk.grad, yv.grad), (t.grad for t in ref_in)):
                errs[f"yard_{name}"] = rel_err(got, want)
        steps = len(plan.schedule) if plan.schedule is not None else 0
        results.append({"mask": (window, chunk, route), "route": plan.route, "steps": steps,
                        "sent": plan.sent_rows, **errs})  # fmt: skip
    return results


def window_masks(ring: int, n: int = N) -> list[tuple]:
    """Windows of 1, shorter than a zigzag chunk, equal to one, spanning several, longer than the
    sequence; each by the automatic route and, with a ring, by both routes."""
    c = n // (2 * ring)
    routes = ("auto", "ring", "border") if ring > 1 else ("auto",)
    return [(w, None, r) for w in (1, max(2, c // 2), c, 3 * c + 1, n + 5) for r in routes]


def chunk_masks(ring: int, n: int = N) -> list[tuple]:
    """Chunks of 5 and 7 (across the rank boundaries), one zigzag chunk, several, longer than N; and a
    window together with a chunk."""
    c = n // (2 * ring)
    routes = ("auto", "ring", "border") if ring > 1 else ("auto",)
    return [(None, ch, r) for ch in (5, 7, c, 3 * c + 1, n + 5) for r in routes] + [(4, 9, "auto")]


def _check(results: list[dict], tol: float = 1e-5) -> None:
    for r in results:
        worst = max(r[k] for k in ("out", "dq", "dk", "dv", "dsinks") if k in r)
        assert worst <= tol, r


@pytest.mark.parametrize("packed", [False, True], ids=["sequence", "packed"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_windows_match_float64(world: int, packed: bool) -> None:
    """GQA (6 query heads over 2), head_dim 80."""
    for rank_results in run_ranks(world, mask_errors, packed, window_masks(world), 6, 2, 80):
        _check(rank_results)
        for r in rank_results:
            w, _, route = r["mask"]
            if route == "auto" and world > 1:
                assert r["route"] == ("border" if w - 1 <= N // (2 * world) else "ring"), r


@pytest.mark.parametrize("packed", [False, True], ids=["sequence", "packed"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_chunked_attention_matches_float64(world: int, packed: bool) -> None:
    for rank_results in run_ranks(world, mask_errors, packed, chunk_masks(world), 4, 4, 16):
        _check(rank_results)


@pytest.mark.parametrize("packed", [False, True], ids=["sequence", "packed"])
def test_ulysses_2_x_ring_2(packed: bool) -> None:
    masks = [m for m in window_masks(2) + chunk_masks(2) if m[2] != "ring" or m[0] == 3]
    for rank_results in run_ranks(4, mask_errors, packed, masks, 4, 2, 16, 2):
        _check(rank_results)


@pytest.mark.parametrize("packed", [False, True], ids=["sequence", "packed"])
def test_band_tiles_match_float64(packed: bool) -> None:
    """Long bands cut into tiles of 3 query rows (``schedule.TILE``), on both routes, P = 3."""
    masks = [(w, None, r) for w in (2, 5, 11) for r in ("ring", "border")] + [(4, 9, "border")]
    for rank_results in run_ranks(3, mask_errors, packed, masks, 4, 2, 16, 1, "float64", 3):
        _check(rank_results)


@pytest.mark.parametrize("world", [3, 4])
def test_short_ring_schedules_match_float64(world: int) -> None:
    """Short documents: the ring route's schedule ends early -- after 2 of 4 steps (the last dK/dV hop
    goes 3 places on, straight to the owner), after 1 of 3 (no document crosses a rank: no hop)."""
    masks = [(w, None, "ring") for w in (2, 3)] + [(None, 2, "ring")]
    for rank_results in run_ranks(world, mask_errors, "short", masks, 4, 2, 16):
        _check(rank_results)
        assert all(r["steps"] == (2 if world == 4 else 1) for r in rank_results), rank_results


def extras_masks(ring: int) -> list[tuple]:
    """Windows shorter than a zigzag chunk and spanning several, on both routes, and a window with a
    chunk: the cases where the cap and the sinks meet the band blocks, the halo and the ring."""
    c = N // (2 * ring)
    return [(w, None, r) for w in (max(2, c // 2), 3 * c + 1) for r in ("ring", "border")] + [(4, 9, "auto")]


@pytest.mark.parametrize(
    ("world", "packed", "sinks"),
    [(2, False, "head"), (3, False, "head"), (3, True, "head"), (2, True, "row"), (3, False, "row")],
)
def test_windows_with_sinks_match_float64(world: int, packed: bool, sinks: str) -> None:
    """GPT-OSS's sliding layers: a window with attention sinks (per head, or per row), both routes,
    GQA 6 over 2, head_dim 80; the sinks' gradient too."""
    for rank_results in run_ranks(world, mask_errors, packed, extras_masks(world), 6, 2, 80, sinks=sinks):
        _check(rank_results)
        assert all("dsinks" in r for r in rank_results)


@pytest.mark.parametrize(("world", "packed"), [(2, False), (3, False), (3, True)])
def test_windows_with_softcap_match_float64(world: int, packed: bool) -> None:
    """Gemma 2's sliding layers: a window with logit soft-capping (a cap of 2 on scores of size ~1-4,
    so the cap bends them), both routes; with sinks too in the packed case."""
    sinks = "head" if packed else None
    for rank_results in run_ranks(world, mask_errors, packed, extras_masks(world), 6, 2, 80, softcap=2.0, sinks=sinks):
        _check(rank_results)


def test_ulysses_windows_with_sinks_and_softcap() -> None:
    """Ulysses 2 x ring 2: the sinks cut to each rank's heads (per head) or moved with the rows (per row)."""
    for sinks in ("head", "row"):
        for rank_results in run_ranks(4, mask_errors, True, extras_masks(2), 4, 2, 16, 2, softcap=3.0, sinks=sinks):
            _check(rank_results)


def test_bf16_within_2x_of_one_process() -> None:
    c = N // 4
    masks = [(c // 2, None, "auto"), (3 * c + 1, None, "auto"), (None, 7, "auto")]
    for rank_results in run_ranks(2, mask_errors, False, masks, 4, 2, 16, 1, "bfloat16"):
        for r in rank_results:
            for name in ("out", "dq", "dk", "dv"):
                assert r[name] <= 2 * r[f"yard_{name}"] + 1e-3, (name, r)


# ------------------------------------------------------------------------------------------------
# the plans, on one process


@pytest.mark.parametrize("tile", [256, 2])
@pytest.mark.parametrize("window", [1, 3, 6, 7, 13, 30])
@pytest.mark.parametrize("ring", [2, 3, 4])
def test_ring_plan_covers_the_band_exactly(ring: int, window: int, tile: int, monkeypatch) -> None:
    """Every visible (query, key) pair is in exactly one call, no call holds a pair outside the band
    except masked by its own band, and the ring stops after the last step any rank needs (also with
    bands cut into tiles of ``max(W, tile)`` query rows)."""
    monkeypatch.setattr("hf_ring.ops.schedule.TILE", tile)
    layout = sequence_layout(N, ring)
    want = allowed(layout, 1, window, None)[0]
    index = layout.index(1)[:, 0]  # [P, local]
    seen = torch.zeros(N, N, dtype=torch.long)
    plans = [mask_plan(layout, 1, r, window=window, route="ring") for r in range(ring)]
    steps = {len(p.schedule) for p in plans}
    assert len(steps) == 1
    for r, plan in enumerate(plans):
        for s, blocks in enumerate(plan.schedule):
            src = (r - s) % ring
            for blk in blocks:
                qi, ki = index[r][slice(*blk.q)], index[src][slice(*blk.kv)]
                vis = torch.ones(len(qi), len(ki), dtype=torch.bool)
                if blk.causal:
                    vis = vis.tril()
                if blk.window is not None:
                    assert min(blk.window) >= 0
                    vis &= band_mask(len(qi), len(ki), blk.window)
                assert vis.any(1).all(), "a query row of a call sees no key"
                assert want[qi[:, None], ki[None, :]][vis].all(), "a call attends outside the band"
                seen[qi[:, None], ki[None, :]] += vis.long()
    assert torch.equal(seen, want.long())
    last = max(s for p in plans for s, blocks in enumerate(p.schedule) if blocks)
    assert steps == {last + 1}
    if window <= N // (2 * ring) and ring > 2:
        # a short window needs the neighbours' chunks only: steps 0, 1 and P - 1
        assert all(not blocks for p in plans for blocks in p.schedule[2 : ring - 1])


def test_border_traffic_is_flat_in_n() -> None:
    """The border route sends W - 1 rows per run whatever the sequence length; the ring sends O(N)."""
    sent = {}
    for n in (256, 1024, 4096):
        plan = mask_plan(sequence_layout(n, 4), 1, 1, window=17)
        assert plan.route == "border"
        sent[n] = plan.sent_rows
    assert len(set(sent.values())) == 1 and sent[256] <= 2 * 16, sent


@pytest.mark.parametrize("kernel", ["torch", "flash_attn:2.8-custom-op"])
@pytest.mark.parametrize("window", [(0, 0), (2, 1), (4, 0), (0, 3)])
def test_kernels_take_a_band(kernel: str, window: tuple[int, int]) -> None:
    """The CPU kernel (additive mask) and flash-attn's call contract (its window_size, through the
    stand-in) against the reference kernel, forward and backward, Sq != Sk."""
    if kernel.startswith("flash_attn"):
        from testkit.cuda_standins import make_kernel

        k_impl, dt = make_kernel(kernel), torch.float32
    else:
        k_impl, dt = TorchCPUKernel(), torch.float64
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 6, 4, 16, generator=g, dtype=dt) for _ in range(2))
    k, v = (torch.randn(2, 9, 2, 16, generator=g, dtype=dt) for _ in range(2))
    ref = ReferenceKernel()
    o_ref, l_ref = ref.forward(q.double(), k.double(), v.double(), causal=False, scale=0.25, window=window)
    o, lse = k_impl.forward(q, k, v, causal=False, scale=0.25, window=window)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(lse, l_ref) < 1e-5
    g_ref = ref.backward(dout.double(), q.double(), k.double(), v.double(), o_ref, l_ref, causal=False, scale=0.25,
                         window=window)  # fmt: skip
    grads = k_impl.backward(dout, q, k, v, o.to(dt), lse, causal=False, scale=0.25, window=window)
    for a, w in zip(grads, g_ref):  # one key per row ((0, 0)): dq is 0, judged absolutely
        assert float((a.double() - w).norm()) <= 1e-5 * max(float(w.norm()), 1.0)


# ------------------------------------------------------------------------------------------------
# through a model: packed documents, Ulysses x ring

MODEL_DOCS = [1, 5, 30, 14, 7, 3, 2]  # one packed row of 62 tokens


def packed_window_step_errors(family: str, ulysses: int, overrides: dict) -> dict[str, float]:
    """A packed row (positions restarting per document) through a windowed or chunked model at
    CP = world (``ulysses``: its Ulysses degree) against each document alone in one process (float64
    SDPA): the loss and the CP-averaged gradients."""
    import hf_ring
    from testkit.models import cp_grad_error, documents_alone_loss, tiny_model

    world = dist.get_world_size()
    if ulysses > 1:
        hf_ring.setup_context_parallel(world, ulysses_size=ulysses)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (1, sum(MODEL_DOCS)), generator=g)
    labels = ids.clone()
    labels[0, 10:13] = -100
    positions = torch.cat([torch.arange(n) for n in MODEL_DOCS])[None]
    ring, ref = tiny_model(family, "ring", **overrides), tiny_model(family, "sdpa", torch.float64, **overrides)
    out = ring(**hf_ring.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions}))
    out.loss.backward()
    want = documents_alone_loss(ref, ids, labels, MODEL_DOCS)
    want.backward()
    return {"loss": abs(out.loss.item() - want.item()) / want.item(), "grads": cp_grad_error(ring, ref)}


WINDOWED_MODELS = {
    "qwen2-window-6": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "mistral-window-20": ("mistral", dict(sliding_window=20)),
}


@pytest.mark.parametrize(("world", "ulysses"), [(3, 1), (4, 2)], ids=["ring3", "U2xR2"])
@pytest.mark.parametrize("model", list(WINDOWED_MODELS))
def test_packed_windowed_model_equals_each_document_alone(model: str, world: int, ulysses: int) -> None:
    family, overrides = WINDOWED_MODELS[model]
    for r in run_ranks(world, packed_window_step_errors, family, ulysses, overrides):
        assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r
