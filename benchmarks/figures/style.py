"""What every benchmark figure shares: selecting rows of the long tables (read by
``benchmarks.harness.read_rows``), a series with its p20..p80 error bars, the machine and versions line
under each title, saving."""

from __future__ import annotations

import matplotlib

from ..harness import machine_text, versions_text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["COLORS", "finish", "log2x", "machine", "p_values", "plt", "select", "series", "subtitle"]

COLORS = {1: "tab:gray", 2: "tab:blue", 4: "tab:orange", 8: "tab:green"}


def select(rows, **kw) -> list[dict]:
    return sorted((r for r in rows if all(r.get(k) == v for k, v in kw.items())), key=lambda r: r["x"])


def series(ax, rows, label, color, style="-o", xkey="x"):
    if not rows:
        return
    xs = [r[xkey] for r in rows]
    med = [r["median"] for r in rows]
    lo = [max(0.0, r["median"] - r["p20"]) for r in rows]
    hi = [max(0.0, r["p80"] - r["median"]) for r in rows]
    ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, color=color, label=label, capsize=3, lw=1.5, ms=5)


def p_values(rows) -> list[int]:
    return sorted({r["P"] for r in rows})


def machine(rows) -> str:
    """The machine the rows were measured on, as its rows record it (``harness.machine_info``)."""
    m = rows[0].get("machine") if rows else None
    return machine_text(m) if m else "machine not recorded"


def subtitle(rows) -> str:
    """``machine(rows)``, with the torch and hf_ring versions of the first row."""
    if not rows:
        return ""
    versions = versions_text(rows[0].get("versions"))
    return f"{machine(rows)}; {versions}" if versions else machine(rows)


def log2x(ax, xs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(xs)))
    ax.set_xticklabels([str(x) for x in sorted(set(xs))])


def finish(fig, ax, rows, title, path, outside=False):
    ax.set_title(title, fontsize=11)
    fig.suptitle(subtitle(rows), fontsize=7, y=0.995, color="dimgray")
    ax.grid(True, alpha=0.3)
    if outside:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
