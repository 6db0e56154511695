"""Per-rank memory: measured peaks of small ring models (Llama; a Qwen3.5 hybrid with Gated DeltaNet
layers) grow as N / P and match the planner within 20%; checkpointing with offload gives the same
step; the planner's model figures (hybrid layer patterns too), its CLI and the recipes' stated
memory (``hf_ring.planner``, ``hf_ring.cli``, ``testkit.live_tensors``)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.cli import main as cli_main
from hf_ring.planner import PlanSettings, known_config, max_seq_len, model_shape, plan, smallest_cp, tokens
from hf_ring.recipes import packaged_recipes, recipe_memory, recipe_model
from testkit.live_tensors import LiveTensorBytes
from testkit.models import prepare_step_model, tiny_batch, tiny_model
from testkit.offload import MeasuredOffload
from testkit.oracle import rel_err
from testkit.spawn import run_ranks

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
PLAN_CONFIG = dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, **SHAPE)
L8 = model_shape("Llama-3.1-8B")

# --- the tracker ----------------------------------------------------------------------------------


def test_live_tensor_bytes_counts_what_a_block_allocates():
    outside = torch.ones(1000)
    with LiveTensorBytes() as mem:
        a = torch.ones(256)  # 1 KiB
        view = a[10:]  # no new memory
        b = outside.view(10, 100).t()  # a view of a tensor made outside: not counted
        outside.add_(1)  # in place on it: not counted
        c = torch.empty(512)  # 2 KiB
        assert mem.live == 3072
        del c
        assert mem.live == 1024 and mem.peak == 3072
        d = a * 2
        del a, view, d
    assert mem.live == 0 and mem.peak == 3072 and b.shape == (100, 10)


# --- measured peaks against the planner ----------------------------------------------------------------


def measure_step(cases: list[dict]) -> list[dict]:
    """One training step per case on this rank (CP = the world, or one process): the peak bytes of
    the tensors it creates, its gradients allocated beforehand (as from an earlier micro-batch)."""
    out = []
    for c in cases:
        shape = {**SHAPE, "vocab_size": c.get("vocab", SHAPE["vocab_size"])}
        model = tiny_model("llama", "ring", getattr(torch, c["dtype"]), max_position_embeddings=1 << 16, **shape)
        model = prepare_step_model(model, c, lora_rank=8)
        batch = tiny_batch(1, c["N"], vocab=shape["vocab_size"], seed=2)
        kwargs = hf_ring.shard_batch(batch)
        with LiveTensorBytes() as mem:
            res = model(**kwargs)
            res.loss.backward()
            del res
        out.append({"peak": mem.peak, "host_peak": mem.host_peak})
    return out


def _case(n, dtype="float32", ckpt=True, offload=False, chunked=True, vocab=256, tiled=None, lora=False):
    return dict(N=n, dtype=dtype, ckpt=ckpt, offload=offload, chunked=chunked, vocab=vocab, tiled=tiled, lora=lora)


GRID = {1: [_case(512), _case(1024)], 2: [_case(1024), _case(2048)], 4: [_case(2048), _case(4096)]}
VARIANTS = [  # CP = 2, 2048 tokens
    _case(2048, ckpt=False),
    _case(2048, offload=True),
    _case(2048, dtype="bfloat16"),
    _case(2048, chunked=False, vocab=2048),
    _case(2048, vocab=2048),
    _case(2048, tiled=256),
    _case(2048, tiled=256, offload=True),
    _case(2048, dtype="bfloat16", lora=True),  # PEFT's float32 adapters on a bf16 model
]


# head groups and tiled layers (2 groups, tiles of 128 tokens, the loss in chunks of 256): CP = 2 and 4
TILED = dict(groups=2, layers=128, loss_chunk=256)
TILED_CASES = {
    2: [{**_case(2048), **TILED}, {**_case(4096), **TILED}, {**_case(2048, offload=True), **TILED},
        {**_case(2048, dtype="bfloat16", lora=True, offload=True), **TILED}],
    4: [{**_case(4096), **TILED}, {**_case(8192), **TILED}],
}  # fmt: skip


def _planned(c: dict, p: int):
    cfg = {**PLAN_CONFIG, "vocab_size": c["vocab"]}
    dtype = "fp32" if c["dtype"] == "float32" else "bf16"
    return plan(model_shape(cfg), PlanSettings(
        seq_len=c["N"], gpus=p, cp=p, mode="lora" if c["lora"] else "full", lora_rank=8, dtype=dtype,
        checkpointing=c["ckpt"], offload=c["offload"], chunked_loss=c["chunked"], tiled_mlp=c["tiled"],
        reserve_gib=0, head_groups=c.get("groups", 1), tiled_layers=c.get("layers"),
        loss_chunk=c.get("loss_chunk")))  # fmt: skip


@pytest.fixture(scope="module")
def measured() -> dict:
    """{(P, case index): (case, worst rank's peak, host peak)}."""
    runs = {1: measure_step(GRID[1])}
    runs[2] = run_ranks(2, measure_step, GRID[2] + VARIANTS + TILED_CASES[2], timeout=900)
    runs[4] = run_ranks(4, measure_step, GRID[4] + TILED_CASES[4], timeout=900)
    out = {}
    for p, per_rank in runs.items():
        per_rank = per_rank if p > 1 else [per_rank]
        cases = GRID[p] + (VARIANTS if p == 2 else []) + TILED_CASES.get(p, [])
        for i, c in enumerate(cases):
            peak = max(r[i]["peak"] for r in per_rank)
            host = max(r[i]["host_peak"] for r in per_rank)
            out[(p, i)] = (c, peak, host)
    return out


def test_planner_predicts_measured_activation_peaks(measured):
    for (p, _), (c, peak, host) in measured.items():
        pl = _planned(c, p)
        ratio = peak / pl.activation_peak
        planned = pl.activation_peak / 2**20
        tol = 0.1 if c.get("layers") else 0.2  # the terms of head groups and tiled layers: within 10%
        assert 1 - tol <= ratio <= 1 + tol, f"P={p} {c}: measured {peak / 2**20:.2f} MiB, planned {planned:.2f}"
        if c["offload"]:
            planned_host = sum(pl.host.values())
            assert 0.8 <= host / planned_host <= 1.2, f"P={p} {c}: host {host} vs {planned_host}"
        else:
            assert host == 0


def test_peak_memory_per_rank_grows_as_n_over_p(measured):
    grid = {(p, c["N"]): peak for (p, i), (c, peak, _) in measured.items() if i < len(GRID[p])}
    per_token = {k: v / (k[1] / k[0]) for k, v in grid.items()}
    assert max(per_token.values()) / min(per_token.values()) < 1.25, per_token
    # the same N/P gives the same peak whatever P is
    assert abs(grid[(1, 512)] / grid[(2, 1024)] - 1) < 0.1
    assert abs(grid[(2, 1024)] / grid[(4, 2048)] - 1) < 0.1
    assert abs(grid[(1, 1024)] / grid[(2, 2048)] - 1) < 0.1
    assert abs(grid[(2, 2048)] / grid[(4, 4096)] - 1) < 0.1
    # doubling P halves the peak at a fixed N
    assert 1.8 < grid[(1, 1024)] / grid[(2, 1024)] < 2.2
    assert 1.8 < grid[(2, 2048)] / grid[(4, 2048)] < 2.2


def test_offload_and_chunked_loss_lower_the_measured_peak(measured):
    v = {i - len(GRID[2]): (c, peak, host) for (p, i), (c, peak, host) in measured.items() if p == 2}
    base = measured[(2, 1)][1]  # fp32, checkpointing, chunked, 2048 tokens
    assert measured[(2, 1)][0]["N"] == v[0][0]["N"] == 2048
    assert v[0][1] > 2 * base  # no checkpointing
    assert v[1][1] < base and v[1][2] > 0  # offload: less on the device, some on the host
    assert v[2][1] < 0.6 * base  # bf16
    assert v[4][1] < 0.6 * v[3][1]  # chunked vs full logits, vocabulary 2048
    assert v[5][1] < 0.85 * base and v[6][1] < 0.85 * v[1][1]  # tiled MLP, without and with offload


# --- a hybrid: Qwen3.5 (3 Gated DeltaNet layers, 1 gated attention layer) --------------------------------

HYBRID = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              tie_word_embeddings=False)  # fmt: skip
HYBRID_GRID = {1: [_case(1024)], 2: [_case(1024), _case(2048), _case(2048, ckpt=False), _case(2048, dtype="bfloat16"),
                                     _case(2048, offload=True)]}  # fmt: skip


def measure_hybrid_step(cases: list[dict]) -> list[int]:
    """``measure_step`` for the tiny Qwen3.5 (transformers' torch kernels): each case's peak bytes."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    fields = {k: v for k, v in HYBRID.items() if k != "model_type"}
    out = []
    for c in cases:
        torch.manual_seed(0)
        config = Qwen3_5TextConfig(max_position_embeddings=1 << 16, **fields)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="ring").to(getattr(torch, c["dtype"]))
        model = prepare_step_model(model, c, lora_rank=8)
        kwargs = hf_ring.shard_batch(tiny_batch(1, c["N"], vocab=HYBRID["vocab_size"], seed=2))
        with LiveTensorBytes() as mem:
            res = model(**kwargs)
            res.loss.backward()
            del res
        out.append(mem.peak)
    return out


def test_planner_predicts_a_hybrids_measured_peaks():
    """The Gated DeltaNet layers' terms (``mixer_terms(kernels="torch")``: projections, convolution,
    the chunked rule's working set, the identity call under CP) against the worst rank's measured
    peak, as for Llama: within 20%, with and without checkpointing, bf16, offload, P = 1 and 2."""
    runs = {1: [measure_hybrid_step(HYBRID_GRID[1])], 2: run_ranks(2, measure_hybrid_step, HYBRID_GRID[2])}
    for p, per_rank in runs.items():
        for i, c in enumerate(HYBRID_GRID[p]):
            peak = max(r[i] for r in per_rank)
            pl = plan(model_shape(HYBRID), PlanSettings(
                seq_len=c["N"], gpus=p, cp=p, mode="full", dtype="fp32" if c["dtype"] == "float32" else "bf16",
                checkpointing=c["ckpt"], offload=c["offload"], reserve_gib=0, mixer_kernels="torch"))  # fmt: skip
            ratio = peak / pl.activation_peak
            assert 0.8 <= ratio <= 1.2, (
                f"P={p} {c}: measured {peak / 2**20:.2f} MiB, planned {pl.activation_peak / 2**20:.2f}"
            )


def test_hybrid_shapes_from_configs():
    """Layer patterns from Qwen3.5's layer_types (or full_attention_interval) and Nemotron-H's
    hybrid_override_pattern; parameter counts against the models' published sizes."""
    from hf_ring.planner import mixer_comm_bytes

    q = model_shape("Qwen/Qwen3.5-9B")
    assert q.hybrid and q.layers == 32 and q.attn_gate and q.mixer.kind == "gated_deltanet"
    assert [b[0] for b in q.blocks[:4]] == ["gated_deltanet"] * 3 + ["attention"]
    assert sum(b[0] == "attention" for b in q.blocks) == 8
    assert 8.9e9 < q.params < 9.0e9  # the language model of the 9.7B multimodal model
    explicit = model_shape({**HYBRID, "layer_types": ["linear_attention", "full_attention"] * 2})
    assert [b[0] for b in explicit.blocks] == ["gated_deltanet", "attention"] * 2
    nested = model_shape({"model_type": "qwen3_5", "text_config": HYBRID})  # a multimodal config
    assert nested == model_shape(HYBRID)
    n = model_shape("nvidia/Nemotron-H-8B-Base-8K")
    assert n.params == 8_100_852_736  # the published count
    assert [b for b in n.blocks[:3]] == [("mamba2",), ("mlp",), ("mamba2",)] and n.layers == 52
    assert not n.mlp_gated and n.mixer.kind == "mamba2"
    # what the state passing sends does not grow with the sequence; plans price both models
    for m in (q, n):
        sent = {cp: mixer_comm_bytes(m, 2, cp)["total"] for cp in (1, 2, 8)}
        assert sent[1] == 0 < sent[2] < sent[8]
        short, long = (plan(m, PlanSettings(seq_len=k, gpus=8, cp=8, offload=True)) for k in (2**17, 2**19))
        assert long.activation_peak > 3 * short.activation_peak
        assert any("state passing" in note for note in long.notes)
    lora = q.lora_params(16, ("in_proj_qkv", "in_proj_z", "out_proj"))
    assert lora == 16 * 24 * (4096 + 8192 + 4096 + 4096 + 4096 + 4096)  # 24 Gated DeltaNet layers
    assert L8.hybrid is False and L8.layer_blocks == (("attention", "mlp"),) * 32
    moe = model_shape({**HYBRID, "model_type": "qwen3_5_moe_text", "num_experts": 4})
    with pytest.raises(ValueError, match="mixture-of-experts blocks are not priced yet"):
        plan(moe, PlanSettings(seq_len=2**12, gpus=1))


# --- offload gives the same step ------------------------------------------------------------------------


def offload_step_errors(cases: list[dict]) -> list[dict]:
    out = []
    for c in cases:
        batch = tiny_batch(2, 37)
        results = {}
        for mode in MODES:
            model = tiny_model(c["family"], "ring")
            if c["lora"]:
                from peft import LoraConfig, get_peft_model

                torch.manual_seed(5)
                lora = LoraConfig(r=4, target_modules=["q_proj", "up_proj"], init_lora_weights=False)
                model = get_peft_model(model, lora)
            if mode != "plain":
                hf_ring.enable_activation_checkpointing(model, offload=MeasuredOffload if "offload" in mode else False)
                if c["lora"]:
                    model.enable_input_require_grads()
            if "tiled" in mode:
                hf_ring.enable_tiled_mlp(model, tile_tokens=7)
            hf_ring.enable_chunked_loss(model)
            if c["ddp"]:
                model = torch.nn.parallel.DistributedDataParallel(model)
            model.train()
            with LiveTensorBytes() as mem:
                res = model(**hf_ring.shard_batch(batch))
                res.loss.backward()
            grads = {}
            inner = model.module if c["ddp"] else model
            for n, p in inner.named_parameters():
                if p.grad is not None:
                    g = p.grad.double()
                    if not c["ddp"]:
                        dist.all_reduce(g)
                        g /= 2
                    grads[n] = g
            results[mode] = (res.loss.detach().double(), grads, mem.host_peak)
        loss, grads, _ = results["plain"]
        errs = {"host_offload": results["offload"][2], "host_ckpt": results["ckpt"][2]}
        for mode in MODES[1:]:
            errs[f"{mode} loss"] = rel_err(results[mode][0], loss)
            assert results[mode][1].keys() == grads.keys()
            errs[f"{mode} grads"] = max(rel_err(results[mode][1][k], grads[k]) for k in grads)
        out.append(errs)
    return out


MODES = ("plain", "ckpt", "offload", "tiled", "tiled+offload")


def test_checkpointing_offload_and_tiled_mlp_give_the_same_step_cp2():
    cases = [dict(family="llama", lora=False, ddp=False), dict(family="qwen2", lora=True, ddp=False),
             dict(family="qwen3", lora=False, ddp=True)]  # fmt: skip
    for rank, results in enumerate(run_ranks(2, offload_step_errors, cases)):
        for c, e in zip(cases, results):
            assert e.pop("host_ckpt") == 0 and e.pop("host_offload") > 0, (rank, c)
            for k, v in e.items():
                assert v <= 1e-6, f"rank {rank} {c}: {k} rel err {v:.2e}"


def test_offload_needs_checkpointing():
    with pytest.raises(ValueError, match="checkpointing"):
        plan(L8, PlanSettings(seq_len=2**20, gpus=8, checkpointing=False, offload=True))


# --- the planner ------------------------------------------------------------------------------------


def test_known_models_and_config_sources(tmp_path):
    assert abs(model_shape("Llama-3.1-8B").params / 8.03e9 - 1) < 0.005
    assert abs(model_shape("Qwen2.5-7B").params / 7.62e9 - 1) < 0.005
    assert abs(model_shape("meta-llama/Llama-3.2-1B").params / 1.24e9 - 1) < 0.01
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(PLAN_CONFIG))
    assert model_shape(str(tmp_path)) == model_shape(str(cfg)) == model_shape(PLAN_CONFIG)
    assert recipe_model("tiny-cpu-demo").hidden == 128  # a recipe whose init_from run does not exist yet
    with pytest.raises(ValueError, match="unknown model"):
        model_shape("no-such-model")


def test_planner_terms_for_llama_8b_at_1m_tokens():
    p = plan(L8, PlanSettings(seq_len=2**20, gpus=8, cp=8))
    t = 2**17
    assert p.tokens_per_rank == t
    # checkpointed layer inputs: 32 layers x 4096 x bf16 = 256 KiB per token, plus the final norm (its fp32
    # input; its weight is frozen; its bf16 output is the LM head's input, which the chunked loss keeps and
    # counts: the head itself gets a new empty tensor) and RoPE
    assert p.rows["checkpointed activations"] == t * (32 * 4096 * 2 + 4 * 4096 + 4 + 2 * 128 * 2)
    assert p.rows["loss (kept for backward)"] == t * (4096 * 2 + 20)
    assert p.rows["weights"] / 1e9 == pytest.approx(8.03 * 2 + model_shape("Llama-3.1-8B").lora_params(16) * 4e-9, 1e-2)
    off = plan(L8, PlanSettings(seq_len=2**20, gpus=8, cp=8, offload=True))
    # offloaded: the layer inputs and the final norm's input (34 GiB per rank); RoPE's cos/sin stay
    assert off.host["checkpointed activations"] == t * (32 * 4096 * 2 + 4 * 4096 + 4)
    # in the peak phase (a layer's MLP backward) the device holds 32 layer inputs without offload, 2 with it
    # (the layer recomputed and the previous one, prefetched)
    assert off.peak_phase == p.peak_phase == "layer backward, MLP"
    assert p.peak - off.peak == t * 4096 * 2 * (32 - 2)
    full = plan(L8, PlanSettings(seq_len=2**20, gpus=8, cp=8, chunked_loss=False))
    assert full.activation_peak - p.activation_peak > t * 128256 * 8  # full logits: >= 2 float32 copies
    # activations scale as 1 / CP
    cp16 = plan(L8, PlanSettings(seq_len=2**20, gpus=16, cp=16))
    assert cp16.activation_peak == pytest.approx(p.activation_peak / 2, rel=0.02)
    # FSDP / ZeRO-3 over 8 GPUs: full fine-tuning model states shrink to ~16 bytes x params / 8
    m = model_shape("Llama-3.1-8B")
    z3 = plan(m, PlanSettings(seq_len=2**17, gpus=8, cp=8, mode="full", sharding="zero3"))
    gathered = 2 * (2 * m.layer_params + 2 * m.vocab * m.hidden)  # two layers, embedding and head, in bf16
    assert z3.model_states == pytest.approx(16 * m.params / 8 + gathered, rel=1e-9)


def test_ring_overlap_threshold_with_gqa():
    p = plan(L8, PlanSettings(seq_len=2**17, gpus=8, cp=8, flops=400e12, intra_GBps=300))
    # forward: T >= F * bytes * Hkv / (BW * Hq) = 400e12 * 2 * (8/32) / 300e9
    assert p.overlap["forward_threshold"] == 667
    assert p.overlap["hidden"] and p.tokens_per_rank > p.overlap["threshold_tokens"]
    mha = dict(PLAN_CONFIG, num_key_value_heads=4)
    s15 = PlanSettings(seq_len=2**15, gpus=8, cp=8)
    gqa, no_gqa = (plan(model_shape(c), s15).overlap["threshold_tokens"] for c in (PLAN_CONFIG, mha))
    assert no_gqa == pytest.approx(2 * gqa, abs=2)  # K/V with half as many heads: half the tokens
    two_nodes = plan(L8, PlanSettings(seq_len=2**16, gpus=16, cp=16, flops=400e12, inter_GBps=45))
    assert two_nodes.overlap["link"] == "inter-node" and two_nodes.overlap["forward_threshold"] == 4445
    assert not two_nodes.overlap["hidden"]  # 4K tokens per rank are too few across nodes


def test_moe_windowed_and_sink_shapes():
    """GPT-OSS-20B and Gemma 3 27B (its language model) from the catalogue: parameters as published,
    the MoE, window and sink fields; an MoE layer's activations grow with the active experts only."""
    from hf_ring.planner import activation_terms

    oss, gemma = model_shape("openai/gpt-oss-20b"), model_shape("google/gemma-3-27b-pt")
    assert oss.params / 20.9e9 == pytest.approx(1, abs=0.01) and gemma.params / 27.0e9 == pytest.approx(1, abs=0.01)
    assert (oss.experts, oss.active_experts, oss.expert_intermediate, oss.sinks) == (32, 4, 2880, True)
    assert (oss.window, oss.windowed_layers, gemma.window, gemma.windowed_layers) == (128, 12, 1024, 52)
    assert set(oss.linear_shapes()) == {"q_proj", "k_proj", "v_proj", "o_proj"}  # experts: no nn.Linear for LoRA
    more = model_shape({**known_config("gpt-oss-20b"), "num_local_experts": 64})
    assert activation_terms(more, 2)["mlp_saved"] == activation_terms(oss, 2)["mlp_saved"] + 4 * 32
    assert more.params - oss.params == 24 * 32 * (3 * 2880 * 2880 + 2880)


def test_windowed_layers_send_only_the_border():
    """A windowed layer within a zigzag chunk sends 2 (W - 1) keys and values forward and their
    float32 gradients back: flat in N, where a full layer's ring grows as N; a window longer than a
    chunk turns the ring as far as it reaches."""
    from hf_ring.planner.terms import attention_comm_bytes, window_comm_bytes

    gemma = model_shape("gemma-3-27b")
    kv = 2 * gemma.kv_heads * gemma.head_dim
    for n in (2**16, 2**20):
        border = window_comm_bytes(gemma, 2, n, 8)
        assert border["ring_forward"] == 2 * 1023 * kv * 2 and border["ring_backward"] == 2 * 1023 * kv * 4
    full = [attention_comm_bytes(gemma, 2, n, 8)["total"] for n in (2**16, 2**20)]
    assert full[1] == 16 * full[0]
    # 4K tokens on 8 ranks: chunks of 256, a window of 1024 reaches 4 chunks back -> all 7 hops
    assert window_comm_bytes(gemma, 2, 2**12, 8)["total"] == attention_comm_bytes(gemma, 2, 2**12, 8)["total"]
    # 32K: chunks of 2048 hold the window
    p = plan(gemma, PlanSettings(seq_len=2**17, gpus=8, cp=8, sharding="fsdp"))
    c = p.comm
    assert c["border"] and (c["full_layers"], c["windowed_layers"]) == (10, 52)
    assert c["total"] == 10 * c["full_layer_bytes"] + 52 * c["windowed_layer_bytes"]
    assert c["windowed_layer_bytes"] < c["full_layer_bytes"] / 50
    assert "52 windowed layers (1024 tokens, window border)" in p.table()
    # a model whose every layer is windowed keeps the border's K/V, not the ring's buffers
    mistral = model_shape({**known_config("Mistral-7B-v0.3"), "sliding_window": 4096})
    rows = [plan(mistral, PlanSettings(seq_len=n, gpus=8, cp=8)).rows["ring buffers (attention backward)"]
            for n in (2**17, 2**20)]  # fmt: skip
    assert rows[0] == pytest.approx(rows[1]) and rows[0] == pytest.approx(2 * 4095 * 2 * 8 * 128 * (2 + 4))


def test_smallest_cp_and_longest_sequence():
    assert smallest_cp(L8, PlanSettings(seq_len=2**17, gpus=8)) == 2
    assert smallest_cp(L8, PlanSettings(seq_len=2**20, gpus=8)) is None  # 1M on 8 GPUs needs offload
    assert smallest_cp(L8, PlanSettings(seq_len=2**20, gpus=8, offload=True)) == 8
    longest = max_seq_len(L8, PlanSettings(seq_len=0, gpus=8, offload=True))
    assert plan(L8, PlanSettings(seq_len=longest, gpus=8, offload=True, cp=8)).fits
    assert not plan(L8, PlanSettings(seq_len=longest + 1024, gpus=8, offload=True, cp=8)).fits


def test_cli_plan(capsys):
    assert tokens("128K") == 131072 and tokens("1M") == 2**20 and tokens("1.5M") == 1572864
    assert cli_main(["plan", "Llama-3.1-8B", "--seq-len", "1M", "--gpus", "8", "--offload"]) == 0
    out = capsys.readouterr().out
    assert "checkpointed activations" in out and "smallest CP size that fits: 8" in out and "ring overlap" in out
    args = ["plan", "Qwen2.5-7B", "--seq-len", "512K", "--gpus", "16", "--mode", "full", "--sharding", "fsdp", "--json"]
    assert cli_main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cp"] == data["smallest_fitting_cp"] and data["fits"] and data["model"]["vocab"] == 152064
    assert cli_main(["plan", "tiny-cpu-demo"]) == 0
    assert "tiny-cpu-demo" in capsys.readouterr().out


def test_every_recipe_states_the_planners_memory():
    recipes = packaged_recipes()
    assert recipes
    import yaml

    for path in recipes:
        stated = yaml.safe_load(path.read_text()).get("memory_gb")
        assert stated, f"{path.name}: no memory_gb; run hf-ring plan {path.name} --write"
        want = recipe_memory(path)
        for k, v in want.items():
            assert stated.get(k) == pytest.approx(v, abs=0.002), f"{path.name}: memory_gb.{k} {stated.get(k)} != {v}"


def test_plan_settings_are_keyword_only_and_the_cli_options():
    with pytest.raises(TypeError):
        PlanSettings(2**17, 8)  # type: ignore[misc]
    import argparse

    from hf_ring.cli import add_plan_options

    parser = argparse.ArgumentParser()
    add_plan_options(parser)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == {f.name for f in fields(PlanSettings)} - {"lora_targets"}  # every setting but a tuple
    args = ["--seq-len", "1M", "--tflops", "300", "--no-checkpointing", "--lora-bf16-adapters"]
    given = vars(parser.parse_args(args))
    assert given == {"seq_len": 2**20, "flops": 300e12, "checkpointing": False, "lora_fp32": False}


def test_cli_options_override_a_recipe(capsys):
    assert cli_main(["plan", "llama-3.1-8b-128k", "--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert cli_main(["plan", "llama-3.1-8b-128k", "--offload", "--gpus", "16", "--json"]) == 0
    over = json.loads(capsys.readouterr().out)
    assert (base["gpus"], base["cp"], base["settings"]["offload"]) == (8, 8, False)
    assert (over["gpus"], over["cp"], over["settings"]["offload"]) == (16, 8, True)
    assert over["peak_gib"] < base["peak_gib"] and over["host_gib"]["checkpointed activations"] > 0
    with pytest.raises(SystemExit, match="must divide"):
        cli_main(["plan", "llama-3.1-8b-128k", "--gpus", "12"])


def test_planner_imports_neither_torch_nor_transformers():
    """The planner and the recipe reader run with torch and transformers unimportable (the package
    ``hf_ring`` itself imports torch, so it is stood in for by an empty package of the same path)."""
    code = f"""
import sys, types
sys.modules["torch"] = sys.modules["transformers"] = None
pkg = types.ModuleType("hf_ring")
pkg.__path__ = [{str(Path(hf_ring.__file__).parent)!r}]
sys.modules["hf_ring"] = pkg
from hf_ring.planner import PlanSettings, model_shape, plan
from hf_ring.recipes import recipe_plan
p = plan(model_shape("Llama-3.1-8B"), PlanSettings(seq_len=2**17, gpus=8, loss_chunk=4096))
print(p.cp, recipe_plan("llama-3.1-8b-128k", loss_chunk=1024).fits)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "True"]
