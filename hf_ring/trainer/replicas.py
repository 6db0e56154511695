"""What changes in ``Trainer`` when only ``world_size / cp_size`` processes are data-parallel replicas.

``Trainer`` takes every process for a replica. Under context parallelism the ``cp_size`` ranks of a
CP group share one batch, so ``RingTrainer`` (through this mixin) splits data loaders over the DP
replicas only, gathers evaluation outputs over them, and counts tokens, FLOPs and throughput once
per replica. The trainer sets ``self._cp`` (``ContextParallel`` or ``None``) and ``self._window``
(a ``Throughput``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..data.loader import prepare_dataloader
from ..ledger import LEDGER
from ..parallel import ContextParallel

__all__ = ["ReplicaMixin", "Throughput"]


class ReplicaMixin:
    """Data loaders, evaluation gathering and counts of ``RingTrainer`` over the DP replicas."""

    _cp: ContextParallel | None
    _window: Throughput
    accelerator: Any
    args: Any
    state: Any

    # --- the DP x CP grid ---------------------------------------------------------------------
    @property
    def cp_size(self) -> int:
        """Processes per sequence (1 when not launched)."""
        return self._cp.cp_size if self._cp is not None else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: world size / cp_size."""
        return self._cp.dp_size if self._cp is not None else 1

    @property
    def _cp_group(self) -> dist.ProcessGroup | None:
        return self._cp.cp_group if self._cp is not None else None

    @property
    def _dp_group(self) -> dist.ProcessGroup | None:
        return self._cp.dp_group if self._cp is not None and self._cp.dp_size > 1 else None

    # --- data: split over the DP replicas only --------------------------------------------------
    @contextmanager
    def _split_over_dp_replicas(self) -> Iterator[None]:
        """While active, ``self.accelerator`` prepares data loaders for ``dp_size`` replicas
        (rank ``dp_rank``) instead of all processes: the ranks of a CP group get the same batches."""
        cp = self._cp
        if cp is None or cp.cp_size == 1:
            yield
            return
        acc = self.accelerator
        if acc.dispatch_batches:
            raise ValueError(
                "RingTrainer: accelerator_config.dispatch_batches=True is not supported with cp_size > 1 "
                "(process 0 would deal batches to all processes); leave it unset."
            )
        if acc._prepare_device_mesh() is not None:
            raise ValueError("RingTrainer: an accelerate device mesh is not supported with cp_size > 1.")

        def prepare(data_loader: Any, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None) -> Any:
            if getattr(data_loader, "_is_accelerate_prepared", False):
                return data_loader
            prepared = prepare_dataloader(
                data_loader,
                cp,
                device=acc.device,
                split_batches=acc.split_batches,
                put_on_device=acc.device_placement if device_placement is None else device_placement,
                rng_types=acc.rng_types.copy(),
                # every rank reads the data itself (an iterable dataset must yield the same order on every rank)
                dispatch_batches=False,
                even_batches=acc.even_batches,
                use_seedable_sampler=acc.use_seedable_sampler,
                data_seed=acc.dataloader_config.data_seed,
                non_blocking=acc.non_blocking,
                use_stateful_dataloader=acc.use_stateful_dataloader,
            )
            acc._dataloaders.append(prepared)
            return prepared

        with LEDGER.scoped() as scope:  # accelerate's own method again when the block ends
            why = "RingTrainer: data loaders split over the DP replicas only"
            scope.set_attr(acc, "prepare_data_loader", prepare, why=why)
            yield

    def get_train_dataloader(self) -> Any:
        with self._split_over_dp_replicas():
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        with self._split_over_dp_replicas():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        with self._split_over_dp_replicas():
            return super().get_test_dataloader(test_dataset)

    # --- evaluation outputs: gathered over the DP replicas ----------------------------------------
    def _gather_over_dp(self, data: Any, **_: Any) -> Any:
        """``gather_for_metrics`` over the DP replicas: the ranks of a CP group hold the same values."""
        from accelerate.utils import recursively_apply

        group, size = self._cp.dp_group, self._cp.dp_size

        def gather(t: torch.Tensor) -> torch.Tensor:
            t = t.contiguous()
            if size == 1:
                return t
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t, group=group)
            return torch.cat(parts, dim=0)

        data = recursively_apply(gather, data, error_on_other_type=True)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda t: t[: state.remainder], data)
        return data

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        if self._cp is not None and self._cp.cp_size > 1:
            self.gather_function = self._gather_over_dp  # Trainer resets it after the loop
        return super().evaluation_loop(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log``, with ``seq_len`` (of the last training batch) and ``tokens_per_second``
        (all DP replicas, each CP group's tokens once, since the previous log) added to training logs."""
        if "loss" in logs and self._window.tokens:
            tokens, seconds, seq_len = self._window.take()
            if self.dp_size > 1:
                t = torch.tensor([tokens], dtype=torch.float64, device=self.args.device)
                dist.all_reduce(t, group=self._dp_group)
                tokens = int(t.item())
            logs["seq_len"] = seq_len
            logs["tokens_per_second"] = round(tokens / max(seconds, 1e-9), 1)
        super().log(logs, start_time)

    # --- counts over replicas, not processes ------------------------------------------------------
    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """This rank's share: Trainer sums the estimate over all processes."""
        return super().floating_point_ops(inputs) // self.cp_size

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # gathered over all processes: cp_size copies of each batch
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.cp_size


class Throughput:
    """Tokens of this replica's training batches since the last log, and the last sequence length."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.tokens = 0
        self.seq_len = 0

    def add(self, inputs: dict[str, Any]) -> None:
        x = inputs.get("input_ids", inputs.get("inputs_embeds"))
        if x is not None:
            self.tokens += int(x.shape[0] * x.shape[1])
            self.seq_len = int(x.shape[1])

    def take(self) -> tuple[int, float, int]:
        now = time.perf_counter()
        out = (self.tokens, now - self.start, self.seq_len)
        self.start, self.tokens = now, 0
        return out
