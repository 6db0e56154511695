"""Token mixers of hybrid models under context parallelism: per-rank time and bytes sent, against N.

    python -m benchmarks.bench_mixers --out benchmarks/results/mixers.jsonl --max-foreign 1   # ~2 min idle
    python -m benchmarks.bench_mixers --quick --out /tmp/mixers.jsonl           # smoke test, < 20 s
    python -m benchmarks.bench_mixers --plot-only                               # redraw mixers.png
    python -m benchmarks.bench_mixers --mixers rg_lru --keep                    # rerun one family, keep the rest

Each mixer family that hf_ring runs under CP (``MIXERS``: one entry per family, one line each) runs
forward + backward, fp32, B = 1, one thread per rank, on one sequence of N tokens:

* ``one_process``: the local kernel on the whole sequence in one process (what transformers runs),
  timed on rank 0 of each group in every iteration while the other ranks wait;
* ``hf_ring``: its context-parallel form (``hf_ring.ops.mixers``) on the zigzag shard of each of P
  gloo ranks (``--Ps 1 2``: also at P = 1, the form's own overhead).

Rows: ``fwd_bwd`` wall seconds (the slowest rank per iteration; median / p20 / p80 over iterations)
and ``fwd_bwd_cpu`` (main-thread CPU seconds, robust to other processes on a shared machine);
``efficiency`` = t_one_process / (P x t_hf_ring), paired per iteration, wall and CPU (1: P ranks
split the work perfectly);
``comm_bytes``: bytes a rank sends per layer, forward and backward, counted from the collectives it
actually calls (``harness.CommBytes`` wraps ``torch.distributed``'s collectives in the worker
process; hf_ring is not patched), the most of any rank, by direction; ``all_to_all`` rows give, for
reading them against, what a head-parallel all-to-all form (Megatron-Core's) would send: the
mixer's inputs and output, forward and backward, ``(P - 1) / P`` of each rank's rows.

An iteration during which other processes used more than ``--max-foreign`` of the machine (default
25%) is run again (at most once per kept iteration); on a machine that is never quiet, ``--max-foreign
1`` keeps every iteration and the CPU-time rows are the ones to read. The figure (``plot``) goes
next to the table, same name with ``.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness as H

FULL = {"Ns": [2048, 8192, 16384], "Ps": [2], "iters": {2048: 3, 8192: 3, 16384: 3}, "warmup": 1}
QUICK = {"Ns": [512], "Ps": [2], "iters": {512: 1}, "warmup": 0}


# ============================================================================ the mixers
@dataclass(frozen=True)
class Mixer:
    """One token-mixer family: ``shape`` (printed in the rows' notes); ``seq_dims`` the sequence
    dimension of each input and of the output's gradient (``None``: a weight); ``inputs(n, gen)`` the full
    inputs ``[1, n, ...]`` (float32 leaves) and the gradient of the output; ``full(xs)`` the local
    kernel on the whole sequence; ``plan(layout, rank)`` what the CP form needs once per batch;
    ``cp(xs, plan, group)`` the CP form on this rank's rows; ``sent(n, P)`` the elements per rank
    a head-parallel all-to-all form would send (forward and backward); ``max_n``: the longest N it runs
    at (transformers' token-by-token torch scans take O(N^2) in backward: each step's gradient is a
    full-length tensor)."""

    shape: dict
    seq_dims: tuple[int | None, ...]
    inputs: Callable[..., list]
    full: Callable[..., Any]
    plan: Callable[..., Any]
    cp: Callable[..., Any]
    sent: Callable[[int, int], float]
    max_n: int | None = None


def _delta_rule():
    """transformers' torch chunked gated delta rule, as transformers has it (``hf_ring.transformers``
    routes the module-level name; the original is what the CP form calls for local compute)."""
    return _original("qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule")


# Gated DeltaNet (Qwen3.5's linear attention, head sizes scaled down): the short convolution over
# q, k, v (kernel 4, SiLU) then the gated delta rule (chunks of 64, L2-normalised q and k).
GDN = dict(Hk=2, Hv=4, Dk=64, Dv=64, K=4, chunk=64)
# LFM2's ShortConv: a depthwise causal convolution of kernel 3 on the hidden size, no bias.
CONV = dict(C=1024, K=3)


def _gdn_inputs(n: int, g) -> list:
    import torch

    s = GDN
    c = 2 * s["Hk"] * s["Dk"] + s["Hv"] * s["Dv"]
    x = torch.randn(1, c, n, generator=g)  # [B, C, N]: the projected q, k, v before the convolution
    w = torch.randn(c, s["K"], generator=g) / s["K"]
    decay = -torch.rand(1, n, s["Hv"], generator=g)  # log decay
    beta = torch.rand(1, n, s["Hv"], generator=g)
    dout = torch.randn(1, n, s["Hv"], s["Dv"], generator=g)
    return [x, w, decay, beta, dout]


def _gdn_split(y):
    s = GDN
    b, _, n = y.shape
    q, k, v = y.transpose(1, 2).split([s["Hk"] * s["Dk"], s["Hk"] * s["Dk"], s["Hv"] * s["Dv"]], dim=-1)
    return q.reshape(b, n, s["Hk"], s["Dk"]), k.reshape(b, n, s["Hk"], s["Dk"]), v.reshape(b, n, s["Hv"], s["Dv"])


def _gdn_full(xs):
    from hf_ring.ops.mixers.conv import torch_causal_conv1d

    x, w, decay, beta = xs
    q, k, v = _gdn_split(torch_causal_conv1d(x, w, None, "silu"))
    out, _ = _delta_rule()(q, k, v, decay, beta, chunk_size=GDN["chunk"], use_qk_l2norm_in_kernel=True)
    return out


def _gdn_plan(layout, rank: int):
    from hf_ring.ops.mixers.conv import conv_plan
    from hf_ring.ops.mixers.delta import delta_plan

    return conv_plan(layout, 1, rank, GDN["K"] - 1), delta_plan(layout, 1, rank)


def _gdn_cp(xs, plan, group):
    from hf_ring.ops.mixers.conv import causal_conv1d
    from hf_ring.ops.mixers.delta import delta_rule

    x, w, decay, beta = xs
    conv, delta = plan
    q, k, v = _gdn_split(causal_conv1d(x, w, None, "silu", conv, group))
    return delta_rule(_delta_rule(), q, k, v, decay, beta, delta, group, chunk_size=GDN["chunk"],
                      use_qk_l2norm_in_kernel=True)  # fmt: skip


def _gdn_a2a(n: int, p: int) -> float:
    s = GDN
    per_token = 2 * s["Hk"] * s["Dk"] + s["Hv"] * s["Dv"] + 2 * s["Hv"] + s["Hv"] * s["Dv"]  # q k v g beta, out
    return 2 * per_token * n / p * (p - 1) / p  # forward, and the gradients back


def _conv_inputs(n: int, g) -> list:
    import torch

    x = torch.randn(1, CONV["C"], n, generator=g)
    return [x, torch.randn(CONV["C"], CONV["K"], generator=g) / CONV["K"], torch.randn(1, CONV["C"], n, generator=g)]


def _conv_full(xs):
    from hf_ring.ops.mixers.conv import torch_causal_conv1d

    return torch_causal_conv1d(xs[0], xs[1], None, None)


def _conv_plan(layout, rank: int):
    from hf_ring.ops.mixers.conv import conv_plan

    return conv_plan(layout, 1, rank, CONV["K"] - 1)


def _conv_cp(xs, plan, group):
    from hf_ring.ops.mixers.conv import causal_conv1d

    return causal_conv1d(xs[0], xs[1], None, None, plan, group)


def _conv_a2a(n: int, p: int) -> float:
    return 2 * 2 * CONV["C"] * n / p * (p - 1) / p  # the input and the output, forward and backward


def _original(module: str, name: str):
    """transformers' local kernel ``module.name`` (``Class.method`` too) as transformers has it (what
    the CP form calls)."""
    import importlib

    from hf_ring.transformers.install import original

    owner: object = importlib.import_module(f"transformers.models.{module}")
    *path, name = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    return original(owner, name)


# Mamba2's SSD scan (Nemotron-H, Granite 4, Bamba, ...; heads scaled down) through transformers' torch
# chunk scan: step sizes with bias, softplus and limit, D skip; the convolution before it is ``short_conv``'s.
SSD = dict(H=8, P=64, G=1, Nst=32, chunk=128)


def _ssd_inputs(n: int, g) -> list:
    import torch

    s = SSD
    x = torch.randn(1, n, s["H"], s["P"], generator=g)
    dt = torch.randn(1, n, s["H"], generator=g) - 2
    b, c = (torch.randn(1, n, s["G"], s["Nst"], generator=g) for _ in range(2))
    a = -0.5 - torch.rand(s["H"], generator=g)
    d, bias = torch.randn(s["H"], generator=g), torch.randn(s["H"], generator=g) / 4
    return [x, dt, b, c, a, d, bias, torch.randn(1, n, s["H"], s["P"], generator=g)]


def _ssd_full(xs):
    x, dt, b, c, a, d, bias = xs
    scan = _original("nemotron_h.modeling_nemotron_h", "mamba2_chunk_scan")
    return scan(x, dt, a, b, c, chunk_size=SSD["chunk"], D=d, dt_bias=bias, dt_softplus=True)


def _ssd_plan(layout, rank: int):
    from hf_ring.ops.mixers.ssd import ssd_plan

    return ssd_plan(layout, 1, rank)


def _ssd_cp(xs, plan, group):
    from hf_ring.ops.mixers.ssd import ssd_scan

    x, dt, b, c, a, d, bias = xs
    scan = _original("nemotron_h.modeling_nemotron_h", "mamba2_chunk_scan")

    def local(x, dt, a, b, c, chunk, **kw):
        return scan(x, dt, a, b, c, chunk_size=chunk, **kw)

    return ssd_scan(local, x, dt, a, b, c, plan, group, chunk_size=SSD["chunk"], D=d, dt_bias=bias, dt_softplus=True)


def _ssd_a2a(n: int, p: int) -> float:
    s = SSD
    per_token = 2 * s["H"] * s["P"] + s["H"] + 2 * s["G"] * s["Nst"]  # x dt B C, out
    return 2 * per_token * n / p * (p - 1) / p


# Mamba's selective scan (Jamba, Zamba, Falcon-Mamba; channels scaled down) through transformers' torch
# scan (token by token): delta bias and softplus, D skip and the gate z.
SEL = dict(D=16, Nst=16)


def _sel_inputs(n: int, g) -> list:
    import torch

    s = SEL
    u, dt, z = (torch.randn(1, s["D"], n, generator=g) for _ in range(3))
    b, c = (torch.randn(1, s["Nst"], n, generator=g) for _ in range(2))
    a = -torch.arange(1, s["Nst"] + 1, dtype=torch.float32).repeat(s["D"], 1)  # Mamba's A init
    d, bias = torch.randn(s["D"], generator=g), torch.randn(s["D"], generator=g) / 4 - 2
    return [u, dt, b, c, z, a, d, bias, torch.randn(1, s["D"], n, generator=g)]


def _sel_full(xs):
    u, dt, b, c, z, a, d, bias = xs
    scan = _original("jamba.modeling_jamba", "mamba_selective_scan")
    return scan(u, dt, a, b, c, D=d, z=z, delta_bias=bias, delta_softplus=True)


def _sel_plan(layout, rank: int):
    from hf_ring.ops.mixers.selective import selective_plan

    return selective_plan(layout, 1, rank)


def _sel_cp(xs, plan, group):
    from hf_ring.ops.mixers.selective import selective_scan

    u, dt, b, c, z, a, d, bias = xs
    scan = _original("jamba.modeling_jamba", "mamba_selective_scan")
    return selective_scan(scan, u, dt, a, b, c, plan, group, D=d, z=z, delta_bias=bias, delta_softplus=True)


def _sel_a2a(n: int, p: int) -> float:
    s = SEL
    return 2 * (4 * s["D"] + 2 * s["Nst"]) * n / p * (p - 1) / p  # u dt z B C, out


# MiniMax's lightning attention (heads scaled down): S = exp(-slope) S + k^T v, o = q S, in blocks.
LIGHT = dict(H=4, Dh=64, block=64)


def _light_inputs(n: int, g) -> list:
    import torch

    s = LIGHT
    q, k, v = (torch.randn(1, n, s["H"], s["Dh"], generator=g) / 4 for _ in range(3))
    slope = 2.0 ** -(8 * torch.arange(1, s["H"] + 1) / s["H"])  # ALiBi-like slopes, as MiniMax builds them
    return [q, k, v, slope, torch.randn(1, n, s["H"], s["Dh"], generator=g)]


def _light_full(xs):
    from hf_ring.ops.mixers.ssd import torch_ssd_scan

    q, k, v, slope = xs
    return torch_ssd_scan(v, v.new_ones(v.shape[:3]), -slope, k, q, LIGHT["block"])


def _light_plan(layout, rank: int):
    from hf_ring.ops.mixers.ssd import ssd_plan

    return ssd_plan(layout, 1, rank)


def _light_cp(xs, plan, group):
    from hf_ring.ops.mixers.lightning import lightning_attention

    return lightning_attention(*xs, plan, group, block_size=LIGHT["block"])


def _light_a2a(n: int, p: int) -> float:
    return 2 * 4 * LIGHT["H"] * LIGHT["Dh"] * n / p * (p - 1) / p  # q k v, out


# RecurrentGemma's RG-LRU (width scaled down): h = a * h + x through transformers' token-by-token scan.
LRU = dict(D=64)


def _lru_inputs(n: int, g) -> list:
    import torch

    a = torch.rand(1, n, LRU["D"], generator=g) * 0.3 + 0.7
    return [a, torch.randn(1, n, LRU["D"], generator=g), torch.randn(1, n, LRU["D"], generator=g)]


def _lru_full(xs):
    import torch

    scan = _original("recurrent_gemma.modeling_recurrent_gemma", "RecurrentGemmaRglru._rnn_scan")
    a, x = xs
    return scan(None, x, a, torch.zeros(a.shape[:2] + (1,), dtype=torch.bool), None)[0]


def _lru_plan(layout, rank: int):
    from hf_ring.ops.mixers.diagonal import diagonal_plan

    return diagonal_plan(layout, 1, rank)


def _lru_cp(xs, plan, group):
    from hf_ring.ops.mixers.diagonal import diagonal_recurrence

    return diagonal_recurrence(xs[0], xs[1], plan, group)


def _lru_a2a(n: int, p: int) -> float:
    return 2 * 3 * LRU["D"] * n / p * (p - 1) / p  # a x, out


# One line per family; seq_dims: each input's (and the output gradient's) sequence dimension.
MIXERS: dict[str, Mixer] = {
    "gated_deltanet": Mixer(GDN, (2, None, 1, 1, 1), _gdn_inputs, _gdn_full, _gdn_plan, _gdn_cp, _gdn_a2a),
    "short_conv": Mixer(CONV, (2, None, 2), _conv_inputs, _conv_full, _conv_plan, _conv_cp, _conv_a2a),
    "mamba2_ssd": Mixer(SSD, (1, 1, 1, 1, None, None, None, 1), _ssd_inputs, _ssd_full, _ssd_plan, _ssd_cp, _ssd_a2a),
    "mamba_selective": Mixer(
        SEL, (2, 2, 2, 2, 2, None, None, None, 2), _sel_inputs, _sel_full, _sel_plan, _sel_cp, _sel_a2a, max_n=8192
    ),  # fmt: skip
    "lightning": Mixer(LIGHT, (1, 1, 1, None, 1), _light_inputs, _light_full, _light_plan, _light_cp, _light_a2a),
    "rg_lru": Mixer(LRU, (1, 1, 1), _lru_inputs, _lru_full, _lru_plan, _lru_cp, _lru_a2a, max_n=8192),
}


def _lengths(mixer: Mixer, ns: list[int]) -> list[int]:
    """The sequence lengths ``mixer`` runs at (up to its ``max_n``)."""
    return [n for n in ns if mixer.max_n is None or n <= mixer.max_n]


# ============================================================================ worker side
def worker(rank: int, size: int, cfg: dict) -> dict:
    """On every rank: per mixer and N, each kept iteration's wall and CPU seconds per provider, and
    the bytes sent by kind (forward, backward) of the last iteration."""
    import torch
    import torch.distributed as dist

    from hf_ring.ops.layout import sequence_layout

    counter = H.CommBytes()
    meter = H.GroupLoad(None, rank, cfg["cores"])
    out: dict = {}
    for name in cfg["mixers"]:
        mixer = MIXERS[name]
        for n in _lengths(mixer, cfg["Ns"]):
            g = torch.Generator().manual_seed(n)
            *full, dout = mixer.inputs(n, g)
            layout = sequence_layout(n, size)
            index = layout.index(1)[rank][0]  # [S_local]: the global rows this rank holds
            local = [x if d is None else x.index_select(d, index) for x, d in zip([*full, dout], mixer.seq_dims)]
            *xs, dlocal = local
            plan = mixer.plan(layout, rank)
            sent: dict[str, int] = {}

            def fwd_bwd(xs: list, dy, run: Callable, sync: bool, sent: dict = sent) -> tuple[float, float]:
                leaves = [x.detach().requires_grad_() for x in xs]
                if sync:
                    dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                with counter.counting("forward"):
                    y = run(leaves)
                with counter.counting("backward"):
                    torch.autograd.grad(y, leaves, dy)
                t, c = time.perf_counter() - t0, time.thread_time() - c0
                if sync:
                    sent.update(counter.take())
                return t, c

            def one_iteration(xs=xs, full=full, dlocal=dlocal, dout=dout, plan=plan, mixer=mixer) -> dict:
                rec = {}
                rec["hf_ring"] = fwd_bwd(xs, dlocal, lambda ls: mixer.cp(ls, plan, None), True)
                if rank == 0:  # the others wait in measure's barrier
                    rec["one_process"] = fwd_bwd(full, dout, mixer.full, False)
                return rec

            kept, loads, redone = H.measure(one_iteration, meter, warmup=cfg["warmup"], iters=cfg["iters"][str(n)],
                                            max_foreign=cfg["max_foreign"], max_redo=1)  # fmt: skip
            out[f"{name}/{n}"] = {"times": kept, "loads": loads, "redone": redone, "sent": dict(sent)}
    return out


# ============================================================================ table
def build_rows(results: dict[int, list[dict]], cfg: dict, meta: dict) -> list[dict]:
    """The long table from ``{P: per-rank results}``."""
    table = H.Table(meta, lambda _: 1)
    for name in cfg["mixers"]:
        shape = ", ".join(f"{k} {v}" for k, v in MIXERS[name].shape.items())
        for n in _lengths(MIXERS[name], cfg["Ns"]):
            key = f"{name}/{n}"
            for p, per_rank in sorted(results.items()):
                redone = max(r[key]["redone"] for r in per_rank)
                note = f"{name}: {shape}" + (f"; {redone} iteration(s) redone under load" if redone else "")
                its = len(per_rank[0][key]["times"])
                for m, i in (("time", 0), ("cpu_time", 1)):
                    one = [it["one_process"][i] for it in per_rank[0][key]["times"]]
                    table.add("fwd_bwd", "one_process", m, p, n, H.stats(one), "s", x=name,
                              note=f"{note}; on rank 0 of the P-rank group, the others waiting")  # fmt: skip
                    worst = [max(r[key]["times"][j]["hf_ring"][i] for r in per_rank) for j in range(its)]
                    table.add("fwd_bwd", "hf_ring", m, p, n, H.stats(worst), "s", note=note, x=name)
                    eff = [t1 / (p * t) for t1, t in zip(one, worst)]
                    table.add("efficiency", "hf_ring", "t_one/(P*t_rank)" + ("" if i == 0 else "(cpu)"), p, n,
                              H.stats(eff), "fraction", note=note, x=name)  # fmt: skip
                for kind in ("forward", "backward", "total"):
                    b = max(r[key]["sent"].get(kind, 0) for r in per_rank)
                    table.add("comm_bytes", "hf_ring", f"bytes_sent_per_rank.{kind}", p, n, (b, b, b), "B",
                              note=f"{name}: counted from the collectives", x=name)  # fmt: skip
                a2a = 4 * MIXERS[name].sent(n, p)
                table.add("comm_bytes", "all_to_all", "bytes_sent_per_rank.total", p, n, (a2a, a2a, a2a), "B",
                          note=f"{name}: a head-parallel all-to-all form, computed (fp32)", x=name)  # fmt: skip
    return table.rows


# ============================================================================ plot
def plot(rows: list[dict], path: Path) -> Path:
    """``path``: per mixer, the efficiency against N (wall and CPU) and the bytes a rank sends per
    layer against N (hf_ring counted, all-to-all computed), P = max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["x"] for r in rows))
    p = max(r["P"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 6))
    for j, name in enumerate(names):
        color = f"C{j}"
        for metric, style in (("t_one/(P*t_rank)", "-o"), ("t_one/(P*t_rank)(cpu)", "--s")):
            sel = sorted((r for r in rows if r["name"] == "efficiency" and r["x"] == name and r["P"] == p
                          and r["metric"] == metric), key=lambda r: r["N"])  # fmt: skip
            if sel:
                axes[0].errorbar([r["N"] for r in sel], [r["median"] for r in sel], fmt=style, color=color,
                                 yerr=[[r["median"] - r["p20"] for r in sel], [r["p80"] - r["median"] for r in sel]],
                                 label=f"{name} ({'CPU' if 'cpu' in metric else 'wall'})", capsize=3)  # fmt: skip
        for prov, style in (("hf_ring", "-o"), ("all_to_all", ":x")):
            sel = sorted((r for r in rows if r["name"] == "comm_bytes" and r["x"] == name and r["P"] == p
                          and r["provider"] == prov and r["metric"].endswith("total")),
                         key=lambda r: r["N"])  # fmt: skip
            if sel:
                label = f"{name}: {'state passing + halo (counted)' if prov == 'hf_ring' else 'all-to-all (computed)'}"
                axes[1].plot([r["N"] for r in sel], [r["median"] / 2**20 for r in sel], style, color=color, label=label)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_title(f"efficiency t_one / (P x t_rank), P = {p}", fontsize=10)
    axes[1].set_title("bytes sent per rank per layer, fwd + bwd (MiB)", fontsize=10)
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    m, v = rows[0]["machine"], rows[0]["versions"]
    commits = ", ".join(dict.fromkeys(str(r["versions"].get("hf_ring_commit", "?")) for r in rows))
    fig.suptitle(f"fp32, gloo, 1 thread per rank; {m['cpu']}, {m['cores']} cores; torch {v['torch']}, hf_ring "
                 f"{commits}", fontsize=7, color="dimgray")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/mixers.jsonl")
    ap.add_argument("--quick", action="store_true", help="N=512, P = 2, 1 iteration (smoke test)")
    ap.add_argument("--mixers", nargs="*", default=list(MIXERS), choices=list(MIXERS))
    ap.add_argument("--Ns", type=int, nargs="*", default=None)
    ap.add_argument("--Ps", type=int, nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per spawned group")
    ap.add_argument("--max-foreign", type=float, default=0.25, help="redo an iteration above this foreign load")
    ap.add_argument("--plot-only", action="store_true", help="only redraw the figure from --out")
    ap.add_argument("--keep", action="store_true", help="keep the rows of the other mixers already in --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.plot_only:
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        print(f"wrote {plot(rows, out.with_suffix('.png'))}")
        return 0
    meta = {"machine": H.machine_info(), "versions": H.versions(transformers=True), "load": {}}
    cfg = dict(QUICK if args.quick else FULL)
    cfg["Ns"] = args.Ns or cfg["Ns"]
    cfg["Ps"] = sorted(set(args.Ps or cfg["Ps"]))
    its = cfg["iters"]
    cfg["iters"] = {str(n): args.iters or its.get(n, min(its.values())) for n in cfg["Ns"]}
    cfg.update(mixers=args.mixers, cores=meta["machine"]["cores"], max_foreign=1.0 if args.quick else args.max_foreign)
    results = {}
    for p in cfg["Ps"]:
        t0 = time.monotonic()
        results[p], load = H.launch(worker, p, cfg, threads=1, timeout=args.timeout)
        print(f"[mixers] P={p} done in {time.monotonic() - t0:.1f} s (foreign CPU load {100 * load:.0f}%)", flush=True)
    rows = build_rows(results, cfg, meta)
    for r in rows:
        if r["P"] > 1 and (r["name"] == "efficiency" or r["metric"] == "bytes_sent_per_rank.total"):
            print(f"  {r['x']:15s} {r['provider']:10s} {r['metric']:28s} P={r['P']} N={r['N']:6d}: {r['median']:.4g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.keep and out.exists():  # each kept row carries its own run's machine, versions and load
        old = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        rows = [r for r in old if r["x"] not in cfg["mixers"]] + rows
    H.write_rows(out, rows)
    print(f"wrote {len(rows)} rows to {out}")
    try:
        print(f"wrote {plot(rows, out.with_suffix('.png'))}")
    except ImportError:
        print("matplotlib is not installed: no figure (pip install hf-ring[plots])")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
