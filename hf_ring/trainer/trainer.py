"""``RingTrainer``: a drop-in for Hugging Face ``Trainer`` that trains with context parallelism.

Launch one process per device (``torchrun --nproc_per_node K train.py`` or ``accelerate launch``);
the world is cut into CP groups of ``cp_size`` consecutive ranks (see ``setup_context_parallel``),
the rest is data parallelism (DP). Compared with ``Trainer``, ``RingTrainer``

* gives every rank of a CP group the same batches and the DP replicas different ones (its data
  loaders are split over the DP replicas, not over all processes);
* counts the valid targets of each optimizer step over its gradient-accumulation window and the DP
  replicas (not over the CP duplicates), and passes each batch through ``shard_batch``, so the loss
  it logs is the mean over all those targets, as on one device, and the gradients after DDP's
  averaging are those of one device running the whole step;
* refuses a model whose ``attn_implementation`` is not ``"ring"`` when ``cp_size > 1``.

``RingTrainingArguments`` adds the model-side options of long sequences, applied to the model
``RingTrainer`` is given: ``chunked_loss`` (default on), ``tiled_mlp``, ``activation_offload``
(with ``Trainer``'s own ``activation_checkpointing``, alias ``gradient_checkpointing``). Logs also
carry ``seq_len`` and ``tokens_per_second``. Everything else (optimizers, schedulers, logging
through ``report_to``, progress bar, checkpoints and resume, FSDP2, PEFT models, callbacks) is
``Trainer``'s. See docs/trainer.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

from ..data.loader import count_targets
from ..parallel import ContextParallel, context_parallel_state, set_attention_backend, setup_context_parallel
from ..planner.grids import choose_ulysses_size
from ..transformers.batch import next_token_targets, shard_batch
from ..transformers.context import CONTEXT_KEY
from ..transformers.support import check_model
from .arguments import RingTrainingArguments, apply_model_options
from .mesh import adopt_parallelism_config, check_layout, parallelism_sizes
from .replicas import ReplicaMixin, Throughput
from .saving import CheckpointMixin
from .timeouts import exit_after_timeout, explain, is_timeout

__all__ = ["RingTrainer", "RingTrainingArguments", "resolve_ulysses_size"]


def _attn_implementation(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def _gpus_per_node(cp_size: int) -> int:
    """Processes per node: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun, accelerate), else the
    visible CUDA devices, else ``cp_size`` (one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return cp_size


def resolve_ulysses_size(model: nn.Module, cp_size: int, gpus_per_node: int | None = None) -> int:
    """``ulysses_size="auto"`` for ``model``: ``hf_ring.planner.choose_ulysses_size`` of its
    config's ``num_attention_heads`` and ``num_key_value_heads`` (the text config of a multimodal
    model), ``cp_size`` and ``gpus_per_node`` (default: ``LOCAL_WORLD_SIZE``, else the visible CUDA
    devices, else ``cp_size``)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError(
            'RingTrainer: ulysses_size="auto" reads num_attention_heads from model.config, which this model '
            "lacks; pass an int ulysses_size (1: ring attention only)."
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    gpus = gpus_per_node if gpus_per_node is not None else _gpus_per_node(cp_size)
    return choose_ulysses_size(heads, kv_heads, cp_size, gpus)


def _launched() -> bool:
    return dist.is_available() and (dist.is_initialized() or "WORLD_SIZE" in os.environ)


class RingTrainer(CheckpointMixin, ReplicaMixin, Trainer):
    """``transformers.Trainer`` with context parallelism over ``cp_size`` processes per sequence.

    Takes ``Trainer``'s arguments, plus ``cp_size`` (default: ``args.cp_size`` when ``args`` is a
    ``RingTrainingArguments``, else the CP size of an earlier ``setup_context_parallel`` call, else
    1) and ``ulysses_size`` (the same way; see ``setup_context_parallel``; ``"auto"``:
    ``hf_ring.planner.choose_ulysses_size`` from the model's ``num_attention_heads`` and
    ``num_key_value_heads``, the GPUs per node (``LOCAL_WORLD_SIZE`` from the launcher, else the
    visible CUDA devices, else ``cp_size``) and ``cp_size``).
    ``per_device_train_batch_size`` is the batch of one DP replica (one CP group), and the global
    batch of an optimizer step is ``per_device_train_batch_size * gradient_accumulation_steps
    * world_size / cp_size``. The model must be a causal LM whose loss comes from transformers'
    ``ForCausalLM`` loss; ``compute_loss_func`` and label smoothing are not supported.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *rest: Any,
        cp_size: int | None = None,
        ulysses_size: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        requested = cp_size if cp_size is not None else getattr(args, "cp_size", None)
        self._parallelism = parallelism_sizes(args) or getattr(self, "_parallelism", None)
        adopted = adopt_parallelism_config(args, requested)  # accelerate's ParallelismConfig(cp_size=...)
        if adopted != requested:
            cp_size = adopted
        args_u = getattr(args, "ulysses_size", None)
        if ulysses_size is not None and args_u is not None and ulysses_size != args_u:
            raise ValueError(
                f"RingTrainer: ulysses_size={ulysses_size} but args.ulysses_size={args_u}; pass one of them."
            )
        if ulysses_size is None:
            ulysses_size = args_u
        args_cp = getattr(args, "cp_size", None)
        if cp_size is not None and args_cp is not None and cp_size != args_cp:
            raise ValueError(f"RingTrainer: cp_size={cp_size} but args.cp_size={args_cp}; pass one of them.")
        if cp_size is None:
            cp_size = args_cp
        if cp_size is None:
            state = context_parallel_state()
            cp_size = state.cp_size if state is not None else 1
        if cp_size < 1:
            raise ValueError(f"RingTrainer: cp_size must be >= 1, got {cp_size}")
        if cp_size > 1 and not _launched():
            raise RuntimeError(
                f"RingTrainer: cp_size={cp_size} needs a multiple of {cp_size} processes, but no launcher "
                f"environment was found; start the script with `torchrun --nproc_per_node {cp_size} ...` "
                f"or `accelerate launch --num_processes {cp_size} ...`."
            )
        self._cp_size_requested = cp_size
        if model is not None:
            self._check_attention(model)
            self._check_model(model)
        if kwargs.get("compute_loss_func") is not None:
            raise NotImplementedError(
                "RingTrainer: compute_loss_func is not supported; the loss is the model's causal-LM loss, "
                "summed over the CP group (the model only sees this rank's shard of the sequence)."
            )
        if args is not None and args.label_smoothing_factor:
            raise NotImplementedError("RingTrainer: label_smoothing_factor is not supported.")
        if model is not None and args is not None:
            apply_model_options(model, args)
        if getattr(args, "attention_backend", None) is not None:
            set_attention_backend(args.attention_backend)  # type: ignore[union-attr]
        if rest:
            super().__init__(model, args, *rest, **kwargs)
        else:  # by keyword: TRL's trainers take other arguments between model and args (DPOTrainer's ref_model)
            super().__init__(model=model, args=args, **kwargs)

        self._cp: ContextParallel | None = None
        if ulysses_size == "auto":
            ulysses_size = resolve_ulysses_size(self.model, cp_size)
        if cp_size > 1 or (dist.is_available() and dist.is_initialized()):
            state = context_parallel_state()
            if state is None:
                state = setup_context_parallel(
                    cp_size, ulysses_size=ulysses_size or 1, timeout=self.args.ddp_timeout_delta
                )
            elif state.cp_size != cp_size:
                raise ValueError(
                    f"RingTrainer: cp_size={cp_size}, but setup_context_parallel was already called with "
                    f"cp_size={state.cp_size}; pass the same size (or omit cp_size to use it)."
                )
            elif ulysses_size is not None and state.ulysses_size != ulysses_size:
                raise ValueError(
                    f"RingTrainer: ulysses_size={ulysses_size}, but setup_context_parallel was already called with "
                    f"ulysses_size={state.ulysses_size}; pass the same size (or omit ulysses_size to use it)."
                )
            self._cp = state
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.args.world_size:
            raise RuntimeError(
                f"RingTrainer: {dist.get_world_size()} processes were launched, but Trainer runs as if there were "
                f"{self.args.world_size} (accelerate state {self.accelerator.distributed_type}): on a machine without "
                "a GPU, pass use_cpu=True (--use_cpu true) so that Trainer uses the launched processes over gloo."
            )
        asked = bool(self.args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        check_layout(self._parallelism, self.args.world_size, bool(self.is_fsdp_enabled), asked,
                     str(self.accelerator.distributed_type))  # fmt: skip
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and cp_size > 1:
            raise ValueError(
                "RingTrainer: do not combine cp_size with TrainingArguments.parallelism_config (accelerate's "
                "own context/tensor parallelism); RingTrainer builds the DP x CP layout itself."
            )
        if cp_size > 1 and self.args.train_sampling_strategy == "batch_rebalance":
            raise NotImplementedError(
                "RingTrainer: train_sampling_strategy='batch_rebalance' splits batches over all processes; "
                "use 'random', 'sequential' or 'group_by_length' with cp_size > 1."
            )
        # compute_loss normalises by the targets of the whole accumulation window itself.
        self.loss_is_scaled_for_ga = True
        self._unshard_logits = False
        self._window = Throughput()

    def _check_attention(self, model: nn.Module) -> None:
        attn = _attn_implementation(model)
        if self._cp_size_requested > 1 and attn != "ring":
            raise ValueError(
                f"RingTrainer: cp_size={self._cp_size_requested} needs the model loaded with "
                f'attn_implementation="ring" (this one uses {attn!r}): each rank holds only a shard of the '
                'sequence. Use from_pretrained(..., attn_implementation="ring") after `import hf_ring`, '
                'or model.set_attn_implementation("ring").'
            )

    def _check_model(self, model: nn.Module) -> None:
        """What the ring would refuse at the first forward (``support.check_model``), refused now."""
        if _attn_implementation(model) == "ring":
            check_model(model, self._cp_size_requested)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        model = super().call_model_init(trial)
        self._check_model(model)
        return apply_model_options(model, self.args)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step: the CP ranks of a replica share their batch."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.dp_size

    # --- loss ---------------------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """Valid next-token targets of these micro-batches, summed over the DP replicas only
        (``Trainer`` would sum over all processes, counting each CP group's batch ``cp_size`` times)."""
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        for b in batch_samples:  # shifted once: shard_batch uses them as they are
            if b.get("labels") is not None and b.get("shift_labels") is None:
                b["shift_labels"] = next_token_targets(b["labels"], b.get("attention_mask"), b.get("position_ids"))
        return count_targets(batch_samples, self._dp_group).to(device)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The loss of this rank's shard, summed over the CP group, times ``dp_size``.

        ``num_items_in_batch`` counts the targets of all DP replicas, so each CP group's loss is its
        share of the step's mean; ``shard_batch(..., dp_size=...)`` makes every rank report it times
        ``dp_size``, which is what ``Trainer`` expects per process (it averages the logged loss over
        all processes, as it does with ``average_tokens_across_devices``), and scales the backward by
        ``cp_size * dp_size`` in all: DDP's averaging over the ``dp_size * cp_size`` processes then
        gives the gradient of one device running the step (``RingContext.reduce_loss``).
        """
        self._check_attention(self.model)
        if inputs.get("labels") is None:
            raise ValueError("RingTrainer: the batch has no labels; the data collator must produce `labels`.")
        if num_items_in_batch is None:
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        kwargs = shard_batch(
            {**inputs, "num_items_in_batch": num_items_in_batch},
            group=self._cp,
            pad_token_id=pad if isinstance(pad, int) else 0,
            dp_size=self.dp_size,
            full_logits=self._unshard_logits,
        )
        if model.training:
            self._window.add(inputs)
        outputs = model(**kwargs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if return_outputs and self._unshard_logits and "logits" in outputs:
            # the batch's context knows its layout (zigzag, or per document for packed batches)
            outputs["logits"] = kwargs[CONTEXT_KEY].unshard(outputs["logits"])[:, : inputs["labels"].shape[1]]
        return (loss, outputs) if return_outputs else loss

    # --- evaluation ---------------------------------------------------------------------------
    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        if not has_labels:  # Trainer would run the model on the full sequence: shard it ourselves
            if prediction_loss_only:
                return (None, None, None)
            inputs = self._prepare_inputs(inputs)
            key = "input_ids" if "input_ids" in inputs else "inputs_embeds"
            with torch.no_grad():
                kwargs = shard_batch(dict(inputs), group=self._cp)
                out = model(**kwargs)
            logits = kwargs[CONTEXT_KEY].unshard(out["logits"])[:, : inputs[key].shape[1]]
            return (None, logits, None)
        self._unshard_logits = not prediction_loss_only
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self._unshard_logits = False

    # --- training, logging ---------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, with checkpoints that a kill cannot break (docs/trainer.md, "Checkpoints").

        ``resume_from_checkpoint``: a path (checked first: a missing or truncated file is an error
        naming it), ``True`` (the newest complete checkpoint in ``output_dir``; an error when there
        is none) or ``"last"`` (the same, or from scratch when there is none). Checkpoints that
        cannot be resumed from are skipped with a warning that says why. First checks, when
        checkpoints are written or read by several processes, that every rank sees the same
        ``output_dir`` (a filesystem shared by all nodes). A collective that times out
        (``ddp_timeout``: a rank stopped responding) raises ``CollectiveTimeout`` naming the call,
        its group and the timeout."""
        saves = self.args.save_strategy != "no" and not self.args.save_on_each_node
        if _launched() and dist.is_initialized() and (saves or resume_from_checkpoint):
            from .startup import check_shared_output_dir

            check_shared_output_dir(self.args.output_dir)
        resume_from_checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
        if dist.is_initialized() and dist.get_world_size() > 1:
            exit_after_timeout()
        self._window = Throughput()
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except Exception as e:
            if not is_timeout(e):
                raise
            raise explain(e, self._cp, self.args.ddp_timeout_delta) from e
