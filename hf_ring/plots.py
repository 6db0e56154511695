"""Every picture hf_ring draws (matplotlib is optional: without it each function returns ``False`` and
draws nothing; the JSON or log is the result, the PNG a view of it).

- ``plot_loss``: a run's loss per optimizer step, a rolling median per stage (``hf-ring train``'s
  ``loss.png``);
- ``needle_png``: the length x depth heatmap in the style of EasyContext / the needle-in-a-haystack
  test (red 0 -> yellow -> green 1, lengths along x, depths down y);
- ``needle_comparison_png``: several heatmaps side by side (before / after fine-tuning) and their
  accuracy vs length;
- ``ppl_png``: loss by position bucket;
- ``ruler_png``: RULER's scores, tasks down y and lengths along x, with the average row.

Figures are drawn on ``matplotlib.figure.Figure`` (no pyplot state). Standard library and the
planner's token formatting only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .planner.settings import format_tokens

__all__ = [
    "have_matplotlib",
    "model_name",
    "needle_comparison_png",
    "needle_png",
    "plot_loss",
    "ppl_png",
    "ruler_png",
    "smooth",
]

COLOURS = ["#F0496E", "#EBB839", "#0CD79F"]  # the needle-in-a-haystack palette: 0 red, 0.5 yellow, 1 green


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _grid(result: dict[str, Any], metric: str) -> tuple[list[int], list[float], list[list[float]]]:
    """``[depth][length]`` values of ``metric`` (NaN for a cell without a record)."""
    lengths, depths = result["lengths"], result["depths"]
    at = {(c["length"], c["depth"]): c[metric] for c in result["cells"]}
    return lengths, depths, [[at.get((n, d), float("nan")) for n in lengths] for d in depths]


def _heatmap(ax: Any, fig: Any, result: dict[str, Any], title: str) -> None:
    from matplotlib.colors import LinearSegmentedColormap

    lengths, depths, grid = _grid(result, "accuracy")
    cmap = LinearSegmentedColormap.from_list("needle", COLOURS)
    im = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(lengths)), [format_tokens(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xticks([i - 0.5 for i in range(1, len(lengths))], minor=True)
    ax.set_yticks([i - 0.5 for i in range(1, len(depths))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="accuracy", fraction=0.046, pad=0.03)


def _metadata(result: dict[str, Any], metric: str) -> dict[str, str]:
    """PNG text chunks: the grid drawn (``Description``: JSON of lengths, depths and values)."""
    lengths, depths, grid = _grid(result, metric)
    grid_json = json.dumps({"metric": metric, "lengths": lengths, "depths": depths, "values": grid})
    return {"Title": f"hf-ring eval needle: {result['model']}", "Description": grid_json, "Software": "hf_ring"}


def model_name(result: dict[str, Any]) -> str:
    """The model (or adapter) of a result, by the last two parts of its path or hub id."""
    return "/".join(Path(str(result.get("adapter") or result["model"])).parts[-2:])


def _title(result: dict[str, Any]) -> str:
    """Two lines, so that a long model path fits above a narrow heatmap."""
    return f"{model_name(result)}\nmean accuracy {result['summary']['accuracy']:.0%}"


def needle_png(result: dict[str, Any], path: str | Path) -> bool:
    """The heatmap of one ``needle.json`` result at ``path``; ``False`` without matplotlib."""
    if not have_matplotlib():
        return False
    from matplotlib.figure import Figure

    lengths, depths = result["lengths"], result["depths"]
    fig = Figure(figsize=(max(5.0, 1.0 + 0.8 * len(lengths)), max(3.5, 1.2 + 0.35 * len(depths))), layout="tight")
    _heatmap(fig.add_subplot(), fig, result, _title(result) + " (teacher-forced)")
    fig.savefig(path, dpi=120, metadata=_metadata(result, "accuracy"))
    return True


def needle_comparison_png(results: list[dict[str, Any]], labels: list[str], path: str | Path) -> bool:
    """Heatmaps of ``results`` side by side, titled ``labels``, and their accuracy vs length."""
    if not have_matplotlib():
        return False
    from matplotlib.figure import Figure

    k = len(results)
    width = max(5.0, 1.0 + 0.8 * max(len(r["lengths"]) for r in results))
    fig = Figure(
        figsize=(width * k + 5.0, max(3.5, 1.2 + 0.35 * max(len(r["depths"]) for r in results))), layout="tight"
    )
    axes = fig.subplots(1, k + 1, width_ratios=[width] * k + [5.0])
    for ax, result, label in zip(axes, results, labels):
        _heatmap(ax, fig, result, f"{label}: mean accuracy {result['summary']['accuracy']:.0%}")
    ax = axes[-1]
    every: set[int] = set()
    for result, label in zip(results, labels):
        by_len = result["summary"]["accuracy_by_length"]
        ns = sorted(int(n) for n in by_len)
        every.update(ns)
        ax.plot(ns, [by_len[str(n)] for n in ns], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(every), [format_tokens(n) for n in sorted(every)])
    ax.minorticks_off()
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy (mean over depths)")
    ax.set_title("accuracy vs length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return True


def ppl_png(result: dict[str, Any], path: str | Path) -> bool:
    """Loss by position bucket of one ``ppl.json`` result; ``False`` without matplotlib."""
    if not have_matplotlib():
        return False
    from matplotlib.figure import Figure

    rows = [b for b in result["buckets"] if b["tokens"]]
    fig = Figure(figsize=(7.0, 4.0), layout="tight")
    ax = fig.add_subplot()
    ax.plot([(b["start"] + b["end"]) / 2 for b in rows], [b["loss"] for b in rows], marker="o")
    ax.set_xlabel("position in the document (tokens; bucket midpoints)")
    ax.set_ylabel("loss (nats per token)")
    at = format_tokens(result["seq_len"])
    ax.set_title(f"{model_name(result)}: loss by position at {at} tokens ({result['documents']} documents)")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    return True


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
    if not have_matplotlib():
        return False
    from matplotlib.figure import Figure

    rows = [h for h in history if "loss" in h and "step" in h]
    stages: list[list[dict[str, Any]]] = []
    for h in rows:
        if not stages or h.get("seq_len") != stages[-1][-1].get("seq_len"):
            stages.append([])
        stages[-1].append(h)
    fig = Figure(figsize=(7, 4), layout="tight")
    ax = fig.add_subplot()
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
    fig.savefig(path, dpi=120)
    return True


def ruler_png(result: dict[str, Any], path: str | Path) -> bool:
    """The task x length heatmap of one ``ruler.json`` result (scores in percent, RULER's average in the
    last row) at ``path``; ``False`` without matplotlib."""
    if not have_matplotlib():
        return False
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure

    tasks, lengths = result["tasks"], result["lengths"]
    table, average = result["summary"]["table"], result["summary"]["average"]
    rows = [[table[t][str(n)] for n in lengths] for t in tasks] + [[average[str(n)] for n in lengths]]
    fig = Figure(figsize=(max(5.0, 2.5 + 0.9 * len(lengths)), max(3.0, 1.2 + 0.4 * len(rows))), layout="tight")
    ax = fig.add_subplot()
    im = ax.imshow(rows, cmap=LinearSegmentedColormap.from_list("ruler", COLOURS), vmin=0, vmax=100, aspect="auto")
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [format_tokens(n) for n in lengths])
    ax.set_yticks(range(len(rows)), [*tasks, "average"])
    ax.axhline(len(tasks) - 0.5, color="white", linewidth=3)
    ax.set_xlabel("length (tokens, generation included)")
    ax.set_title(f"RULER: {model_name(result)} (CP = {result['settings'].get('cp_size', 1)})")
    fig.colorbar(im, ax=ax, label="score (%)", fraction=0.046, pad=0.03)
    description = json.dumps({"tasks": tasks, "lengths": lengths, "values": rows})
    fig.savefig(path, dpi=120, metadata={"Title": f"hf-ring eval ruler: {result['model']}",
                                        "Description": description, "Software": "hf_ring"})  # fmt: skip
    return True
