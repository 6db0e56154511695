"""What ``RingTrainer`` changes in ``Trainer``'s saving and loading (a mixin, first in its bases).

- Checkpoints (``hf_ring.trainer.checkpoints``): a save clears the directory, marks it in progress,
  lets ``Trainer`` write its usual files, then seals it with a manifest once every rank is done;
  ``save_total_limit`` rotates after the seal and only among complete checkpoints. Resuming
  (``True``, ``"last"`` or a path) checks the checkpoint on every rank first; a file that fails to
  load gives an error naming the checkpoint.
- ``save_model(path)`` called by the user writes the final model that loads without hf_ring
  (``hf_ring.trainer.export``); ``Trainer``'s own calls (checkpoints, hub pushes) keep its format.
"""

from __future__ import annotations

import os
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..ledger import LEDGER
from . import checkpoints
from .checkpoints import Scope

__all__ = ["CheckpointMixin"]


class CheckpointMixin:
    """Mixed into a ``transformers.Trainer`` subclass (before ``Trainer`` in its bases)."""

    _checkpoint_scope: Scope | None = None
    _checked_checkpoint: str | None = None

    def _scope(self) -> Scope:
        """Which ranks share this run's checkpoint directories (collective on first use: every rank
        reaches it together, at the first save or resume)."""
        if self._checkpoint_scope is None:
            self._checkpoint_scope = Scope.of(self.args)
        return self._checkpoint_scope

    # --- saving ---------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        scope = self._scope()
        checkpoints.begin(folder, scope)
        limit = self.args.save_total_limit
        with LEDGER.scoped() as changes:  # Trainer rotates by a module function it calls with this; rotated once sealed
            changes.set_attr(self.args, "save_total_limit", None, why="RingTrainer: checkpoints rotated once sealed")
            super()._save_checkpoint(model, trial)
        checkpoints.seal(
            folder,
            scope,
            optimizer=not self.args.save_only_model,
            checksums=bool(getattr(self.args, "checkpoint_checksums", False)),
        )
        if scope.writer:
            checkpoints.rotate(run_dir, limit, self.state.best_model_checkpoint)

    def save_model(
        self, output_dir: str | None = None, _internal_call: bool = False, *, merged: bool | None = None
    ) -> None:
        """Write the trained model to ``output_dir`` (default ``args.output_dir``) in the format that
        loads without hf_ring: a PEFT model's adapter (``PeftModel.from_pretrained(base, path)``),
        any other model with ``save_pretrained``, gathered from FSDP2 shards whatever the state-dict
        type; the tokenizer beside it. ``merged`` (default ``args.save_merged_model``): also the
        base model with the adapter merged in, under ``output_dir/merged``. Call it on every rank."""
        if _internal_call:  # Trainer's checkpoints and hub pushes: Trainer's own format
            return super().save_model(output_dir, _internal_call=True)
        from .export import save_model

        if merged is None:
            merged = bool(getattr(self.args, "save_merged_model", False))
        path = output_dir if output_dir is not None else self.args.output_dir
        if self.is_fsdp_enabled or merged:
            save_model(self, path, merged=merged)
        else:  # Trainer's save_pretrained is right without FSDP
            super().save_model(path, _internal_call=True)
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # --- resuming -------------------------------------------------------------------------------
    def _resolve_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """``resume_from_checkpoint`` as ``train`` takes it -> the checkpoint to load, checked on
        every rank (once: the recipe runner resolves it before ``train``)."""
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint == self._checked_checkpoint:
            return resume_from_checkpoint
        found = checkpoints.resolve_resume(
            resume_from_checkpoint, self.args.output_dir, self._scope(), optimizer=not self.args.save_only_model
        )
        self._checked_checkpoint = found
        return found

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        with checkpoints.load_errors(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with checkpoints.load_errors(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        with checkpoints.load_errors(checkpoint):
            super()._load_rng_state(checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        with checkpoints.load_errors(checkpoint):
            super()._load_scaler(checkpoint)
