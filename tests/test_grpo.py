"""``RingGRPOTrainer`` at CP = 2 against one-process ``trl.GRPOTrainer`` (sdpa) on the same tiny model,
prompts, completions and rewards, float32: the loss, every gradient at every optimizer step and the
logged metrics (but the two reward standard deviations, which TRL takes over every process's copy)
-- full fine-tuning with the ``dapo`` loss and LoRA with the ``grpo`` loss, the KL term against the
adapter-disabled reference and a sampling temperature; gradient accumulation over 2 micro-batches.
And generation as TRL does it: the ranks of a CP group train on the same completions, from
transformers' ``generate`` or from TRL's vLLM server mode (its client a stand-in, at CP = 2 and 4,
and on 4 processes as DP 2 x CP 2 against TRL's ``GRPOTrainer`` on 2, with DDP or through
``ParallelismConfig(dp_shard_size=2, cp_size=2)`` with FSDP2)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from testkit.post import Run
from testkit.spawn import launcher_env, run_ranks

pytest.importorskip("trl")

from tests.test_dpo import assert_same_runs  # noqa: E402
from tests.test_trl import _tokenizer  # noqa: E402

VOCAB = 64
CASES = {
    "full-dapo": dict(loss_type="dapo", beta=0.0, lora=False),
    "lora-grpo-kl-temperature": dict(loss_type="grpo", beta=0.05, temperature=0.7, lora=True),
}
SKIP = {"epoch", "step", "learning_rate", "train_runtime", "train_samples_per_second", "train_steps_per_second",
        "total_flos", "train_loss", "step_time", "reward_std", "rewards/reward_words/std"}  # fmt: skip
SEEN: list[list[str]] = []


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(3, 14, (8,), generator=g).tolist()
    return [{"prompt": " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (n,), generator=g))} for n in sizes]


def reward_words(completions: list[str], **_: object) -> list[float]:
    SEEN.append(list(completions))
    return [float(len(c.split()) % 5) + 0.5 * c.count("w1") for c in completions]


def _fixed_completions(cls: type) -> type:
    """``cls`` generating fixed completions (a function of the prompt and its place in the batch)."""

    class Fixed(cls):  # type: ignore[misc, valid-type]
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):  # noqa: ANN001, ANN202
            out = []
            for i, p in enumerate(prompt_ids):
                g = torch.Generator().manual_seed(int(sum(p)) * 31 + i % 4)
                n = int(torch.randint(2, 15, (1,), generator=g))
                out.append((torch.randint(3, VOCAB, (n,), generator=g)).tolist() + ([1] if n % 2 else []))
            return out, None

    return Fixed


def grpo_run(
    kind: str, case: str, out: str, tok_dir: str, fixed: bool = True, cp: int = 2, vllm: bool = False,
    mesh: bool = False, evals: bool = False,
) -> dict:  # fmt: skip
    """One run on this rank (``kind``: ``ring``, ``ref`` one process, ``ddp`` TRL over the launched processes);
    ``vllm``: TRL's vLLM server mode, its client the stand-in ``testkit.vllm_standin``; ``mesh``: the ring's
    CP size from ``ParallelismConfig(dp_shard_size=2, cp_size=cp)``, with FSDP2 (``testkit.fsdp``); ``evals``:
    an evaluation (generation, rewards, loss) after the second step."""
    from contextlib import nullcontext

    more: dict = {}
    if mesh:
        from accelerate.parallelism_config import ParallelismConfig

        more["parallelism_config"] = ParallelismConfig(dp_shard_size=2, cp_size=cp)
        cp = 1  # from the config
    if evals:
        more.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    if not vllm:
        return _grpo_run(kind, case, out, tok_dir, fixed, cp, **more)
    import trl.generation.vllm_generation as vg

    from testkit.fsdp import fsdp2_on_cpu
    from testkit.vllm_standin import VLLMClientStandIn

    before = vg.is_vllm_available, vg.VLLMClient
    vg.is_vllm_available, vg.VLLMClient = (lambda: True), VLLMClientStandIn
    VLLMClientStandIn.requests, VLLMClientStandIn.synced = [], []
    try:
        with fsdp2_on_cpu() if mesh else nullcontext():
            res = _grpo_run(kind, case, out, tok_dir, False, cp, use_vllm=True, vllm_mode="server", **more)
    finally:
        vg.is_vllm_available, vg.VLLMClient = before
    return {**res, "requests": VLLMClientStandIn.requests, "synced": VLLMClientStandIn.synced}


def _whole(grad: torch.Tensor) -> np.ndarray:
    """A gradient, gathered when FSDP2 holds it as ``DTensor`` shards."""
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().numpy().copy()


def keep_grads(grads: list, model: Callable[[], torch.nn.Module]) -> object:
    """A callback appending every trainable parameter of ``model()``'s gradient (gathered from FSDP2 shards)
    to ``grads`` just before each optimizer step."""
    from transformers import TrainerCallback

    class Keep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
            grads.append({n: _whole(p.grad) for n, p in model().named_parameters()
                          if p.requires_grad and p.grad is not None})  # fmt: skip

    return Keep()


def grpo_setup(kind: str, case: dict, out: str, fixed: bool, cp: int, **more: object) -> tuple:
    """The config, trainer class and LoRA flag of a run (``kind``: ``ring``, ``ref`` one process, ``ddp`` TRL
    over the launched processes): 2 optimizer steps of 2 micro-batches of 4 completions, SGD, float32."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_ring.trainer.grpo import RingGRPOConfig, RingGRPOTrainer

    spec = dict(case)
    lora = spec.pop("lora")
    ring = kind == "ring"
    if kind != "ref":
        launcher_env()
    common = dict(output_dir=out, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  num_generations=4, max_completion_length=16, learning_rate=0.05, optim="sgd", logging_steps=1,
                  report_to="none", use_cpu=True, disable_tqdm=True, bf16=False, save_strategy="no", seed=0,
                  **spec, **more)  # fmt: skip
    args = RingGRPOConfig(cp_size=cp, **common) if ring else GRPOConfig(**common)  # type: ignore[arg-type]
    cls = RingGRPOTrainer if ring else GRPOTrainer
    return args, _fixed_completions(cls) if fixed else cls, lora


def _grpo_run(kind: str, case: str, out: str, tok_dir: str, fixed: bool, cp: int, **more: object) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer

    from testkit.models import tiny_model

    args, cls, lora = grpo_setup(kind, CASES[case], out, fixed, cp, **more)
    model = tiny_model("llama", "ring" if kind == "ring" else "sdpa", vocab_size=VOCAB)
    extra: dict = {}
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    grads: list[dict] = []
    SEEN.clear()
    keep = keep_grads(grads, lambda: trainer.model)
    evals = Dataset.from_list(_prompts()[:4]) if getattr(args, "eval_strategy", "no") != "no" else None
    trainer = cls(model=model, reward_funcs=reward_words, args=args, train_dataset=Dataset.from_list(_prompts()),
                  eval_dataset=evals, processing_class=AutoTokenizer.from_pretrained(tok_dir), callbacks=[keep],
                  **extra)  # fmt: skip
    trainer.train()
    logs = [{k: v for k, v in h.items()
             if k.removeprefix("eval_") not in SKIP and not k.endswith(("_runtime", "_per_second"))}
            for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]  # fmt: skip
    return {"logs": logs, "grads": grads, "cp": getattr(trainer, "cp_size", None), "seen": list(SEEN)}


@pytest.mark.parametrize("case", list(CASES))
def test_ring_grpo_trainer_cp2_matches_single_process_grpo_trainer(tmp_path: Path, case: str) -> None:
    _tokenizer(tmp_path / "tok")
    ring = run_ranks(2, grpo_run, "ring", case, str(tmp_path / "ring"), str(tmp_path / "tok"), timeout=300)
    ref = run_ranks(1, grpo_run, "ref", case, str(tmp_path / "ref"), str(tmp_path / "tok"), timeout=300)[0]
    assert ring[0]["cp"] == 2 and len(ref["logs"]) == len(ring[0]["logs"]) == 2
    assert ring[0]["seen"] == ref["seen"], "the runs scored different completions"
    assert len(ref["grads"]) == len(ring[0]["grads"]) == 2
    assert_same_runs(case, ring, ref, "RingGRPOTrainer", "GRPOTrainer", Run.of("grpo", VOCAB, CASES[case]))


def test_ring_grpo_trainer_cp4_matches_single_process_grpo_trainer(tmp_path: Path) -> None:
    _tokenizer(tmp_path / "tok")
    ring = run_ranks(4, grpo_run, "ring", "full-dapo", str(tmp_path / "ring"), str(tmp_path / "tok"), True, 4,
                     timeout=400)  # fmt: skip
    ref = run_ranks(1, grpo_run, "ref", "full-dapo", str(tmp_path / "ref"), str(tmp_path / "tok"), timeout=300)[0]
    assert all(r["cp"] == 4 for r in ring) and len(ref["logs"]) == len(ring[0]["logs"]) == 2
    assert all(r["seen"] == ref["seen"] for r in ring), "the runs scored different completions"
    assert_same_runs("full-dapo", ring, ref, "RingGRPOTrainer", "GRPOTrainer",
                     Run.of("grpo", VOCAB, CASES["full-dapo"]))  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_ring_grpo_trainer_cp1_is_grpo_trainer(tmp_path: Path, case: str) -> None:
    """At ``cp_size=1`` ``RingGRPOTrainer`` with a ring-loaded model is TRL's ``GRPOTrainer``: transformers'
    ``generate`` (sampling, a KV cache) on left-padded prompts, the training steps and an evaluation."""
    _tokenizer(tmp_path / "tok")
    runs = {
        kind: run_ranks(
            1, grpo_run, kind, case, str(tmp_path / kind), str(tmp_path / "tok"), False, 1, evals=True, timeout=300
        )  # fmt: skip
        for kind in ("ring", "ref")
    }
    ring, ref = runs["ring"], runs["ref"][0]
    assert ring[0]["cp"] == 1 and len(ref["logs"]) == len(ring[0]["logs"]) == 3 and "eval_loss" in ref["logs"][-1]
    assert ring[0]["seen"] == ref["seen"], "the runs scored different completions"
    assert_same_runs(f"{case}-cp1", ring, ref, "RingGRPOTrainer", "GRPOTrainer", Run.of("grpo", VOCAB, CASES[case]))


def test_ring_grpo_trainer_generates_once_per_cp_group(tmp_path: Path) -> None:
    """transformers' generate with sampling: both ranks of the CP group score the same completions."""
    _tokenizer(tmp_path / "tok")
    ring = run_ranks(2, grpo_run, "ring", "full-dapo", str(tmp_path / "ring"), str(tmp_path / "tok"), False,
                     timeout=300)  # fmt: skip
    assert ring[0]["seen"] == ring[1]["seen"] and len(ring[0]["seen"]) == 2
    assert all(np.isfinite(h["loss"]) for h in ring[0]["logs"]) and ring[0]["logs"] == ring[1]["logs"]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_grpo_trainer_vllm_server_mode_matches_single_process(tmp_path: Path, cp: int) -> None:
    """``use_vllm=True, vllm_mode="server"`` (TRL's client replaced by ``testkit.vllm_standin``, whose
    completions are a fixed function of the prompt): the server is asked for the CP group's prompts
    once, exactly the prompts one process asks for, and the run (with vLLM's importance sampling
    correction) equals one-process ``GRPOTrainer``'s."""
    _tokenizer(tmp_path / "tok")
    tok = str(tmp_path / "tok")
    ring = run_ranks(cp, grpo_run, "ring", "full-dapo", str(tmp_path / "ring"), tok, False, cp, True, timeout=400)
    ref = run_ranks(1, grpo_run, "ref", "full-dapo", str(tmp_path / "ref"), tok, False, 2, True, timeout=300)[0]
    assert ring[0]["requests"] == ref["requests"] and len(ref["requests"]) == 2  # one generation batch per step
    assert [len(q) for q in ref["requests"]] == [2, 2] and all(not r["requests"] for r in ring[1:])  # main process
    assert ring[0]["synced"] == ref["synced"] and ref["synced"][0] > 0  # the weights were streamed
    assert all(r["seen"] == ref["seen"] for r in ring), "the runs scored different completions"
    assert_same_runs(f"vllm-server-cp{cp}", ring, ref, "RingGRPOTrainer", "GRPOTrainer",
                     Run.of("grpo", VOCAB, CASES["full-dapo"]))  # fmt: skip


def test_refusals() -> None:
    from hf_ring.trainer.grpo import _refuse

    class Args:
        cp_size, use_vllm, scale_rewards = 2, False, "batch"

    with pytest.raises(NotImplementedError, match="scale_rewards='batch'"):
        _refuse(Args())
    Args.scale_rewards, Args.entropy_coef = "group", 0.01
    with pytest.raises(NotImplementedError, match="entropy_coef"):
        _refuse(Args())
    Args.entropy_coef, Args.use_vllm, Args.vllm_mode = 0.0, True, "colocate"
    with pytest.raises(NotImplementedError, match="use_vllm with vllm_mode='colocate'"):
        _refuse(Args())
    Args.vllm_mode = "server"
    _refuse(Args())  # server mode: one request per CP group
    Args.cp_size, Args.vllm_mode = 1, "colocate"
    _refuse(Args())


def test_image_prompts_are_refused_under_context_parallelism_where_not_exact(tmp_path: Path) -> None:
    """Image prompts run at CP > 1 for Qwen-style models and Gemma 3, generating with transformers or the vLLM
    server (tests/test_grpo_vlm.py); Llama 4 is refused by name when the trainer is built."""
    from hf_ring.trainer.grpo import _refuse_images, has_image_prompts
    from testkit.vlm import tiny_model

    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w1"}]}]
    assert has_image_prompts([{"prompt": "w1", "images": ["x"]}]) and has_image_prompts([{"prompt": image}])
    assert has_image_prompts({"a": [{"prompt": "w1"}], "b": [{"prompt": "w1", "image": "x"}]})
    assert not has_image_prompts([{"prompt": "w1"}]) and not has_image_prompts([{"prompt": "w1", "images": []}])
    _refuse_images(tiny_model("qwen3_vl", "sdpa"))
    _refuse_images(tiny_model("gemma3", "sdpa"))
    with pytest.raises(NotImplementedError, match="Llama 4 are not supported.*absolute position.*cp_size=1"):
        _refuse_images(tiny_model("llama4", "sdpa"))
    run_ranks(2, _refuse_llama4_images, str(tmp_path / "out"), timeout=200)


def _refuse_llama4_images(out: str) -> None:
    from datasets import Dataset
    from PIL import Image

    from hf_ring.trainer.grpo import RingGRPOConfig, RingGRPOTrainer
    from testkit.vlm import tiny_model, tiny_processor

    launcher_env()
    image = Image.fromarray(np.zeros((8, 8, 3), dtype="uint8"))
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "w1 w2"}], "image": image}] * 4)
    args = RingGRPOConfig(output_dir=out, cp_size=2, use_cpu=True, report_to="none", per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=4)  # fmt: skip
    with pytest.raises(NotImplementedError, match="image prompts with Llama 4 .*absolute position.*cp_size=1"):
        RingGRPOTrainer(model=tiny_model("llama4", "ring", dtype=torch.float32), reward_funcs=reward_words,
                        args=args, train_dataset=data, processing_class=tiny_processor())  # fmt: skip


@pytest.mark.parametrize("mesh", [False, True])
def test_ring_grpo_trainer_vllm_server_mode_dp2_matches_trl_over_2_processes(tmp_path: Path, mesh: bool) -> None:
    """4 processes, 2 CP groups of 2 (``cp_size=2``, DDP; or ``ParallelismConfig(dp_shard_size=2, cp_size=2)``
    with FSDP2 over all 4): the vLLM server (stand-in) is asked once per generation for the 2 groups'
    prompts, as TRL's ``GRPOTrainer`` on 2 processes asks for its 2 processes', and the runs are equal."""
    _tokenizer(tmp_path / "tok")
    tok = str(tmp_path / "tok")
    ring = run_ranks(4, grpo_run, "ring", "full-dapo", str(tmp_path / "ring"), tok, False, 2, True, mesh,
                     timeout=400)  # fmt: skip
    ddp = run_ranks(2, grpo_run, "ddp", "full-dapo", str(tmp_path / "ddp"), tok, False, 2, True, timeout=300)
    assert all(r["cp"] == 2 for r in ring) and len(ring[0]["logs"]) == len(ddp[0]["logs"]) == 2
    assert ring[0]["requests"] == ddp[0]["requests"] and [len(q) for q in ring[0]["requests"]] == [4, 4]
    assert all(not r["requests"] for r in ring[1:])
    assert ring[0]["synced"] == ddp[0]["synced"] and ddp[0]["synced"][0] > 0  # every weight streamed, FSDP2 too
    assert ring[0]["seen"] == ring[1]["seen"] == ddp[0]["seen"] and ring[2]["seen"] == ring[3]["seen"] == ddp[1]["seen"]
    assert_same_runs(f"vllm-server-dp2-cp2{'-fsdp2' if mesh else ''}", ring, ddp[0], "RingGRPOTrainer", "GRPOTrainer",
                     Run.of("grpo", VOCAB, CASES["full-dapo"]))  # fmt: skip


def test_one_request_per_cp_group_asks_each_group_once_and_hands_its_ranks_the_same_completions() -> None:
    """World 4 = 2 CP groups of 2: TRL's main process gathers 4 ranks' prompts (1 distinct prompt each, n = 2
    completions); the server is asked for the 2 groups' prompts, and ranks 0, 1 get group 0's completions."""
    from hf_ring.trainer.grpo import one_request_per_cp_group
    from testkit.vllm_standin import VLLMClientStandIn

    VLLMClientStandIn.requests = []
    client = VLLMClientStandIn()
    a, b = [5, 6, 7], [9, 10]
    one_request_per_cp_group(client, world=4, cp_size=2)
    one_request_per_cp_group(client, world=4, cp_size=2)  # once only
    out = client.generate(prompts=[a, a, b, b], n=2, max_tokens=8, logprobs=0)
    assert VLLMClientStandIn.requests == [[a, b]]
    once = VLLMClientStandIn().generate(prompts=[a, b], n=2, max_tokens=8, logprobs=0)
    assert out["prompt_ids"] == [a, a, b, b]
    for key in ("completion_ids", "logprobs", "logprob_token_ids"):
        ga, gb = once[key][:2], once[key][2:]
        assert out[key] == ga + ga + gb + gb, key  # TRL's slice for rank r: entries 2r, 2r + 1
    with pytest.raises(RuntimeError, match="rank 1 asked vLLM for other prompts than rank 0"):
        client.generate(prompts=[a, b, b, b], n=2)
