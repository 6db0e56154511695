"""Loss curves of a run (optional: needs matplotlib, ``pip install hf-ring[plots]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_loss", "smooth"]


def smooth(values: list[float], window: int = 9) -> list[float]:
    """Centred rolling median over ``window`` points (fewer at the ends): single spikes -- one
    sample the model gets wrong -- drop out, the trend stays."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = sorted(values[max(0, i - half) : i + half + 1])
        m = len(part) // 2
        out.append(part[m] if len(part) % 2 else (part[m - 1] + part[m]) / 2)
    return out


def plot_loss(history: list[dict[str, Any]], path: str | Path, title: str) -> bool:
    """Plot ``loss`` per logged step, one smoothed curve (``smooth``) per stage (``seq_len``) over
    the raw values; returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [h for h in history if "loss" in h and "step" in h]
    stages: list[list[dict[str, Any]]] = []
    for h in rows:
        if not stages or h.get("seq_len") != stages[-1][-1].get("seq_len"):
            stages.append([])
        stages[-1].append(h)
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, stage in enumerate(stages):
        steps, loss = [h["step"] for h in stage], [h["loss"] for h in stage]
        color = f"C{k}"
        ax.plot(steps, loss, color=color, alpha=0.25, lw=0.8)
        label = f"{stage[0]['seq_len']} tokens" if stage[0].get("seq_len") else None
        ax.plot(steps, smooth(loss), color=color, lw=2, label=label)
    ax.set(xlabel="optimizer step", ylabel="loss (mean over target tokens)", title=title, yscale="log")
    if any(s[0].get("seq_len") for s in stages):
        ax.legend(title="rolling median, per stage")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
