"""The text ``hf-ring plan`` prints for a plan: per-rank memory, the ring overlap, attention bytes, the ring /
Ulysses grids and the step's time estimate. Imports neither torch nor transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .grids import choose_ulysses_size

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["grid_lines", "plan_table", "time_lines"]

GiB = 2**30


def plan_table(self: Plan) -> str:
    """The per-rank memory table of ``hf-ring plan``, with the step's time estimate."""
    lines = [
        f"{self.model.name}: {self.seq_len:,} tokens on {self.gpus} GPUs, CP={self.cp} "
        f"(DP={self.gpus // self.cp}), {self.tokens_per_rank:,} tokens per rank; "
        + ", ".join(f"{k}={v}" for k, v in self.shown_settings().items()),
        f"{'per rank':<44}{'GiB':>10}"
        + (f"   (Ulysses {self.ulysses} x ring {self.cp // self.ulysses})" if self.ulysses > 1 else ""),
    ]
    for k, v in self.rows.items():
        lines.append(f"  {k:<42}{v / GiB:>10.2f}")
    lines.append("  activation peak, by phase of the step:")
    for k, v in self.phases.items():
        mark = "  <- peak" if k == self.peak_phase else ""
        lines.append(f"    {k:<40}{v / GiB:>10.2f}{mark}")
    lines.append(f"  {'peak (model states + activation peak + reserve)':<42}{self.peak / GiB:>10.2f}")
    lines.append(f"  {'fits in':<42}{self.gpu_bytes / GiB:>10.2f}  {'yes' if self.fits else 'NO'}")
    if any(self.host.values()):
        node = min(self.gpus, self.settings.gpus_per_node)
        limit = self.settings.host_gib
        verdict = ""
        if limit is not None:
            verdict = f" (of {limit:g} GiB: {'fits' if self.host_per_node <= limit * GiB else 'does NOT fit'})"
        lines.append(
            f"  host memory (offloaded): {self.host_per_rank / GiB:.2f} GiB per rank, "
            f"{self.host_per_node / GiB:.1f} GiB per node of {node} GPUs{verdict}"
        )
    o = self.overlap
    where = "per rank" if self.ulysses == 1 else "per ring position"
    lines.append(
        f"  ring overlap: {o['ring_tokens']:,} tokens {where} vs threshold {o['threshold_tokens']:,} "
        f"(forward {o['forward_threshold']:,}, backward {o['backward_threshold']:,}; "
        f"{o['link']} {o['link_GBps']:g} GB/s, {o['flops'] / 1e12:g} TFLOP/s, GQA {self.model.heads}/"
        f"{self.model.kv_heads}): {'hidden' if o['hidden'] else 'NOT hidden'}"
    )
    c = self.comm
    if c:
        parts = [f"{c['full_layers']} full layers x {c['full_layer_bytes'] / 2**20:.1f} MiB"]
        if c["windowed_layers"]:
            how = "window border" if c["border"] else "ring turned as far as the window reaches"
            parts.append(
                f"{c['windowed_layers']} windowed layers ({self.model.window} tokens, {how}) x "
                f"{c['windowed_layer_bytes'] / 2**20:.2f} MiB"
            )
        lines.append(f"  attention sent per step and rank: {c['total'] / GiB:.2f} GiB ({'; '.join(parts)})")
    lines.extend(time_lines(self))
    lines.extend(grid_lines(self))
    lines.extend(f"  note: {n}" for n in self.notes)
    return "\n".join(lines)


def grid_lines(self: Plan) -> list[str]:
    """The table of ring / Ulysses grids (per layer and rank: fwd + bwd, + recompute)."""
    best = self.recommended
    if best is None or len(self.grids) == 1:
        return []
    s = self.settings
    lines = [
        f"  attention grids of the CP group, per layer and rank (forward + backward"
        f"{' + recompute' if s.checkpointing else ''}; {s.gpus_per_node} GPUs per node):",
        f"    {'grid':<12}{'U x R':>8}{'MiB sent':>10}{'comm ms':>10}{'exposed ms':>12}{'compute ms':>12}"
        f"  links (all-to-all / ring)",
    ]
    for c in self.grids:
        mark = ("  <- recommended" if c is best else "") + ("  (planned)" if c.ulysses == self.ulysses else "")
        lines.append(
            f"    {c.name:<12}{f'{c.ulysses} x {c.ring}':>8}{c.bytes_sent / 2**20:>10.0f}{c.comm_s * 1e3:>10.2f}"
            f"{c.exposed_s * 1e3:>12.2f}{c.compute_s * 1e3:>12.1f}  {c.a2a_link} / {c.ring_link}"
            + (f", K/V x{c.kv_replication}" if c.kv_replication > 1 else "")
            + mark
        )
    auto = choose_ulysses_size(self.model.heads, self.model.kv_heads, self.cp, s.gpus_per_node)
    lines.append(
        f"  recommended: ulysses_size={best.ulysses} (least exposed communication: a ring hop hides behind "
        f"its step's compute when that is longer, an all-to-all never); ulysses_size=auto gives {auto}"
    )
    return lines


def time_lines(self: Plan) -> list[str]:
    """One micro-step's time on one rank, by part, and tokens/s and MFU; marked "estimate" while the kernel
    rates are defaults (not measured on that GPU kind)."""
    t = self.time
    if t is None:
        return []
    r = t.rates
    how = (f"kernel rates {r.source}" if r.measured else
           f"estimate: default kernel rates, not yet measured on {r.gpu} (scripts/gpu_check.sh)")  # fmt: skip
    gpus = self.gpus
    return [
        f"  step time per micro-batch ({how}; attention on {r.kernel}, {r.attention / 1e12:.0f} TFLOP/s; GEMMs "
        f"{r.gemm / 1e12:.0f} TFLOP/s):",
        f"    {t.total_s:.2f} s = attention {t.attention_s:.2f} + GEMMs {t.gemm_s:.2f} + memory-bound "
        f"{t.memory_s:.2f} + exposed communication {t.exposed_comm_s:.3f}"
        + (f" + vision tower {t.vision_s:.2f}" if t.vision_s else ""),
        f"    {t.tokens_per_s:,.0f} tokens/s per GPU ({t.tokens_per_s * gpus:,.0f} on {gpus} GPUs), MFU "
        f"{t.mfu:.0%}{' (estimate)' if not r.measured else ''}",
    ]
