"""Packed documents through the ring: document schedules against a float64 oracle with a
block-diagonal causal mask, forward and all three gradients, P = 1..4, odd layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from hf_ring.ops.placement import balanced_placement
from hf_ring.ops.ring import ring_attention
from hf_ring.ops.schedule import document_schedule, placement_schedule
from hf_ring.ops.zigzag import shard, unshard
from testkit.oracle import attention, rel_err, visible
from testkit.spawn import run_ranks

CASES = {  # document lengths per batch row; N = 24 splits into 2P chunks for P = 1..4
    "shorter_than_2p": [[1, 2, 3, 1, 2, 1, 3, 4, 2, 5]],
    "one_chunk_each": [[3, 3, 3, 3, 3, 3, 3, 3]],  # P = 4: one document per zigzag chunk
    "spanning_ranks": [[3, 13, 2, 6]],
    "length_one_and_many_small": [[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 12]],
    "one_document": [[24]],
    "rows_differ": [[5, 11, 8], [12, 12]],
}


def lengths_to_starts(lengths: list[int]) -> list[int]:
    out, s = [], 0
    for n in lengths:
        out.append(s)
        s += n
    return out


def balanced_shards(
    starts: list[list[int]], n: int, size: int, rank: int, split_from: int | None = None
) -> tuple[Tensor, list]:
    """This rank's rows ([B, local] global indices, n for padding) and schedule, per-document zigzag."""
    placements = [balanced_placement(s, n, size, split_from) for s in starts]
    local = max(length for _, length in placements)
    index = torch.full((len(starts), local), n, dtype=torch.long)
    per_row = []
    for i, (placement, _) in enumerate(placements):
        rows = [j for seg in placement[rank] for j in range(seg.start, seg.stop)]
        index[i, : len(rows)] = torch.tensor(rows, dtype=torch.long)
        per_row.append(placement_schedule(placement, rank, (i, i + 1)))
    return index, [tuple(blk for row in per_row for blk in row[step]) for step in range(size)]


def kernel_for(backend: str) -> str | object:
    """A backend name, or ``flash_attn:<version>``: FlashAttnKernel over a stand-in (varlen calls)."""
    if backend.startswith("flash_attn:"):
        from testkit.cuda_standins import make_kernel

        return CountingKernel(make_kernel(backend))
    return backend


class CountingKernel:
    """A kernel that counts its dense and varlen calls (forward and backward)."""

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, {"dense": 0, "varlen": 0}
        self.name, self.heads_major = inner.name, inner.heads_major
        self.varlen = getattr(inner, "varlen", False)

    def forward(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.calls["dense"] += 1
        return self.inner.forward(*a, **kw)

    def backward(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.calls["dense"] += 1
        return self.inner.backward(*a, **kw)

    def varlen_forward(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.calls["varlen"] += 1
        return self.inner.varlen_forward(*a, **kw)

    def varlen_backward(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.calls["varlen"] += 1
        return self.inner.varlen_backward(*a, **kw)


def balanced_errors(
    case: str, hq: int, hkv: int, d: int, split_from: int | None = None, backend: str = "auto"
) -> dict[str, float]:
    """The per-document zigzag layout (shard_batch's for packed batches) against float64; with a
    counting kernel, also its ``dense_calls``/``varlen_calls`` and the schedule's ``steps``."""
    size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    lengths = CASES[case]
    n = sum(lengths[0])
    starts = [lengths_to_starts(x) for x in lengths]
    g = torch.Generator().manual_seed(7)
    b = len(lengths)
    q, dout = (torch.randn(b, n, hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, generator=g) for _ in range(2))
    index, sched = balanced_shards(starts, n, size, rank, split_from)

    def take(t: Tensor) -> Tensor:
        full = torch.cat((t, t.new_zeros(t.shape[0], 1, *t.shape[2:])), dim=1)
        return full.gather(1, index[..., None, None].expand(-1, -1, *t.shape[2:])).contiguous()

    loc = [take(t).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    kernel = kernel_for(backend)
    out = ring_attention(*loc[:3], schedule=sched, backend=kernel)
    out.backward(loc[3])
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention(*ref_in, True, starts=starts)
    ref.backward(dout.double())
    errs = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in loc[:3])),
                               (ref, *(t.grad for t in ref_in))):  # fmt: skip
        real = index < n
        got_r, want_r = got[real].double(), take(want.detach())[real]
        # a rank may hold only one-token documents, whose exact dq is 0: judge those absolutely
        errs[name] = rel_err(got_r, want_r) if want_r.norm() > 1e-9 else float(got_r.norm())
    # dk, dv of a row are complete only after the ring: compare the gathered whole
    grads = zip(("dq_all", "dk_all", "dv_all"), (t.grad for t in loc[:3]), (t.grad for t in ref_in))
    for name, got, want in grads:
        full = torch.zeros(b, n + 1, *got.shape[2:], dtype=torch.float64)
        parts = [torch.empty_like(got) for _ in range(size)]
        torch.distributed.all_gather(parts, got.contiguous())
        for r, part in enumerate(parts):
            idx_r = balanced_shards(starts, n, size, r, split_from)[0]
            full.scatter_(1, idx_r[..., None, None].expand_as(part), part.double())
        errs[name] = rel_err(full[:, :n], want)
    if isinstance(kernel, CountingKernel):
        errs.update(dense_calls=kernel.calls["dense"], varlen_calls=kernel.calls["varlen"], steps=len(sched))
    return errs


@pytest.mark.parametrize("split_from", [1, 6], ids=["split_all", "short_ones_whole"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", ["shorter_than_2p", "spanning_ranks", "length_one_and_many_small", "rows_differ"])
def test_per_document_layout_matches_float64(world: int, case: str, split_from: int) -> None:
    """Every document cut in 2P pieces, or only those of 6 tokens or more (the shorter ones fill the
    ranks whole, cut only where they cross from one rank to the next)."""
    for r in run_ranks(world, balanced_errors, case, 6, 2, 80, split_from):
        assert max(r.values()) <= 1e-5, r


def documents_errors(case: str, dtype_name: str, hq: int, hkv: int, d: int) -> dict[str, float]:
    dtype = getattr(torch, dtype_name)
    size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    lengths = CASES[case]
    n = sum(lengths[0])
    assert n % (2 * size) == 0 and all(sum(x) == n for x in lengths)
    starts = [lengths_to_starts(x) for x in lengths]
    b = len(lengths)
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(b, n, hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, generator=g) for _ in range(2))
    loc = [shard(t.to(dtype), dim=1).detach().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    sched = document_schedule(starts, n, rank, size)
    out = ring_attention(*loc[:3], schedule=sched)
    out.backward(loc[3])
    got = [unshard(t, dim=1) for t in (out, loc[0].grad, loc[1].grad, loc[2].grad)]
    # float64 oracle and its gradients
    ref_in = [t.double().requires_grad_() for t in (q.to(dtype), k.to(dtype), v.to(dtype))]
    mask = visible(n, starts=starts)[:, None]  # [B, 1, N, N]
    ref = attention(*ref_in, mask=mask)
    ref.backward(dout.to(dtype).double())
    want = [ref, *(t.grad for t in ref_in)]
    errs = {name: rel_err(a, w) for name, a, w in zip(("out", "dq", "dk", "dv"), got, want)}
    # the same-dtype single-device yardstick: SDPA with the document mask
    yq, yk, yv = (t.to(dtype).detach().requires_grad_() for t in (q, k, v))
    rep = hq // hkv
    y = F.scaled_dot_product_attention(
        yq.transpose(1, 2), yk.repeat_interleave(rep, 2).transpose(1, 2), yv.repeat_interleave(rep, 2).transpose(1, 2),
        attn_mask=mask,
    ).transpose(1, 2)
    y.backward(dout.to(dtype))
    yard = [y, yq.grad, yk.grad, yv.grad]
    errs.update({f"sdpa_{name}": rel_err(a, w) for name, a, w in zip(("out", "dq", "dk", "dv"), yard, want)})
    return errs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_document_ring_matches_float64_fp32(world: int, case: str) -> None:
    for r in run_ranks(world, documents_errors, case, "float32", 6, 2, 80):
        assert max(r[k] for k in ("out", "dq", "dk", "dv")) <= 1e-5, r


@pytest.mark.parametrize("world", [2, 4])
def test_document_ring_bf16_within_twice_sdpa(world: int) -> None:
    for r in run_ranks(world, documents_errors, "spanning_ranks", "bfloat16", 4, 2, 16):
        for k in ("out", "dq", "dk", "dv"):
            assert r[k] <= 2 * r[f"sdpa_{k}"] + 1e-3, (k, r)


@pytest.mark.parametrize("version", ["2.8-custom-op", "2.7-plain"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", ["shorter_than_2p", "spanning_ranks", "length_one_and_many_small", "rows_differ"])
def test_documents_through_flash_attn_varlen(world: int, case: str, version: str) -> None:
    """flash-attn's varlen functions (stand-ins with the real signatures and checks): every step's
    document blocks in at most two calls (causal, unmasked), forward and backward, no dense call;
    exact against float64 with GQA and head_dim 80 (padded to 88 for the op). dQ is judged gathered: a
    rank holding only 1-3 token documents has a near-zero dQ whose relative error measures the
    stand-in's float32 cancellation (1.1e-5 with dense calls too)."""
    for r in run_ranks(world, balanced_errors, case, 6, 2, 80, 1, f"flash_attn:{version}"):
        assert max(r[k] for k in ("out", "dq_all", "dk_all", "dv_all")) <= 1e-5, r
        assert r["dense_calls"] == 0 and 0 < r["varlen_calls"] <= 2 * 2 * r["steps"], r


def test_flash_attn_26_documents_fall_back_to_dense_calls() -> None:
    """flash-attn 2.6 (one window_size tuple): no varlen calls, still exact."""
    (r,) = run_ranks(1, balanced_errors, "spanning_ranks", 4, 2, 16, 1, "flash_attn:2.6")
    assert max(r[k] for k in ("out", "dq", "dk", "dv")) <= 1e-5, r
    assert r["varlen_calls"] == 0 and r["dense_calls"] > 0, r


def test_chunk_pairs_without_a_shared_document_make_no_call() -> None:
    """Four documents of one chunk each (P = 2): only the diagonal blocks remain."""
    sched = [document_schedule([[0, 4, 8, 12]], 16, r, 2) for r in range(2)]
    calls = [sum(len(s) for s in steps) for steps in sched]
    assert calls == [2, 2]  # each rank: its two chunks, causal, at step 0; nothing at step 1
    assert all(len(steps[1]) == 0 for steps in sched)


# --- through a model -----------------------------------------------------------------------------

DOCS = [1, 5, 30, 14, 7, 3, 2]  # packed into one row of 62 tokens; CP = 3 pads it to 66


def packed_step_errors(lora: bool, chunked: bool) -> dict[str, float]:
    """A packed row (position_ids restarting per document, DataCollatorWithFlattening style) at
    CP = world against each document run alone in one process; CP-averaged gradients."""
    import hf_ring
    from testkit.models import cp_grad_error, documents_alone_loss, tiny_model

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (1, sum(DOCS)), generator=g)
    labels = ids.clone()
    labels[0, 10:13] = -100
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]

    def build(attn: str) -> torch.nn.Module:
        model = tiny_model("qwen3", attn)
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(5)
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        return model

    ring, ref = build("ring"), build("sdpa")
    if chunked:
        hf_ring.enable_chunked_loss(ring)
    out = ring(**hf_ring.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions}))
    out.loss.backward()
    want = documents_alone_loss(ref, ids, labels, DOCS)
    want.backward()
    worst = cp_grad_error(ring, ref)
    return {"loss": abs(out.loss.item() - want.item()) / want.item(), "grads": worst}


@pytest.mark.parametrize(("lora", "chunked"), [(False, False), (True, False), (False, True)])
def test_packed_step_equals_each_document_alone(lora: bool, chunked: bool) -> None:
    for r in run_ranks(3, packed_step_errors, lora, chunked):
        assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r


def test_positions_that_jump_elsewhere_raise() -> None:
    import hf_ring

    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 5, 6, 0, 1, 2]])}
    with pytest.raises(ValueError, match="restart at 0"):
        hf_ring.shard_batch(batch)


def test_packed_positions_without_shard_batch_run_as_one_process() -> None:
    """Restarting ``position_ids`` without ``shard_batch``: transformers' own packed-document mask, as SDPA
    applies it (each document alone)."""
    from testkit.models import tiny_model

    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    got = tiny_model("llama", "ring")(input_ids=ids, position_ids=positions, use_cache=False).logits
    alone = tiny_model("llama", "sdpa")
    want = torch.cat([alone(input_ids=ids[:, :3]).logits, alone(input_ids=ids[:, 3:]).logits], 1)
    torch.testing.assert_close(got, want)  # (with a KV cache transformers reads no documents, under SDPA too)


def test_cu_seq_lens_give_the_same_batch_as_position_ids() -> None:
    import hf_ring

    ids = torch.arange(8)[None]
    a = hf_ring.shard_batch({"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])})
    b = hf_ring.shard_batch({"input_ids": ids, "labels": ids, "cu_seq_lens_q": torch.tensor([0, 3, 5, 8]),
                             "cu_seq_lens_k": torch.tensor([0, 3, 5, 8]), "max_length_q": 3, "max_length_k": 3})
    assert torch.equal(a["position_ids"], b["position_ids"]) and torch.equal(a["shift_labels"], b["shift_labels"])
    assert a["shift_labels"].tolist() == [[1, 2, -100, 4, -100, 6, 7, -100]]  # no target crosses a boundary
    assert a["ring_context"].schedule is not None


def packed_unshard_roundtrip() -> bool:
    import hf_ring

    ids = torch.arange(1, 24)[None]  # 23 tokens: the per-document layout pads some ranks by a row
    positions = torch.cat([torch.arange(n) for n in (5, 1, 12, 5)])[None]
    kwargs = hf_ring.shard_batch({"input_ids": ids, "position_ids": positions})
    return torch.equal(kwargs["ring_context"].unshard(kwargs["input_ids"]), ids)


def test_context_unshard_restores_a_packed_batch() -> None:
    assert all(run_ranks(3, packed_unshard_roundtrip))


def test_right_padding_positions_do_not_start_documents() -> None:
    """Collators give padding arbitrary positions (0 or 1 here): they continue the last document."""
    import hf_ring

    ids = torch.arange(1, 9)[None]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    for pad_pos in (0, 1):
        positions = torch.tensor([[0, 1, 2, 0, 1, pad_pos, pad_pos, pad_pos]])
        out = hf_ring.shard_batch({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
        assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
