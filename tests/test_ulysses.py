"""Ulysses and Ulysses x ring attention against float64 attention on the unsharded sequence (gloo
ranks), the hybrid layout, the model-level step against one process (also with packed documents),
the planner's communication terms and the errors."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_ring
from hf_ring.ops import ulysses as ops_ulysses
from hf_ring.ops.zigzag import hybrid, hybrid_multiple
from testkit.models import lora_model, train_step
from testkit.oracle import attention, rel_err
from testkit.spawn import run_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NAMES = ("out", "dq", "dk", "dv")


def _grads(fn, xs: list[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    """``[fn(*xs), *d(fn)/d(xs)]`` for the upstream gradient ``dout``."""
    xs = [x.detach().requires_grad_() for x in xs]
    out = fn(*xs)
    return [out, *torch.autograd.grad(out, xs, dout.to(out.dtype))]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True).transpose(1, 2)


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("size,ulysses", [(4, 1), (4, 2), (4, 4), (6, 3), (6, 2), (8, 2)])
def test_hybrid_layout_is_zigzag_over_the_ring_then_contiguous(size: int, ulysses: int) -> None:
    """Rank ``r * U + u`` holds piece ``u`` of ring position ``r``'s zigzag shard; the pieces of all
    ranks cover the sequence once, and each ring position's pieces laid end to end are its shard."""
    ring = size // ulysses
    n = hybrid_multiple(size, ulysses) * 3
    x = torch.arange(n)
    pieces = [hybrid(x, 0, size, rank, ulysses) for rank in range(size)]
    assert sorted(torch.cat(pieces).tolist()) == list(range(n))
    c = n // (2 * ring)
    for r in range(ring):
        whole = torch.cat(pieces[r * ulysses : (r + 1) * ulysses])
        assert whole.tolist() == [*range(r * c, (r + 1) * c), *range((2 * ring - 1 - r) * c, (2 * ring - r) * c)]


def test_kv_replication_is_the_fewest_copies_that_split() -> None:
    assert [ops_ulysses.kv_replication(h, 4) for h in (1, 2, 3, 4, 6, 8)] == [4, 2, 4, 1, 2, 1]
    assert ops_ulysses.kv_replication(2, 3) == 3 and ops_ulysses.kv_replication(6, 3) == 1


# ----------------------------------------------------------------------------------- attention op
def ulysses_errors(cases: list[dict], ulysses_size: int, direct: bool = False) -> list[dict]:
    """On every rank: CP over the world with ``ulysses_size``; each case through ``hf_ring.shard``
    (the hybrid layout), ``hf_ring.ring_attention`` (which routes to Ulysses) and ``hf_ring.unshard``;
    rank 0's relative errors of the output and all gradients against float64, with single-device
    SDPA in the same dtype as a baseline. ``direct``: call the op with ``ulysses_group=None`` (the
    world) and no ring instead (pure Ulysses only)."""
    world = dist.get_world_size()
    cp = hf_ring.setup_context_parallel(world, ulysses_size=ulysses_size)
    results = []
    for c in cases:
        g = torch.Generator().manual_seed(c["seed"])
        b, n, hq, hkv, d = c["B"], c["N"], c["Hq"], c["Hkv"], c["D"]
        dtype = DTYPES[c["dtype"]]
        q = torch.randn(b, n, hq, d, generator=g, dtype=torch.float64)
        k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
        dout = torch.randn(b, n, hq, d, generator=g, dtype=torch.float64)
        causal = c["causal"]
        ref = _grads(partial(attention, causal=causal), [q, k, v], dout)
        sdpa = _grads(partial(_sdpa, causal=causal), [x.to(dtype) for x in (q, k, v)], dout)
        if direct:
            fn = partial(ops_ulysses.ulysses_ring_attention, ulysses_group=None, causal=causal, validate=True)
        else:
            fn = partial(hf_ring.ring_attention, causal=causal, validate=True)
        got = _grads(fn, [hf_ring.shard(x.to(dtype)) for x in (q, k, v)], hf_ring.shard(dout))
        assert got[0].shape == (b, n // world, hq, d)
        assert all(x.dtype == dtype for x in got)
        got = [hf_ring.unshard(x) for x in got]
        if cp.cp_rank == 0:
            results.append(
                {
                    **c,
                    **{f"uly_{m}": rel_err(x, r) for m, x, r in zip(NAMES, got, ref)},
                    **{f"sdpa_{m}": rel_err(x, r) for m, x, r in zip(NAMES, sdpa, ref)},
                }
            )
    return results


def make_cases(world: int, ulysses: int, dtype: str, heads: tuple, chunk: int = 5) -> list[dict]:
    n = hybrid_multiple(world, ulysses) * chunk
    out = []
    for i, (causal, (hq, hkv), d) in enumerate((c, h, d) for c in (True, False) for h in heads for d in (64, 80)):
        out.append(dict(B=2, N=n, Hq=hq, Hkv=hkv, D=d, causal=causal, dtype=dtype, seed=i))
    return out


def check(results: list[dict]) -> None:
    assert results
    for r in results:
        label = f"{r['dtype']} causal={r['causal']} Hq={r['Hq']} Hkv={r['Hkv']} D={r['D']} N={r['N']}"
        for m in NAMES:
            if r["dtype"] == "fp32":
                assert r[f"uly_{m}"] <= 1e-5, f"{label}: {m} rel err {r[f'uly_{m}']:.2e} > 1e-5"
            else:
                assert r[f"uly_{m}"] <= 2 * r[f"sdpa_{m}"], (
                    f"{label}: {m} rel err {r[f'uly_{m}']:.2e} > 2x single-device bf16 SDPA ({r[f'sdpa_{m}']:.2e})"
                )


@pytest.mark.parametrize(
    "world,ulysses,heads",
    [
        (2, 2, ((4, 4), (8, 2), (6, 1))),  # pure Ulysses 2
        (4, 4, ((8, 8), (8, 2), (8, 1), (4, 4))),  # pure Ulysses 4; fewer K/V heads than U
        (4, 2, ((4, 4), (8, 2), (6, 1))),  # Ulysses 2 x ring 2
    ],
    ids=["U2", "U4", "U2xR2"],
)
def test_ulysses_matches_float64_oracle(world: int, ulysses: int, heads: tuple) -> None:
    check(run_ranks(world, ulysses_errors, make_cases(world, ulysses, "fp32", heads), ulysses)[0])


def test_ulysses_bf16_within_twice_sdpa() -> None:
    cases = make_cases(4, 2, "bf16", ((8, 2),))
    check(run_ranks(4, ulysses_errors, cases, 2)[0])


def test_op_with_the_world_as_ulysses_group() -> None:
    """The op itself with ``ulysses_group=None`` (the world) and no ring, GQA 8/1 over 4 ranks."""
    cases = [dict(B=1, N=4 * 9, Hq=8, Hkv=1, D=80, causal=True, dtype="fp32", seed=3)]
    check(run_ranks(4, ulysses_errors, cases, 4, direct=True)[0])


# ------------------------------------------------------------------------------ through shard_batch
def padded_batch_errors(ulysses_size: int, n: int) -> dict:
    """On every rank: ``shard_batch`` pads a sequence of ``n`` tokens to the hybrid layout's multiple;
    attention on the sharded q/k/v matches float64 attention over the real tokens, and
    ``RingContext.unshard`` inverts the layout."""
    world = dist.get_world_size()
    hf_ring.setup_context_parallel(world, ulysses_size=ulysses_size)
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 50, (1, n), generator=g)
    kw = hf_ring.shard_batch({"input_ids": ids, "labels": ids})
    ctx = kw["ring_context"]
    n_pad = -(-n // hybrid_multiple(world, ulysses_size)) * hybrid_multiple(world, ulysses_size)
    back = {k: ctx.unshard(kw[k][..., None])[..., 0] for k in ("input_ids", "position_ids", "shift_labels")}
    # q/k/v as functions of the global position, so that padded rows are whatever shard_batch put there
    pos = kw["position_ids"].double()  # (1, S_local)
    hq, hkv, d = 8, 2, 80
    w = torch.randn(hq + 2 * hkv, d, generator=g, dtype=torch.float64)
    full_pos = torch.arange(n, dtype=torch.float64)[None]

    def qkv(p: torch.Tensor) -> list[torch.Tensor]:
        x = torch.sin(p[..., None, None] * 0.37 + w)  # (1, S, hq + 2 hkv, d)
        return list(x.split((hq, hkv, hkv), dim=2))

    ref = attention(*qkv(full_pos), causal=True)
    out = hf_ring.ring_attention(*(t.float() for t in qkv(pos)))
    got = ctx.unshard(out)
    return dict(
        n_pad=got.shape[1],
        want_pad=n_pad,
        ids=torch.equal(back["input_ids"][:, :n], ids),
        pad_ids=back["input_ids"][:, n:].tolist(),
        positions=torch.equal(back["position_ids"][0], torch.arange(n_pad)),
        targets=torch.equal(back["shift_labels"][0, : n - 1], ids[0, 1:])
        and bool((back["shift_labels"][0, n - 1 :] == -100).all()),
        err=rel_err(got[:, :n], ref),
        local=tuple(kw["input_ids"].shape),
        u=ctx.ulysses_size,
    )


@pytest.mark.parametrize("ulysses", [2, 4])
def test_shard_batch_pads_and_unshards_the_hybrid_layout(ulysses: int) -> None:
    n = 37  # not a multiple of 2P = 8, nor of R * lcm(2, U) = 4
    for r, x in enumerate(run_ranks(4, padded_batch_errors, ulysses, n)):
        assert x["u"] == ulysses and x["n_pad"] == x["want_pad"] == 40 and x["local"] == (1, 10), x
        assert x["ids"] and x["positions"] and x["targets"], f"rank {r}: layout not inverted: {x}"
        assert all(t == 0 for t in x["pad_ids"][0])
        assert x["err"] <= 1e-5, f"rank {r}: rel err {x['err']:.2e}"


# ------------------------------------------------------------------------------------- model level
def model_errors(cases: list[dict], ulysses_size: int) -> list[dict]:
    """On every rank, CP over the world with ``ulysses_size``: per case, this rank's loss error and
    the worst gradient error of the ring step (fp32) against one process with sdpa in float64."""
    from testkit.models import tiny_batch

    hf_ring.setup_context_parallel(dist.get_world_size(), ulysses_size=ulysses_size)
    results = []
    for c in cases:
        batch = tiny_batch(2, 37)  # not a multiple of 2P, nor of R * lcm(2, U)
        assert hf_ring.shard_batch(batch)["ring_context"].ulysses_size == ulysses_size
        kw = dict(lora=c["lora"], ckpt=c["ckpt"])
        ref_loss, ref_grads = train_step(c["family"], "sdpa", torch.float64, batch, cp=False, **kw)
        loss, grads = train_step(c["family"], "ring", torch.float32, batch, cp=True, **kw)
        assert grads.keys() == ref_grads.keys() and ref_grads
        errs = {k: rel_err(grads[k], ref_grads[k]) for k in ref_grads}
        worst = max(errs, key=errs.get)
        results.append({**c, "loss": rel_err(loss, ref_loss), "grad": errs[worst], "worst": worst})
    return results


MODEL_CASES = [
    dict(family="llama", lora=False, ckpt=False),
    dict(family="qwen3", lora=False, ckpt=False),
    dict(family="llama", lora=False, ckpt=True),
    dict(family="qwen3", lora=True, ckpt=True),
]


@pytest.mark.parametrize("ulysses", [2, 4], ids=["U2xR2", "U4"])
def test_training_step_matches_single_process(ulysses: int) -> None:
    """CP 4 as Ulysses 2 x ring 2 and as pure Ulysses 4 (4 query heads, 2 K/V heads: replicated
    twice for U = 4): the loss on every rank and the CP-averaged gradients equal one process's."""
    cases = MODEL_CASES if ulysses == 2 else MODEL_CASES[:2]
    for rank, results in enumerate(run_ranks(4, model_errors, cases, ulysses)):
        for r in results:
            label = f"rank {rank} {r['family']} lora={r['lora']} ckpt={r['ckpt']}"
            assert r["loss"] <= 1e-5, f"{label}: loss rel err {r['loss']:.2e}"
            assert r["grad"] <= 1e-5, f"{label}: grad {r['worst']} rel err {r['grad']:.2e}"


# ------------------------------------------------------------------------------------------ groups
def _members(group: dist.ProcessGroup | None) -> list[int] | None:
    if group is None:
        return None
    me = torch.tensor([dist.get_rank()])
    got = [torch.empty_like(me) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, me, group=group)
    return [int(t) for t in got]


def grid(cp_size: int, ulysses_size: int) -> dict:
    cp = hf_ring.setup_context_parallel(cp_size, ulysses_size=ulysses_size)
    return dict(
        cp=_members(cp.cp_group),
        ulysses=_members(cp.ulysses_group),
        ring=_members(cp.ring_group),
        ring_size=cp.ring_size,
        ring_rank=dist.get_rank(cp.ring_group) if cp.ring_group is not None else 0,
    )


@pytest.mark.parametrize(
    "cp_size,ulysses,want",
    [
        (4, 2, lambda r: ([0, 1, 2, 3], [r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2])),
        (2, 2, lambda r: ([r - r % 2, r - r % 2 + 1], [r - r % 2, r - r % 2 + 1], None)),  # DP 2 x pure Ulysses 2
        (4, 1, lambda r: ([0, 1, 2, 3], None, [0, 1, 2, 3])),
        (4, 4, lambda r: ([0, 1, 2, 3], [0, 1, 2, 3], None)),
    ],
)
def test_grid_of_ulysses_and_ring_groups(cp_size: int, ulysses: int, want) -> None:
    """Ulysses groups of consecutive ranks, rings across them; CP rank = ring position * U + u."""
    for r, g in enumerate(run_ranks(4, grid, cp_size, ulysses)):
        assert (g["cp"], g["ulysses"], g["ring"]) == want(r), f"rank {r}: {g}"
        assert g["ring_size"] == cp_size // ulysses
        assert g["ring_rank"] == ((r % cp_size) // ulysses if g["ring"] is not None else 0)


# ------------------------------------------------------------------------------------------ errors
def test_ulysses_size_must_divide_cp_size() -> None:
    with pytest.raises(ValueError, match=r"ulysses_size=3 does not divide cp_size=4.*Pick a divisor of 4"):
        hf_ring.setup_context_parallel(4, ulysses_size=3)
    with pytest.raises(ValueError, match="positive int"):
        hf_ring.setup_context_parallel(4, ulysses_size="auto")  # type: ignore[arg-type]


def error_messages() -> dict:
    """On every rank (CP 4): the errors of a head count that U does not divide (at attention time,
    op and model) and of a sequence too short for the layout."""
    from testkit.models import tiny_batch, tiny_model

    out = {}
    hf_ring.setup_context_parallel(4, ulysses_size=4)
    q = torch.randn(1, 4, 6, 16)
    k = torch.randn(1, 4, 2, 16)
    try:
        hf_ring.ring_attention(q, k, k)
    except ValueError as e:
        out["op"] = str(e)
    model = tiny_model("qwen3", "ring", num_attention_heads=6, num_key_value_heads=2)
    try:
        model(**hf_ring.shard_batch(tiny_batch(1, 24)))
    except ValueError as e:
        out["model"] = str(e)
    hf_ring.setup_context_parallel(4, ulysses_size=2)
    try:
        hf_ring.shard_batch(tiny_batch(1, 3))
    except ValueError as e:
        out["short"] = str(e)
    return out


def test_clear_errors() -> None:
    for r, msgs in enumerate(run_ranks(4, error_messages)):
        assert set(msgs) == {"op", "model", "short"}, f"rank {r}: {msgs}"
        for where in ("op", "model"):
            assert "ulysses_size=4 does not divide the 6 query heads" in msgs[where], msgs[where]
            assert "Pick a ulysses_size that divides 6" in msgs[where]
        assert "shorter than the 4 pieces" in msgs["short"]


@pytest.mark.parametrize("ulysses,heads", [(3, ((6, 6), (6, 2))), (2, ((6, 3), (4, 1)))], ids=["U3xR2", "U2xR3"])
def test_six_ranks_matches_float64_oracle(ulysses: int, heads: tuple) -> None:
    """Six ranks as Ulysses 3 x ring 2 and Ulysses 2 x ring 3 (odd sizes on both levels; K/V
    heads replicated 3x for Hkv = 2 over U = 3), D = 80, causal and not."""
    cases = [
        dict(B=1, N=hybrid_multiple(6, ulysses) * 3, Hq=hq, Hkv=hkv, D=80, causal=causal, dtype="fp32", seed=i)
        for i, ((hq, hkv), causal) in enumerate((h, c) for h in heads for c in (True, False))
    ]
    check(run_ranks(6, ulysses_errors, cases, ulysses)[0])


# ---------------------------------------------------------------------------------- planner terms
def sent_bytes(ulysses_size: int, n: int, hq: int, hkv: int, d: int) -> dict:
    """On every rank: the bytes this rank sends in one fwd+bwd of attention, counted at the
    torch.distributed calls (all-to-all: all but the rank's own chunk; point to point: every send)."""
    world = dist.get_world_size()
    hf_ring.setup_context_parallel(world, ulysses_size=ulysses_size)
    sent = {"all_to_all": 0, "ring": 0}
    a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

    def counting_a2a(output, input, *args, **kwargs):
        size = dist.get_world_size(kwargs.get("group"))
        sent["all_to_all"] += input.numel() * input.element_size() * (size - 1) // size
        return a2a(output, input, *args, **kwargs)

    def counting_batch(ops):
        sent["ring"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)

    g = torch.Generator().manual_seed(0)
    q, k, v = (hf_ring.shard(torch.randn(1, n, h, d, generator=g)).requires_grad_() for h in (hq, hkv, hkv))
    dist.all_to_all_single, dist.batch_isend_irecv = counting_a2a, counting_batch
    try:
        out = hf_ring.ring_attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = a2a, batch
    return sent


@pytest.mark.parametrize("ulysses,hkv", [(1, 2), (2, 2), (4, 1), (4, 2)])
def test_planner_comm_terms_match_the_bytes_sent(ulysses: int, hkv: int) -> None:
    from hf_ring.planner import ModelShape, attention_comm_bytes

    n, hq, d = 64, 8, 16
    shape = ModelShape("t", hidden=hq * d, intermediate=1, layers=1, heads=hq, kv_heads=hkv, head_dim=d, vocab=1)
    want = attention_comm_bytes(shape, 4, n, 4, ulysses)
    for r, got in enumerate(run_ranks(4, sent_bytes, ulysses, n, hq, hkv, d)):
        assert got["ring"] == want["ring_forward"] + want["ring_backward"], f"rank {r}: {got} vs {want}"
        assert got["all_to_all"] == want["all_to_all_forward"] + want["all_to_all_backward"], f"rank {r}"


# -------------------------------------------------------------------------------- packed documents
DOCS = [1, 5, 30, 14, 7, 3, 2]  # packed into one row of 62 tokens


def packed_step_errors(ulysses_size: int, lora: bool) -> dict:
    """A packed row (position_ids restarting per document) at CP = world with ``ulysses_size``,
    against each document run alone in one process (float64 sdpa): loss, CP-averaged gradients,
    and ``RingContext.unshard`` giving the row back."""
    from testkit.models import cp_grad_error, documents_alone_loss, tiny_model

    world = dist.get_world_size()
    hf_ring.setup_context_parallel(world, ulysses_size=ulysses_size)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (1, sum(DOCS)), generator=g)
    labels = ids.clone()
    labels[0, 10:13] = -100
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]

    def build(attn: str, dtype: torch.dtype) -> torch.nn.Module:
        model = tiny_model("qwen3", attn, dtype)
        return lora_model(model) if lora else model

    ring, ref = build("ring", torch.float32), build("sdpa", torch.float64)
    kwargs = hf_ring.shard_batch({"input_ids": ids, "labels": labels, "position_ids": positions})
    ctx = kwargs["ring_context"]
    out = ring(**kwargs)
    out.loss.backward()
    want = documents_alone_loss(ref, ids, labels, DOCS)
    want.backward()
    worst = cp_grad_error(ring, ref)
    return {
        "loss": abs(out.loss.item() - want.item()) / want.item(),
        "grads": worst,
        "roundtrip": torch.equal(ctx.unshard(kwargs["input_ids"]), ids),
        "u": ctx.ulysses_size,
        "packed": ctx.schedule is not None,
    }


@pytest.mark.parametrize("ulysses,lora", [(2, False), (4, False), (2, True)], ids=["U2xR2", "U4", "U2xR2-lora"])
def test_packed_step_equals_each_document_alone(ulysses: int, lora: bool) -> None:
    for r, x in enumerate(run_ranks(4, packed_step_errors, ulysses, lora)):
        assert x["u"] == ulysses and x["packed"] and x["roundtrip"], f"rank {r}: {x}"
        assert x["loss"] <= 1e-5 and x["grads"] <= 1e-5, f"rank {r}: {x}"


# ------------------------------------------------------------------------------------- RingTrainer
@pytest.mark.parametrize("ulysses", ["2", "auto"])
def test_ring_trainer_ulysses_matches_single_process_trainer(tmp_path, ulysses: str) -> None:
    """RingTrainer with cp_size=4, ulysses_size=2 (4 processes under torchrun; tests/trainer_run.py:
    5 steps of a tiny Llama, gradient accumulation, right padding) against plain Trainer in one
    process: per-step loss and gradient norm, eval loss, final parameters and predict() logits.
    ``auto``: two torchrun agents of 2 processes ("2 nodes", LOCAL_WORLD_SIZE=2) on this machine;
    the tiny Llama's 2 K/V heads and CP 4 across the nodes make it Ulysses 2 x ring 2."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    script = str(root / "tests" / "trainer_run.py")
    ring = [script, "ring", str(tmp_path), "4", ulysses]
    jobs = {"ref": [sys.executable, script, "ref", str(tmp_path), "1"]}
    if ulysses == "auto":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        for node in (0, 1):
            jobs[f"ring{node}"] = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                                   "2", "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port",
                                   str(port), *ring]  # fmt: skip
    else:
        jobs["ring"] = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", *ring]
    procs = {k: subprocess.Popen(cmd, cwd=root, env=env, stdout=(tmp_path / f"{k}.log").open("w"),
                                 stderr=subprocess.STDOUT) for k, cmd in jobs.items()}  # fmt: skip
    for name, proc in procs.items():
        try:
            rc = proc.wait(timeout=420)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            rc = "timeout"
        assert rc == 0, f"{name}: exit {rc}\n" + (tmp_path / f"{name}.log").read_text()[-4000:]
    name = "ring_w4_cp4_u2" + ("_auto" if ulysses == "auto" else "")
    ring, ref = (json.loads((tmp_path / f"{n}.json").read_text()) for n in (name, "ref_dp1"))
    assert (ring["cp_size"], ring["dp_size"], ring["ulysses_size"]) == (4, 1, 2)
    assert ring["steps"] == ref["steps"] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(ring[key], ref[key]), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {key} {a} vs single-process Trainer {b}"
    assert abs(ring["eval_loss"] - ref["eval_loss"]) <= 1e-5 * abs(ref["eval_loss"])
    got, want = torch.load(tmp_path / f"{name}.pt"), torch.load(tmp_path / "ref_dp1.pt")
    assert got.keys() == want.keys()
    for k, p in want.items():
        assert rel_err(got[k], p) <= 1e-5, k
    got, want = torch.load(tmp_path / f"{name}_pred.pt"), torch.load(tmp_path / "ref_dp1_pred.pt")
    real = want["mask"].bool()
    for key in ("labelled", "unlabelled"):
        assert rel_err(got[key][real], want[key][real]) <= 1e-5, key


def one_bad_rank(ulysses_size: int, what: str) -> str | None:
    """On every rank (CP 4): ``validate=True`` where only rank 1 passes other shapes."""
    hf_ring.setup_context_parallel(4, ulysses_size=ulysses_size)
    bad = dist.get_rank() == 1
    s = 5 if bad and what == "length" else 4
    q, k = torch.randn(1, s, 8, 16), torch.randn(1, s, 2, 16)
    if bad and what == "ndim":
        q = q.flatten(2)
    try:
        hf_ring.ring_attention(q, k, k, validate=True)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what", ["length", "ndim"])
@pytest.mark.parametrize("ulysses", [2, 4], ids=["U2xR2", "U4"])
def test_validate_with_bad_inputs_on_one_rank(ulysses: int, what: str) -> None:
    """Every rank raises (none waits in a collective for a rank that already raised)."""
    for r, msg in enumerate(run_ranks(4, one_bad_rank, ulysses, what, timeout=60)):
        assert msg is not None and "ranks of the context-parallel group disagree" in msg, f"rank {r}: {msg}"
