"""Ring, Ulysses or both: the grids (``ulysses x ring``) of a CP group, their communication time per
layer, and the choice of ``ulysses_size``.

A CP group of ``P = U * R`` ranks runs Ulysses inside groups of ``U`` consecutive ranks (an
all-to-all that trades sequence for heads) and the zigzag ring over ``R`` ring positions
(``hf_ring.ops.ulysses``). Per decoder layer and rank, with ``N`` tokens, ``Hq``/``Hkv`` heads of
``d`` elements, ``b`` bytes per element, ``F`` FLOP/s, link bandwidth ``BW`` and ``g = gcd(Hkv, U)``
(K/V heads are repeated ``U / g`` times, ``Hkv -> Hkv U / g``, when ``U`` does not divide ``Hkv``):

- attention compute: forward ``2 N^2 Hq d / P`` FLOPs (causal), backward 2.5x that, the forward
  again in backward under activation checkpointing. The same for every grid.
- ring: ``R`` steps of equal work; each forward hop moves the K/V of ``N / R`` tokens on
  ``Hkv / g`` heads (this rank's ``1 / U`` of ``Hkv U / g``; ``2 Hkv/g d N/R b`` bytes) while the
  step computes ``2 (N/R)^2 Hq/U d`` FLOPs, so it is hidden when
  ``(N/R) (Hq/U) / F >= (Hkv/g) b / BW``. The
  backward hop also carries the float32 dK/dV accumulator (``b + 4`` bytes per element against
  2.5x the compute), and the last dK/dV hop comes after the last step: always exposed.
  Compute over transfer per hop is ``N Hq BW g / (P Hkv b F)``: raising ``U`` helps the ring hide
  only through ``g = gcd(Hkv, U)``.
- all-to-all: ``(U - 1) / U`` of the rank's q, k, v (``N / P`` tokens) before attention and of
  its output after, the gradients back in backward; nothing runs beside it, so all of it is exposed.

``compare_grids`` prices every ``U`` dividing ``P`` and ``Hq`` for a plan's settings and
``recommend`` picks the least exposed time; ``choose_ulysses_size`` is the rule for
``ulysses_size="auto"`` when the sequence length is not known (``RingTrainer``).

Imports neither torch nor transformers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .models import ModelShape
from .settings import PlanSettings
from .terms import DTYPE_BYTES, attention_comm_bytes

__all__ = ["GridCost", "choose_ulysses_size", "compare_grids", "grid_cost", "recommend", "ring_overlap"]


def choose_ulysses_size(num_heads: int, num_kv_heads: int, cp_size: int, gpus_per_node: int) -> int:
    """The ``ulysses_size`` that ``"auto"`` means, from the model and the launch alone (no length).

    - A CP group inside one node (``cp_size <= gpus_per_node``): ``1``, plain ring attention. On
      NVLink the ring's K/V hides behind compute from about ``F b Hkv / (BW Hq)`` tokens per rank
      (667 for Llama-3.1-8B at 400 TFLOP/s and 300 GB/s), far below any long-context shard, while an
      all-to-all cannot overlap: Ulysses would only add exposed time.
    - A CP group across nodes: ``gcd(Hkv, cp_size, gpus_per_node)``. The all-to-all stays inside a
      node (groups of ``U`` consecutive ranks; ``U`` divides the GPUs per node), and the ring, which
      crosses nodes at ~7x lower bandwidth, hides behind compute by a margin that grows with
      ``gcd(Hkv, U)`` only (module docstring): a larger ``U`` replicates K/V heads and sends more
      all-to-all bytes for no overlap gain. ``Hkv`` divides ``Hq``, so ``U`` divides ``Hq`` too.

    This is the grid with the widest overlap margin, so the ring hides at the shortest lengths.
    At a known length ``hf-ring plan`` prices every grid (``compare_grids``) and may recommend a
    smaller ``U`` that already hides the ring, or ``1`` (at 1M tokens even a cross-node ring hides);
    the difference is then the all-to-all, under 1% of attention compute for Llama-3.1-8B at 128K+.

    Llama-3.1-8B (32/8 heads), 8 GPUs per node: CP 8 -> 1; CP 16 -> 8 (Ulysses 8 x ring 2); Qwen2.5-7B
    (28/4): CP 16 -> 4; Qwen2.5-1.5B (12/2): CP 16 -> 2 (4 would replicate K/V for no gain).
    """
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("cp_size", cp_size),
                    ("gpus_per_node", gpus_per_node)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"choose_ulysses_size: {name} must be a positive int, got {v!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"choose_ulysses_size: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if cp_size <= gpus_per_node:
        return 1
    return math.gcd(math.gcd(num_kv_heads, cp_size), gpus_per_node)


@dataclass(frozen=True)
class GridCost:
    """One grid of a CP group (``ulysses x ring = cp``) priced per decoder layer and rank: bytes
    sent, seconds of transfer (``comm_s``), of transfer nothing hides (``exposed_s``), and of
    attention compute (``compute_s``), for forward + backward (+ the recomputed forward under
    checkpointing). ``kv_replication``: copies of each K/V head (``U / gcd(Hkv, U)``)."""

    ulysses: int
    ring: int
    ring_link: str
    a2a_link: str
    kv_replication: int
    bytes_sent: float
    ring_s: float
    all_to_all_s: float
    exposed_s: float
    compute_s: float

    @property
    def name(self) -> str:
        if self.ulysses == 1:
            return "ring"
        return "ulysses" if self.ring == 1 else f"U{self.ulysses} x R{self.ring}"

    @property
    def comm_s(self) -> float:
        return self.ring_s + self.all_to_all_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name, "comm_s": self.comm_s}


def _link(s: PlanSettings, inside_node: bool) -> tuple[str, float]:
    return ("NVLink", s.intra_GBps * 1e9) if inside_node else ("inter-node", s.inter_GBps * 1e9)


def grid_cost(m: ModelShape, s: PlanSettings, cp: int, ulysses: int) -> GridCost:
    """``GridCost`` of ``ulysses x (cp / ulysses)`` for ``m`` at ``s.seq_len`` tokens (padded to a
    multiple of ``2 cp``), ``s.micro_batch`` sequences, ``s.flops`` FLOP/s, the link bandwidths and
    ``s.gpus_per_node``. Ulysses groups are consecutive ranks, so they stay inside a node when
    ``U`` divides the GPUs per node; the ring crosses nodes when the CP group does."""
    b = DTYPE_BYTES[s.dtype]
    r = cp // ulysses
    n = -(-s.seq_len // (2 * cp)) * 2 * cp
    tokens = s.micro_batch * n
    d, hq = m.head_dim, m.heads
    g = math.gcd(m.kv_heads, ulysses)
    fwd_flops = 2 * s.micro_batch * n * n * hq * d / cp
    passes = 2 if s.checkpointing else 1  # forwards per step
    compute = fwd_flops * (passes + 2.5) / s.flops
    comm = attention_comm_bytes(m, b, tokens, cp, ulysses)
    ring_link, ring_bw = _link(s, cp <= s.gpus_per_node and s.gpus_per_node % cp == 0)
    a2a_link, a2a_bw = _link(s, s.gpus_per_node % ulysses == 0)
    ring_s = a2a_s = exposed = 0.0
    if r > 1:
        kv_hop = 2 * (m.kv_heads // g) * d * tokens / r  # elements of one hop's K/V (Hkv/g heads, N/R tokens)
        step = fwd_flops / r / s.flops  # forward compute per ring step
        fwd_hop, bwd_hop = kv_hop * b / ring_bw, kv_hop * (b + 4) / ring_bw
        ring_s = passes * (r - 1) * fwd_hop + (r - 1) * bwd_hop + kv_hop * 4 / ring_bw
        exposed += passes * (r - 1) * max(0.0, fwd_hop - step) + (r - 1) * max(0.0, bwd_hop - 2.5 * step)
        exposed += kv_hop * 4 / ring_bw  # the last dK/dV hop follows the last step
    if ulysses > 1:
        a2a_s = (passes * comm["all_to_all_forward"] + comm["all_to_all_backward"]) / a2a_bw
        exposed += a2a_s
    sent = comm["total"] + (passes - 1) * (comm["ring_forward"] + comm["all_to_all_forward"])
    return GridCost(ulysses, r, ring_link if r > 1 else "none", a2a_link if ulysses > 1 else "none",
                      ulysses // g, sent, ring_s, a2a_s, exposed, compute)  # fmt: skip


def ring_overlap(m: ModelShape, s: PlanSettings, cp: int, u: int, b: int, tokens: int) -> dict[str, Any]:
    """Whether the ring's transfers hide behind attention compute: per hop, ``2 T^2 Hq d`` FLOPs forward
    (half a block, zigzag) against the K/V of ``T`` tokens; with Ulysses ``T = N / R`` tokens on ``Hq / U``
    heads and K/V on ``Hkv / gcd(Hkv, U)`` heads. ``tokens``: one sequence's tokens per rank; ``b``: bytes
    per element."""
    link, bw = ("NVLink", s.intra_GBps) if cp <= s.gpus_per_node else ("inter-node", s.inter_GBps)
    gqa = m.kv_heads / math.gcd(m.kv_heads, u) / (m.heads / u)
    fwd_thr = s.flops / (bw * 1e9) * b * gqa  # T >= F * b * Hkv / (BW * Hq)
    bwd_thr = s.flops / (bw * 1e9) * (b + 4) / 2.5 * gqa  # 2.5x compute; K/V plus fp32 dK/dV travel
    thr = math.ceil(max(fwd_thr, bwd_thr))
    tpr = tokens * u  # tokens per ring position
    ring_size = cp // u
    return {
        "ring_tokens": tpr,
        "threshold_tokens": thr,
        "forward_threshold": math.ceil(fwd_thr),
        "backward_threshold": math.ceil(bwd_thr),
        "hidden": ring_size == 1 or tpr >= thr,
        "link": link if ring_size > 1 else "none",
        "link_GBps": bw,
        "flops": s.flops,
    }


def compare_grids(m: ModelShape, s: PlanSettings, cp: int | None = None) -> list[GridCost]:
    """Every grid of a CP group of ``cp`` ranks (default ``s.cp``, else ``s.gpus``): each
    ``U`` dividing ``cp`` and the model's query heads, ``U = 1`` (ring) first."""
    cp = cp or s.cp or s.gpus
    return [grid_cost(m, s, cp, u) for u in range(1, cp + 1) if cp % u == 0 and m.heads % u == 0]


def recommend(costs: list[GridCost]) -> GridCost:
    """The grid with the least exposed communication time; within 1% (or 10 us) of it, the
    smallest ``U`` (the least all-to-all traffic and K/V replication)."""
    best = min(c.exposed_s for c in costs)
    return next(c for c in costs if c.exposed_s <= best * 1.01 + 1e-5)
