"""Gradient errors under bf16 autocast: the chunked loss and the tiled MLP against the plain path.

    python -m benchmarks.bench_autocast --out benchmarks/results/autocast_errors.jsonl    # ~20 s on 1 core

A tiny float32 Llama trained on one batch until it predicts its next tokens with median probability
above ``--confidence`` (0.95: late in fine-tuning, where a loss whose backward disagrees with its
forward shows; with random targets it does not); then one step of that batch under CPU bf16 autocast,
every parameter gradient against the same step in float64 without autocast (``testkit.mixed_precision``).

Providers: ``plain`` (transformers' loss on the full logits, no tiling: the baseline); ``chunked``
(``enable_chunked_loss``) and ``tiled`` (``enable_tiled_mlp``) as they are in this checkout; with
``--before REV`` (default: the last commit before they kept the forward's autocast state),
``chunked@REV`` and ``tiled@REV``: the same with ``hf_ring/ops/cross_entropy.py`` and ``tiled_mlp.py``
read from git at ``REV`` (they import only torch). Two alternatives for the chunked loss's logits,
measured for the choice of design: ``chunked_fp32_logits`` (head in float32 in both passes, backward
GEMMs too) and ``chunked_fp32_out`` (bf16 GEMM inputs with float32 accumulation and output for the
logits, as ``torch.mm(..., out_dtype=torch.float32)`` gives on CUDA; the backward's dH and dW GEMMs in
bf16).

Rows (``benchmarks.harness.FIELDS``; name ``autocast_grad_error``, N = tokens, x = vocabulary):
metric ``worst_param`` (largest relative error over the parameters), ``lm_head``, ``loss``,
``max_ratio_to_plain`` (largest per-parameter ratio of the error to plain's). ``--quick``: a smaller
vocabulary, for the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

import hf_ring
import hf_ring.ops.cross_entropy as ce
import hf_ring.ops.tiled_mlp as tm
from benchmarks import harness as H
from testkit.mixed_precision import confident_model, grad_errors

BEFORE = "8fec04b"  # the chunked loss and tiled MLP recomputed outside the forward's autocast state


def _chunked(m: torch.nn.Module) -> None:
    hf_ring.enable_chunked_loss(m, chunk_size=32)


def _tiled(m: torch.nn.Module) -> None:
    hf_ring.enable_tiled_mlp(m, tile_tokens=16)


@contextlib.contextmanager
def ops_at(rev: str) -> Iterator[None]:
    """The chunked loss and tiled MLP Functions of ``hf_ring/ops`` at git revision ``rev``."""
    old = {}
    for name in ("cross_entropy", "tiled_mlp"):
        src = subprocess.run(["git", "show", f"{rev}:hf_ring/ops/{name}.py"], cwd=H.ROOT, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        old[name] = types.ModuleType(f"{name}_at_{rev}")
        exec(compile(src, f"{rev}:hf_ring/ops/{name}.py", "exec"), old[name].__dict__)
    with (
        mock.patch.object(ce, "_ChunkedLinearCE", old["cross_entropy"]._ChunkedLinearCE),
        mock.patch.object(tm, "_TiledMLP", old["tiled_mlp"]._TiledMLP),
    ):
        yield


def _fp32_out_linear(x, weight, bias=None):
    """``F.linear`` on bf16 operands as a GEMM with float32 accumulation and output (products of bf16
    numbers are exact in float32), as ``torch.mm(..., out_dtype=torch.float32)`` on CUDA."""
    if x.dtype == weight.dtype == torch.bfloat16:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return F.linear(x, weight, bias)


@contextlib.contextmanager
def fp32_logits() -> Iterator[None]:
    """The chunked loss's head in float32 under autocast, in both passes (all its GEMMs)."""

    def dtype(x: torch.Tensor) -> torch.dtype | None:
        return torch.float32 if torch.is_autocast_enabled(x.device.type) else None

    with mock.patch.object(ce, "_autocast_dtype", dtype):
        yield


@contextlib.contextmanager
def fp32_out() -> Iterator[None]:
    """The chunked loss's logits GEMM (forward and recompute) with float32 output."""
    functional = types.SimpleNamespace(**{**vars(F), "linear": _fp32_out_linear})
    with mock.patch.object(ce, "F", functional):
        yield


def measure(model, batch, providers: dict[str, tuple[Callable | None, Callable]]) -> dict[str, dict[str, float]]:
    """Per provider ``(setup, context)``: the relative errors of ``grad_errors``."""
    out = {}
    for name, (setup, context) in providers.items():
        with context():
            out[name] = grad_errors(model, batch, setup)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/autocast_errors.jsonl")
    ap.add_argument("--quick", action="store_true", help="vocabulary 256 (test suite)")
    ap.add_argument("--vocab", type=int, default=None, help="default 2048 (256 with --quick)")
    ap.add_argument("--confidence", type=float, default=0.95, help="median target probability to train to")
    ap.add_argument("--before", default=BEFORE, help="git revision for the @REV rows ('' for none)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    vocab = args.vocab or (256 if args.quick else 2048)
    torch.manual_seed(0)
    model, batch, median = confident_model(vocab=vocab, confidence=args.confidence)
    nullctx = contextlib.nullcontext
    providers = {"plain": (None, nullctx), "chunked": (_chunked, nullctx), "tiled": (_tiled, nullctx)}
    if args.before:
        try:
            with ops_at(args.before):
                pass
        except (OSError, subprocess.CalledProcessError) as e:  # no git, or a clone without that commit
            print(f"[bench_autocast] no @{args.before} rows: {e}")
        else:
            providers[f"chunked@{args.before}"] = (_chunked, lambda: ops_at(args.before))
            providers[f"tiled@{args.before}"] = (_tiled, lambda: ops_at(args.before))
    providers["chunked_fp32_logits"] = (_chunked, fp32_logits)
    providers["chunked_fp32_out"] = (_chunked, fp32_out)
    errs = measure(model, batch, providers)

    meta = {"machine": H.machine_info(), "versions": H.versions(transformers=True)}
    table = H.Table(meta, lambda p: torch.get_num_threads())
    n = int(batch["input_ids"].numel())
    note = f"tiny Llama fp32, CPU bf16 autocast, median target probability {median:.3f}; vs float64"
    print(f"[bench_autocast] vocab {vocab}, {n} tokens, median target probability {median:.3f}")
    print(f"{'provider':24s} {'worst param':>12s} {'lm_head':>9s} {'loss':>9s} {'max ratio to plain':>19s}")
    plain = errs["plain"]
    for name, e in errs.items():
        params = {k: v for k, v in e.items() if k != "loss"}
        worst = max(params, key=params.get)
        ratio = max(v / plain[k] for k, v in params.items())
        vals = {"worst_param": params[worst], "lm_head": e["lm_head.weight"], "loss": e["loss"],
                "max_ratio_to_plain": ratio}  # fmt: skip
        for metric, v in vals.items():
            table.add("autocast_grad_error", name, metric, 1, n, (v, v, v),
                      "ratio" if metric.startswith("max_ratio") else "rel_err", x=vocab,
                      note=note + (f"; worst: {worst}" if metric == "worst_param" else ""))  # fmt: skip
        print(f"{name:24s} {params[worst]:12.4f} {e['lm_head.weight']:9.4f} {e['loss']:9.1e} {ratio:19.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    H.write_rows(out, table.rows)
    print(f"[bench_autocast] {len(table.rows)} rows -> {out}; {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
