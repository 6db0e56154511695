"""Group relative policy optimisation with context parallelism: ``RingGRPOTrainer`` and ``RingGRPOConfig``.

``RingGRPOTrainer`` is ``RingTrainer`` mixed into ``trl.GRPOTrainer``. Completions are generated as
TRL generates them with transformers (``model.generate``, one generation per DP replica: the ranks
of a CP group generate on the whole prompt -- a ring model called without ``shard_batch`` computes as one
process, transformers' SDPA --, and the group's first rank's
completions are broadcast to the others, so that they train on the same ones); rewards and
advantages are TRL's; then the policy's (and, with ``beta > 0``, the reference's) per-token
log-probabilities over prompt + completion are computed under CP (``hf_ring.trainer.fused_head``:
each rank holds ``1/P`` of every sequence; TRL's left-padded prompts are moved to the right first)
and TRL's loss (``loss_type`` grpo, dr_grpo, dapo, bnpo, cispo, ...) runs on them unchanged::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ring")
    args = RingGRPOConfig(output_dir="out", cp_size=4, max_completion_length=65536, bf16=True)
    RingGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts).train()

With ``use_vllm=True, vllm_mode="server"`` TRL's main process asks the vLLM server for the
completions of every process's prompts; here it asks for each CP group's prompts once and every rank
of the group gets the group's completions (``one_request_per_cp_group``), so the ranks train on the
same completions and vLLM's sampling log-probabilities (importance sampling correction) come along.

Image prompts (conversational prompts with an ``image`` / ``images`` column, a processor, a Qwen-style
vision-language model: ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) generate on every rank
of the group with the images and are scored as TRL scores them: the fused head moves each row's left padding
to the right with its ``mm_token_type_ids`` (the model's M-RoPE positions come from the real tokens only) and
hands the images to ``shard_batch`` whole (tests/test_grpo_vlm.py); Gemma 3's image prompts the same way, with
its ``token_type_ids`` (its image blocks) moved with the rows; with the vLLM server the images' features are
asked for and paired with the prompts once per CP group too. Refused with images at ``cp_size > 1``: Llama 4.

Refused at ``cp_size > 1`` (each would see the CP group's duplicated rewards or entropies, or is not
wired yet): ``vllm_mode="colocate"``, ``scale_rewards="batch"``, ``multi_objective_aggregation="normalize_then_sum"``,
``top_entropy_quantile < 1``, the entropy bonus (``entropy_coef != 0``, ``use_adaptive_entropy``:
the entropy computed here has no gradient), ``cast_lm_head_to_fp32``. The logged ``reward_std``
and ``rewards/<name>/std`` are computed by
TRL over the rewards of all processes, each CP group's ``P`` times: their sample-size correction
then differs slightly from one device's (the loss and the advantages do not depend on them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from trl import GRPOConfig, GRPOTrainer

from ..ledger import LEDGER
from .arguments import RingTrainingArguments
from .fused_head import RingTrainerForTRL
from .mesh import parallelism_sizes

__all__ = ["RingGRPOConfig", "RingGRPOTrainer", "one_request_per_cp_group"]


@dataclass
class RingGRPOConfig(GRPOConfig, RingTrainingArguments):
    """``trl.GRPOConfig`` (its defaults) plus ``cp_size``, ``ulysses_size``, ``chunked_loss``, ``tiled_mlp``,
    ``activation_offload``. The generation batch spans the DP replicas (``world_size / cp_size``
    processes, not ``world_size``), and each replica's share holds whole groups of
    ``num_generations`` completions. A ``parallelism_config`` with ``cp_size > 1`` (which TRL's
    ``GRPOConfig`` refuses: its CP would shard the raw generation batch) is hf_ring's CP size."""

    def __post_init__(self) -> None:
        given = self.generation_batch_size
        pc = self.parallelism_config
        sizes = parallelism_sizes(self)
        if sizes is not None and self.cp_size == 1:
            self.cp_size = sizes["cp_size"]
        if pc is not None and sizes is not None:
            self.parallelism_config = None  # hidden from GRPOConfig's check; RingGRPOTrainer adopts it
        try:
            super().__post_init__()
        finally:
            self.parallelism_config = pc
        cp = self.cp_size or 1
        if cp <= 1:
            return
        if self.world_size % cp:
            raise ValueError(f"RingGRPOConfig: world size {self.world_size} is not a multiple of cp_size={cp}")
        replicas = self.world_size // cp
        if given is not None:
            if given % (self.per_device_train_batch_size * replicas):
                raise ValueError(
                    f"RingGRPOConfig: generation_batch_size={given} must be a multiple of per_device_train_batch_size "
                    f"x DP replicas = {self.per_device_train_batch_size * replicas} (world size / cp_size)."
                )
            self.steps_per_generation = given // (self.per_device_train_batch_size * replicas)
        self.generation_batch_size = self.per_device_train_batch_size * replicas * self.steps_per_generation
        if (self.per_device_train_batch_size * self.steps_per_generation) % self.num_generations:
            raise ValueError(
                "RingGRPOConfig: with cp_size > 1 each DP replica's generation batch (per_device_train_batch_size x "
                f"steps_per_generation = {self.per_device_train_batch_size * self.steps_per_generation}) must hold "
                f"whole groups of num_generations={self.num_generations}; raise per_device_train_batch_size or "
                "steps_per_generation, or lower num_generations."
            )


def _refuse(args: Any) -> None:
    if (getattr(args, "cp_size", 1) or 1) <= 1:
        return
    bad = {
        # colocated vLLM engines would each hold the whole prompt and sample on their own
        "use_vllm with vllm_mode='colocate'": bool(getattr(args, "use_vllm", False))
        and getattr(args, "vllm_mode", "server") != "server",
        "scale_rewards='batch'": getattr(args, "scale_rewards", "group") == "batch",
        "multi_objective_aggregation='normalize_then_sum'": getattr(args, "multi_objective_aggregation", "")
        == "normalize_then_sum",
        "top_entropy_quantile < 1": getattr(args, "top_entropy_quantile", 1.0) < 1.0,
        # hf_ring's LM head runs in the model's (autocast) dtype, as the chunked loss does
        "cast_lm_head_to_fp32": bool(getattr(args, "cast_lm_head_to_fp32", False)),
        # the entropy of hf_ring's chunked log-probabilities carries no gradient (a metric only)
        "entropy_coef != 0 or use_adaptive_entropy": bool(getattr(args, "entropy_coef", 0.0))
        or bool(getattr(args, "use_adaptive_entropy", False)),
    }
    found = [k for k, v in bad.items() if v]
    if found:
        raise NotImplementedError(
            f"RingGRPOTrainer: {', '.join(found)} is not supported with cp_size > 1 (TRL would compute it over the "
            "CP group's duplicated rewards or entropies, or it is not wired to the ring yet); set it back to its "
            "default (vllm_mode='server' or use_vllm=False, scale_rewards='group', "
            "multi_objective_aggregation='sum_then_normalize', "
            "top_entropy_quantile=1.0, entropy_coef=0.0, use_adaptive_entropy=False, cast_lm_head_to_fp32=False) "
            "or train with cp_size=1."
        )


def _refuse_images(model: Any) -> None:
    """Image prompts at ``cp_size > 1`` run for Qwen-style vision-language models (``image_grid_thw``,
    ``mm_token_type_ids``, M-RoPE) and Gemma 3 (``token_type_ids``: its image blocks); refuse the rest by name."""
    from ..transformers.multimodal import VLM_FAMILIES

    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    families = {VLM_FAMILIES[type(m).__name__] for m in modules if type(m).__name__ in VLM_FAMILIES}
    other = sorted(f for f in families if not f.startswith("Qwen") and f != "Gemma 3")
    if other:
        why = {
            # transformers 5.x modeling_llama4.py, Llama4TextAttention.forward: attn_temperature_tuning
            "Llama 4": "its NoPE layers scale the queries by the absolute position, which moving GRPO's left "
            "padding to the right would change",
        }
        raise NotImplementedError(
            f"RingGRPOTrainer: image prompts with {', '.join(other)} are not supported with cp_size > 1 "
            f"({'; '.join(why.get(f, 'untested') for f in other)}); Qwen-style models (Qwen3-VL, Qwen3.5) and "
            "Gemma 3 run them. Train this model's image prompts with cp_size=1."
        )


def has_image_prompts(dataset: Any) -> bool:
    """Whether ``dataset``'s first example holds images as TRL's ``GRPOTrainer`` reads them: an
    ``image`` or ``images`` column, or a conversational prompt with an ``{"type": "image"}`` part."""
    if isinstance(dataset, dict):  # eval datasets by name
        return any(has_image_prompts(d) for d in dataset.values())
    if dataset is None:
        return False
    try:
        example = next(iter(dataset))
    except (StopIteration, TypeError):
        return False
    if not isinstance(example, dict):
        return False
    if example.get("image") is not None or example.get("images"):
        return True
    prompt = example.get("prompt")
    messages = prompt if isinstance(prompt, list) else []
    parts = [p for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for p in m["content"]]
    return any(isinstance(p, dict) and p.get("type") == "image" for p in parts)


def _group_slices(values: list, world: int, cp_size: int, what: str) -> tuple[list, int]:
    """The entries of the CP groups' first ranks in ``values`` (``len(values) / world`` per rank, in rank order),
    checked equal to the other ranks' of their group, and the count per rank."""
    if len(values) % world:
        raise RuntimeError(f"hf_ring: {len(values)} {what} from {world} processes; expected a multiple")
    m = len(values) // world
    for r in range(world):
        first = r - r % cp_size
        if values[r * m : (r + 1) * m] != values[first * m : (first + 1) * m]:
            raise RuntimeError(
                f"hf_ring: rank {r} asked vLLM for other {what} than rank {first} of its CP group; the ranks of "
                "a CP group must hold the same batch."
            )
    return [v for g in range(0, world, cp_size) for v in values[g * m : (g + 1) * m]], m


def _spread(values: list | None, per: int, world: int, cp_size: int) -> list | None:
    """Each rank's block of ``per`` entries: its CP group's block of ``values`` (the groups' blocks in order)."""
    if values is None:
        return None
    return [v for r in range(world) for v in values[(r // cp_size) * per : (r // cp_size + 1) * per]]


def one_request_per_cp_group(client: Any, world: int, cp_size: int) -> None:
    """Make ``client.generate`` and ``client.image_features`` (TRL's ``VLLMClient`` on the main process, vLLM
    server mode) ask the server for the prompts (and images) of each CP group's first rank only and hand the
    group's other ranks the same completions (and features).

    TRL gathers every process's prompts and images (``len(prompts) / n`` distinct ones each, in rank order),
    asks the server for the images' features, pairs them with the prompts, asks once for all completions, and
    gives each process the slice at its rank (``trl/generation/vllm_generation.py``, ``VLLMGeneration.generate``
    585-650, TRL 1.16). The ranks of a CP group hold the same prompts and must train on the same completions:
    here the server processes and samples each group's prompts once (not ``cp_size`` times), and every rank's
    slice is its group's."""
    if LEDGER.find(client, "generate") is not None:
        return
    ask, features_of = client.generate, getattr(client, "image_features", None)

    def generate(prompts: list, features: list | None = None, n: int = 1, **kwargs: Any) -> dict:
        asked, m = _group_slices(prompts, world, cp_size, "prompts")
        feats = None if features is None else _group_slices(features, world, cp_size, "image features")[0]
        out = ask(prompts=asked, features=feats, n=n, **kwargs)
        return {k: _spread(v, m if k == "prompt_ids" else m * n, world, cp_size) for k, v in out.items()}

    def image_features(images: list, *args: Any, **kwargs: Any) -> list:
        asked, m = _group_slices(images, world, cp_size, "images")
        return _spread(features_of(asked, *args, **kwargs), m, world, cp_size)  # type: ignore[misc, return-value]

    why = "RingGRPOTrainer: the vLLM server asked once per CP group, each rank given its group's slice"
    LEDGER.set_attr(client, "generate", generate, why=why, scope="model")
    if features_of is not None:
        LEDGER.set_attr(client, "image_features", image_features, why=why, scope="model")


class RingGRPOTrainer(RingTrainerForTRL, GRPOTrainer):
    """``trl.GRPOTrainer`` with context parallelism: see the module docstring. Takes ``GRPOTrainer``'s
    arguments (by keyword after ``model``), plus ``cp_size`` and ``ulysses_size`` (or in ``args``)."""

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, **kwargs: Any) -> None:
        _refuse(args)
        sizes = parallelism_sizes(args)  # a ParallelismConfig's (or the launcher's) CP size, else cp_size
        cp_size = sizes["cp_size"] if sizes else kwargs.get("cp_size") or getattr(args, "cp_size", 1) or 1
        if cp_size > 1 and any(has_image_prompts(kwargs.get(k)) for k in ("train_dataset", "eval_dataset")):
            _refuse_images(model)  # before TRL's init runs anything (a model given by name: at the fused head)
        temperature = float(getattr(args, "temperature", 1.0) or 1.0)
        self._ring_init(model, args, ("entropy",), temperature, reward_funcs=reward_funcs, **kwargs)
        client = getattr(getattr(self, "vllm_generation", None), "vllm_client", None)  # the main process's
        if client is not None and self.cp_size > 1:
            one_request_per_cp_group(client, self.accelerator.num_processes, self.cp_size)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's, every rank of a CP group generating on the whole prompts (a ring model called without
        ``shard_batch`` computes as one process), then training on its group's first rank's completions."""
        out = super()._generate_single_turn(*args, **kwargs)
        cp = self._cp
        if cp is None or cp.cp_size == 1:
            return out
        box = [out]  # the CP group trains on its first rank's completions
        dist.broadcast_object_list(box, src=dist.get_global_rank(cp.cp_group, 0), group=cp.cp_group)
        return box[0]

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """TRL's, with the CP group's random state made its first rank's first: TRL shuffles each
        generation batch before it splits it into micro-batches, and the group must cut the same ones."""
        cp = self._cp
        if cp is not None and cp.cp_size > 1 and self.model.training:
            state = torch.get_rng_state()
            dist.broadcast(state, src=dist.get_global_rank(cp.cp_group, 0), group=cp.cp_group)
            torch.set_rng_state(state)
        return super()._prepare_inputs(generation_batch)

    def _generate(self, prompts: Any) -> Any:
        """TRL's, counting each CP group's tokens once (TRL sums them over all processes)."""
        before = self.state.num_input_tokens_seen
        out = super()._generate(prompts)
        if self.cp_size > 1:
            seen = before + (self.state.num_input_tokens_seen - before) // self.cp_size
            self.state.num_input_tokens_seen = seen
            self._metrics["train" if self.model.training else "eval"]["num_tokens"] = [seen]
        return out
