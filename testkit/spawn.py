"""Spawned gloo ranks on one machine: a pool reused across tests, and one-shot fresh processes.

``run_ranks(world, fn, *args)``: starting torch in a fresh process costs seconds, so each world size
gets one pool per test session; it calls the module-level function ``fn`` on every rank and returns
the per-rank results (plain Python values or numpy arrays).

``spawn_ranks(fn, world, *args)``: ``world`` fresh processes that run ``fn(rank, world, *args)`` once
and exit (benchmarks: each measurement starts from a clean process, whose resident set and
allocator hold nothing from earlier runs).

Both: a rank that raises fails the call with its traceback; a call that does not finish within
``timeout`` seconds kills the processes and raises ``TimeoutError``, so a deadlock fails instead of
hanging.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def init_gloo(rank: int, world: int, init_file: str, threads: int = 1) -> None:
    """Join a gloo group of ``world`` ranks through ``file://init_file``, with ``threads`` torch threads."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _worker(rank: int, world: int, init_file: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    init_gloo(rank, world, init_file)
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc()))
        finally:
            from hf_ring.parallel import reset_context_parallel

            reset_context_parallel()
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        fd, self._init_file = tempfile.mkstemp(prefix="hf_ring_rdzv_")
        os.close(fd)
        os.unlink(self._init_file)
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, self._init_file, self.tasks[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Any, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        out: dict[int, Any] = {}
        errors: list[str] = []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(
                    f"{fn.__name__} on {self.world} ranks did not finish in {timeout:.0f} s "
                    f"(finished: {sorted(out)}; errors: {errors}); the pool was killed"
                ) from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                out[rank] = None
        if errors:
            raise RuntimeError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [out[r] for r in range(self.world)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


def launcher_env() -> None:
    """In a pool worker (whose gloo group is up), set the variables a launcher would (``RANK``,
    ``WORLD_SIZE``, ...), so that accelerate and ``Trainer`` see the distributed run."""
    import torch.distributed as dist

    world, rank = str(dist.get_world_size()), str(dist.get_rank())
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1")


_POOLS: dict[int, Pool] = {}


def run_ranks(world: int, fn: Any, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world`` gloo ranks; returns each rank's result."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[world] = Pool(world)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    except TimeoutError:
        _POOLS.pop(world, None)
        raise


def close_all() -> None:
    for pool in _POOLS.values():
        for q in pool.tasks:
            q.put(None)
        pool.close()
    _POOLS.clear()


# ------------------------------------------------------------------------------------ one-shot ranks
def _once(fn: Callable, rank: int, world: int, init_file: str, threads: int, args: tuple, results: Any) -> None:
    import torch.distributed as dist

    try:
        init_gloo(rank, world, init_file, threads)
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _environ(env: dict[str, str] | None) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn_ranks(
    fn: Callable, world: int, *args: Any, threads: int = 1, env: dict[str, str] | None = None, timeout: float = 1800.0
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` once on ``world`` fresh gloo ranks; returns each rank's result.

    Each rank is a new spawned process with ``threads`` torch threads, in the default process group
    (``torch.distributed.group.WORLD``); ``env`` is set in this process while the ranks start, so
    they inherit it (``MALLOC_*`` variables, say). ``fn`` must be a module-level function.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hf_ring_spawn_") as tmp, _environ(env):
        init_file = os.path.join(tmp, "rdzv")
        procs = [ctx.Process(target=_once, args=(fn, r, world, init_file, threads, args, results), daemon=True)
                 for r in range(world)]  # fmt: skip
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            while len(out) + len(errors) < world:
                try:
                    rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(
                        f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s (finished: {sorted(out)})"
                    ) from None
                if ok:
                    out[rank] = value
                else:  # the other ranks may wait for it in a collective: give them 10 s
                    errors.append(f"rank {rank}:\n{value}")
                    deadline = min(deadline, time.monotonic() + 10.0)
        except TimeoutError:
            if not errors:
                raise
        finally:
            for p in procs:
                if errors or len(out) < world:
                    p.kill()
                p.join(timeout=60)
    if errors:
        raise RuntimeError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
    return [out[r] for r in range(world)]
