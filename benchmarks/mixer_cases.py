"""The token-mixer families the mixer benchmark (``benchmarks.bench_mixers``) runs, one ``Mixer`` each
(``MIXERS``): its shapes, its inputs, the local kernel on the whole sequence (what transformers runs),
what its context-parallel form needs once per batch, that form on a rank's rows, and what a
head-parallel all-to-all form would send. Adding a family is a few functions and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CONV", "GDN", "LIGHT", "LRU", "MIXERS", "SEL", "SSD", "Mixer", "lengths"]


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


def lengths(mixer: Mixer, ns: list[int]) -> list[int]:
    """The sequence lengths ``mixer`` runs at (up to its ``max_n``)."""
    return [n for n in ns if mixer.max_n is None or n <= mixer.max_n]
