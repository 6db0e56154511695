"""The planner's head groups and tiled layers (``hf_ring.planner.tiled``): the 8M-token recipes fit one node of
8 x 80 GB and state their host memory; what each option changes; the refusals; the step time's extra GEMMs.
The terms themselves against measured peaks: ``tests/test_planner.py`` (``TILED_CASES``) and
``benchmarks/bench_memory.py``."""

from __future__ import annotations

import json

import pytest

from hf_ring.cli import main as cli_main
from hf_ring.planner import GiB, PlanSettings, max_seq_len, model_shape, plan, step_flops
from hf_ring.recipes import recipe_memory, recipe_plan

L8 = model_shape("Llama-3.1-8B")
EIGHT_M = 8 * 2**20


@pytest.mark.parametrize("recipe", ["llama-3.1-8b-8m-lora", "llama-3.1-8b-8m-full"])
def test_8m_recipes_fit_one_node_and_state_host_memory(recipe: str, capsys) -> None:
    assert cli_main(["plan", recipe, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["seq_len"] >= EIGHT_M and d["gpu_gib"] == 80 and d["fits"] is True
    assert d["gpus"] == d["cp"] == 8 and d["tokens_per_rank"] == 2**20
    assert d["settings"]["tiled_layers"] == 8192 and d["settings"]["head_groups"] == 8
    assert d["settings"]["offload_every"] == 2
    # the inputs of layers 0, 2, ..., 30 and the final norm's (8 GiB each) in host memory, for each of the 8 GPUs:
    # within the 2 TB (1,862 GiB) of the node the recipe states
    assert d["host_gib_per_rank"] == pytest.approx(17 * 8) and d["host_gib_per_node"] == pytest.approx(8 * 17 * 8)
    assert "tiled" in max(d["phases_gib"], key=d["phases_gib"].get)
    t = d["time"]
    assert t["tokens_per_s"] > 0 and 0 < t["mfu"] < 1 and t["rates"]["measured"] is False  # an estimate
    assert recipe_memory(recipe)["host_node"] == pytest.approx(8 * 17 * 8)


def test_without_the_new_options_8m_does_not_fit() -> None:
    p = recipe_plan("llama-3.1-8b-8m-full")
    keys = ("seq_len", "gpus", "cp", "mode", "sharding", "offload", "tiled_layers", "head_groups", "offload_every",
            "host_gib")  # fmt: skip
    for off in (dict(tiled_layers=None, tiled_mlp=8192, offload_every=1), dict(head_groups=1), dict(offload_every=1)):
        q = plan(L8, PlanSettings(**{**{k: getattr(p.settings, k) for k in keys}, **off}))
        assert not q.fits, off


def test_head_groups_divide_the_ring_and_the_groups_working_set() -> None:
    s = PlanSettings(seq_len=2**20, gpus=8, cp=8, sharding="fsdp", offload=True, tiled_layers=8192)
    rows = {g: plan(L8, PlanSettings(**{**s.__dict__, "head_groups": g})).rows for g in (1, 2, 8)}
    group = {g: next(v for k, v in r.items() if k.startswith("tiled layer: one head group")) for g, r in rows.items()}
    assert group[1] == pytest.approx(2 * group[2]) == pytest.approx(8 * group[8])
    untiled = {g: plan(L8, PlanSettings(seq_len=2**20, gpus=8, cp=8, head_groups=g)) for g in (1, 8)}
    ring = {g: p.rows["ring buffers (attention backward)"] for g, p in untiled.items()}
    assert ring[8] < 0.5 * ring[1]


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"head_groups=3 must divide the 8 K/V heads .* pick one of \[1, 2, 4, 8\]"):
        plan(L8, PlanSettings(seq_len=2**16, gpus=8, head_groups=3))
    with pytest.raises(ValueError, match=r"1 K/V heads each rank attends with .*Ulysses 8"):
        plan(L8, PlanSettings(seq_len=2**16, gpus=8, cp=8, ulysses_size=8, head_groups=2))
    qwen35 = model_shape("Qwen/Qwen3.5-9B")
    with pytest.raises(ValueError, match="linear token mixers, an attention output gate"):
        plan(qwen35, PlanSettings(seq_len=2**16, gpus=8, tiled_layers=8192))
    with pytest.raises(ValueError, match="with activation checkpointing"):
        plan(L8, PlanSettings(seq_len=2**16, gpus=8, tiled_layers=8192, checkpointing=False))


def test_host_memory_limit_and_the_longest_sequence() -> None:
    s = PlanSettings(seq_len=EIGHT_M, gpus=8, cp=8, sharding="fsdp", offload=True, tiled_layers=8192, head_groups=8)
    p = plan(L8, s)
    assert p.fits and p.host_per_node / GiB == pytest.approx(2112)
    assert not plan(L8, PlanSettings(**{**s.__dict__, "host_gib": 2048})).fits
    longest = max_seq_len(L8, PlanSettings(**{**s.__dict__, "host_gib": 2048}))
    assert 7.5 * 2**20 < longest < EIGHT_M


def test_tiled_layers_cost_extra_gemms_not_attention() -> None:
    s = PlanSettings(seq_len=EIGHT_M, gpus=8, cp=8, mode="full")
    plain, tiled = step_flops(L8, s, 8), step_flops(L8, PlanSettings(**{**s.__dict__, "tiled_layers": 8192}), 8)
    assert tiled["attention"] == plain["attention"] and tiled["model"] == plain["model"]
    assert 1.1 < tiled["gemm"] / plain["gemm"] < 1.6
    assert tiled["gemm"] < 0.01 * tiled["attention"]  # at 8M tokens attention is everything


def test_offload_every_other_layer_halves_the_host_memory_for_half_a_forward() -> None:
    s = PlanSettings(seq_len=EIGHT_M, gpus=8, cp=8, sharding="fsdp", offload=True, tiled_layers=8192, head_groups=8)
    every, other = plan(L8, s), plan(L8, PlanSettings(**{**s.__dict__, "offload_every": 2}))
    assert every.host_per_rank / GiB == pytest.approx(33 * 8) and other.host_per_rank / GiB == pytest.approx(17 * 8)
    assert other.peak == pytest.approx(every.peak)  # the inputs made again are never all on the device
    # forward, recompute, backward (2.5 forwards): 4.5 forwards of attention; half a forward more
    assert other.time.attention_s / every.time.attention_s == pytest.approx(5.0 / 4.5)
    with pytest.raises(ValueError, match="offload_every > 1 needs offload and tiled_layers"):
        plan(L8, PlanSettings(seq_len=2**16, gpus=8, offload=True, offload_every=2))
