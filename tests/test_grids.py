"""Ring, Ulysses and Ulysses x ring grids in the planner (``hf_ring.planner.grids``): the rule of
``ulysses_size="auto"``, the per-layer communication and compute times against hand-worked figures,
the recommendation, ``plan``/``hf-ring plan`` with ``ulysses_size``, and ``"auto"`` through
``RingTrainingArguments`` and ``RingTrainer``'s resolution."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hf_ring.cli import main as cli_main
from hf_ring.planner import (
    PlanSettings,
    attention_comm_bytes,
    choose_ulysses_size,
    compare_grids,
    grid_cost,
    model_shape,
    parse_ulysses_size,
    plan,
    recommend,
)

L8 = model_shape("Llama-3.1-8B")  # Hq 32, Hkv 8, d 128


# ------------------------------------------------------------------------------------ the "auto" rule
@pytest.mark.parametrize(
    "hq,hkv,cp,gpn,want",
    [
        (32, 8, 8, 8, 1),  # one node: the ring hides on NVLink, an all-to-all never does
        (32, 8, 4, 8, 1),
        (32, 8, 16, 8, 8),  # Llama-3.1-8B on 2 nodes: Ulysses 8 inside a node x ring 2 across
        (32, 8, 32, 8, 8),
        (28, 4, 16, 8, 4),  # Qwen2.5-7B: U = Hkv; 8 does not divide 28 heads anyway
        (12, 2, 16, 8, 2),  # Qwen2.5-1.5B: 4 would divide Hq but replicate K/V for no overlap gain
        (64, 8, 16, 4, 4),  # 4 GPUs per node
        (32, 32, 24, 8, 8),  # MHA, CP 24 over 3 nodes
        (32, 8, 12, 4, 4),
        (40, 8, 6, 2, 2),  # U must divide the GPUs per node: groups of consecutive ranks stay in a node
        (32, 1, 16, 8, 1),  # MQA: one K/V head, Ulysses only replicates it
    ],
)
def test_choose_ulysses_size(hq: int, hkv: int, cp: int, gpn: int, want: int) -> None:
    u = choose_ulysses_size(hq, hkv, cp, gpn)
    assert u == want
    assert cp % u == 0 and hq % u == 0 and gpn % u == 0 and hkv % u == 0


def test_choose_ulysses_size_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        choose_ulysses_size(32, 0, 16, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        choose_ulysses_size(30, 8, 16, 8)
    with pytest.raises(ValueError, match="cp_size"):
        choose_ulysses_size(32, 8, True, 8)  # type: ignore[arg-type]


def test_auto_keeps_the_widest_overlap_margin_at_the_fewest_bytes() -> None:
    """Across nodes, per hop compute / transfer grows with gcd(Hkv, U) only: the rule's U has the
    largest margin of all grids, and any larger U sends more all-to-all bytes for none."""
    s = PlanSettings(seq_len=2**16, gpus=32, cp=32)
    costs = {c.ulysses: c for c in compare_grids(L8, s)}
    u = choose_ulysses_size(L8.heads, L8.kv_heads, 32, s.gpus_per_node)
    assert u == 8
    margin = {k: math.gcd(L8.kv_heads, k) for k in costs}
    assert margin[u] == max(margin.values())
    assert costs[16].kv_replication == 2 and costs[u].kv_replication == 1


@pytest.mark.parametrize("text,want", [("2", 2), (" 8 ", 8), ("auto", "auto"), ("AUTO", "auto"), (4, 4)])
def test_parse_ulysses_size(text: str | int, want: int | str) -> None:
    assert parse_ulysses_size(text) == want


@pytest.mark.parametrize("bad", ["0", "-2", "two", "2.0", "", 0, True, 1.5])
def test_parse_ulysses_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="positive int or 'auto'"):
        parse_ulysses_size(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------- grid costs
def test_grid_cost_by_hand() -> None:
    """Llama-3.1-8B, 128K tokens, CP 16 on 2 nodes, bf16, checkpointing: each term worked out."""
    s = PlanSettings(seq_len=2**17, gpus=16, cp=16)
    n, d, b, f = 2**17, 128, 2, 400e12
    fwd = 2 * n * n * 32 * d / 16  # causal forward FLOPs per rank
    ring = grid_cost(L8, s, 16, 1)
    assert ring.compute_s == pytest.approx(fwd * (2 + 2.5) / f)
    hop = 2 * 8 * d * n / 16  # K/V elements per hop
    inter = 45e9
    assert (ring.ring_link, ring.a2a_link, ring.ring, ring.all_to_all_s) == ("inter-node", "none", 16, 0.0)
    assert ring.ring_s == pytest.approx((2 * 15 * hop * b + 15 * hop * (b + 4) + hop * 4) / inter)
    step = fwd / 16 / f
    assert hop * b / inter < step and hop * (b + 4) / inter < 2.5 * step  # 8K tokens per rank: hidden
    assert ring.exposed_s == pytest.approx(hop * 4 / inter)  # only the last dK/dV hop
    hyb = grid_cost(L8, s, 16, 8)
    comm = attention_comm_bytes(L8, b, n, 16, 8)
    assert (hyb.ring, hyb.a2a_link, hyb.ring_link) == (2, "NVLink", "inter-node")
    assert hyb.all_to_all_s == pytest.approx(3 * comm["all_to_all_forward"] / 300e9)  # fwd, recompute, bwd
    assert hyb.compute_s == ring.compute_s  # the same attention work in every grid
    assert hyb.bytes_sent == pytest.approx(comm["total"] + comm["ring_forward"] + comm["all_to_all_forward"])
    no_ckpt = grid_cost(L8, replace(s, checkpointing=False), 16, 8)
    assert no_ckpt.bytes_sent == pytest.approx(comm["total"])


def test_recommendation_follows_the_overlap() -> None:
    # 1M tokens in one node: the ring hides, Ulysses would only add exposed all-to-all time
    in_node = compare_grids(L8, PlanSettings(seq_len=2**20, gpus=8, cp=8))
    assert [c.name for c in in_node] == ["ring", "U2 x R4", "U4 x R2", "ulysses"]
    assert recommend(in_node).ulysses == 1
    # 64K tokens on 2 nodes: 4K tokens per rank do not hide across nodes; Ulysses 2 inside a node does
    short = compare_grids(L8, PlanSettings(seq_len=2**16, gpus=16, cp=16))
    assert recommend(short).ulysses == 2 and short[0].exposed_s > 3 * recommend(short).exposed_s
    # pure Ulysses over 2 nodes: its all-to-all crosses the slow link
    assert short[-1].name == "ulysses" and short[-1].a2a_link == "inter-node"
    # ties (within 1%) go to the smaller U
    assert recommend([replace(in_node[1], exposed_s=1.0), replace(in_node[2], exposed_s=0.995)]).ulysses == 2


def test_only_divisors_of_the_query_heads() -> None:
    qwen = model_shape("Qwen2.5-7B")  # 28 query heads
    assert [c.ulysses for c in compare_grids(qwen, PlanSettings(seq_len=2**17, gpus=16, cp=16))] == [1, 2, 4]


# ----------------------------------------------------------------------------- plan and hf-ring plan
def test_plan_with_ulysses() -> None:
    s = PlanSettings(seq_len=2**17, gpus=16, cp=16)
    auto = plan(L8, replace(s, ulysses_size="auto"))
    assert auto.ulysses == 8 and auto.settings.ulysses_size == 8
    assert auto.overlap["ring_tokens"] == 8 * auto.tokens_per_rank and auto.overlap["hidden"]
    ring = plan(L8, s)
    assert ring.ulysses == 1 and ring.overlap["ring_tokens"] == ring.tokens_per_rank
    # U dividing Hkv: the same activation elements, plus the all-to-all's buffers in attention backward
    assert auto.rows["checkpointed activations"] == ring.rows["checkpointed activations"]
    assert auto.rows["ring buffers (attention backward)"] >= ring.rows["ring buffers (attention backward)"]
    assert auto.recommended is not None and auto.recommended.ulysses in (1, 2, 4, 8)
    # K/V replicated (Qwen2.5-1.5B, Hkv 2, U 4): saved K/V and ring messages grow, and a note says so
    qwen = model_shape("Qwen2.5-1.5B")
    q1, q2, q4 = (plan(qwen, replace(s, ulysses_size=u, checkpointing=False)) for u in (1, 2, 4))
    assert q2.rows["saved activations"] == q1.rows["saved activations"]
    assert q4.rows["saved activations"] > q2.rows["saved activations"]
    assert any("repeated 2x" in n for n in q4.notes) and not q2.notes
    with pytest.raises(ValueError, match="ulysses_size=3"):
        plan(L8, replace(s, ulysses_size=3))


def test_cli_plan_prints_the_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "Llama-3.1-8B", "--seq-len", "64K", "--gpus", "16", "--cp", "16"]) == 0
    out = capsys.readouterr().out
    assert "attention grids of the CP group" in out and "U8 x R2" in out
    assert "recommended: ulysses_size=2" in out and "ulysses_size=auto gives 8" in out
    args = ["plan", "Llama-3.1-8B", "--seq-len", "64K", "--gpus", "16", "--cp", "16", "--ulysses-size", "auto"]
    assert cli_main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ulysses_size"] == 8 and data["recommended_ulysses_size"] == 2
    assert [x["ulysses"] for x in data["grids"]] == [1, 2, 4, 8, 16]
    # smallest_cp with an int ulysses_size tries its multiples only
    assert cli_main(["plan", "Llama-3.1-8B", "--seq-len", "128K", "--gpus", "8", "--ulysses-size", "4"]) == 0
    assert "smallest CP size that fits: 4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["plan", "Llama-3.1-8B", "--seq-len", "1M", "--ulysses-size", "many"])


# ---------------------------------------------------------------------------- training arguments
def test_training_arguments_take_an_int_or_auto(tmp_path) -> None:
    from transformers import HfArgumentParser

    from hf_ring.trainer import RingTrainingArguments

    parser = HfArgumentParser(RingTrainingArguments)
    common = ["--output_dir", str(tmp_path), "--cp_size", "4", "--use_cpu", "true"]
    (two,) = parser.parse_args_into_dataclasses([*common, "--ulysses_size", "2"])
    (auto,) = parser.parse_args_into_dataclasses([*common, "--ulysses_size", "auto"])
    (default,) = parser.parse_args_into_dataclasses(common)
    assert (two.ulysses_size, auto.ulysses_size, default.ulysses_size) == (2, "auto", 1)
    (from_dict,) = parser.parse_dict({"output_dir": str(tmp_path), "cp_size": 4, "ulysses_size": 4, "use_cpu": True})
    assert from_dict.ulysses_size == 4
    for bad, match in (("two", "positive int or 'auto'"), ("0", "positive int or 'auto'"), ("3", "does not divide")):
        with pytest.raises(ValueError, match=match):
            RingTrainingArguments(output_dir=str(tmp_path), cp_size=4, ulysses_size=bad, use_cpu=True)


def test_trainer_resolves_auto_from_the_model_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from hf_ring.trainer import resolve_ulysses_size
    from testkit.models import tiny_model

    llama = SimpleNamespace(config=SimpleNamespace(num_attention_heads=32, num_key_value_heads=8))
    assert resolve_ulysses_size(llama, 16, gpus_per_node=8) == 8
    assert resolve_ulysses_size(llama, 8, gpus_per_node=8) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 processes per node, CP 8 over 2 nodes
    assert resolve_ulysses_size(llama, 8) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_ulysses_size(llama, 8) == 1  # no launcher, no GPU: one node of cp_size
    model = tiny_model("qwen3", "ring", num_attention_heads=6, num_key_value_heads=2)
    assert resolve_ulysses_size(model, 4, gpus_per_node=2) == 2
    with pytest.raises(ValueError, match="num_attention_heads"):
        resolve_ulysses_size(SimpleNamespace(), 4, gpus_per_node=2)
