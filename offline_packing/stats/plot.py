"""`mmpack stats --plot FILE.png`: length distribution, fill per bin and samples per bin in one figure.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so it works
headless and does not disturb other matplotlib users in the process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

_THOUSANDS = FuncFormatter(lambda value, _pos: f"{value:,.0f}")


def bin_fill(lengths: np.ndarray, bin_ids: np.ndarray, num_bins: int, capacity: int) -> np.ndarray:
    """Fraction of the capacity used by each bin (items with bin id -1 are ignored)."""
    packed = bin_ids >= 0
    tokens = np.bincount(bin_ids[packed], weights=lengths[packed], minlength=num_bins)
    return tokens / capacity


def plot_packing(
    path: str | Path,
    lengths: np.ndarray,
    bin_ids: np.ndarray,
    stats: dict[str, Any],
    title: str,
) -> Path:
    """Write the three-panel figure to `path` (PNG) and return the path."""
    capacity = int(stats["capacity"])
    num_bins = int(stats["num_bins"])
    fill = bin_fill(lengths, bin_ids, num_bins, capacity)
    samples_per_bin = np.bincount(bin_ids[bin_ids >= 0], minlength=num_bins)

    fig = Figure(figsize=(15, 4.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_len, ax_fill, ax_spb = fig.subplots(1, 3)

    _plot_lengths(ax_len, lengths, capacity)
    _plot_fill(ax_fill, fill, float(stats["fill_efficiency"]))
    _plot_samples_per_bin(ax_spb, samples_per_bin)
    fig.suptitle(
        f"{title}\n{len(lengths):,} samples in {num_bins:,} bins of {capacity:,} tokens, "
        f"fill efficiency {100 * float(stats['fill_efficiency']):.3f}%, "
        f"L2 lower bound {int(stats['l2_lower_bound_bins']):,} bins",
        fontsize=11,
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _histogram_bars(ax: Any, values: np.ndarray, edges: np.ndarray, color: str) -> np.ndarray:
    """Draw the histogram of `values` over `edges` as bars; returns the counts."""
    # computed with numpy, drawn as bars: matplotlib's hist would copy millions of floats
    counts, _ = np.histogram(values, bins=edges)
    ax.bar(
        edges[:-1], counts, width=np.diff(edges), align="edge", color=color, edgecolor="white", linewidth=0.3
    )
    return counts


def _plot_lengths(ax: Any, lengths: np.ndarray, capacity: int) -> None:
    hi = max(int(lengths.max()), capacity) if lengths.size else capacity
    _histogram_bars(ax, lengths, np.linspace(0, hi, 81), "#4C72B0")
    ax.axvline(capacity, color="#C44E52", linestyle="--", linewidth=1.2, label=f"capacity {capacity:,}")
    ax.set_title("Sample length distribution")
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    ax.yaxis.set_major_formatter(_THOUSANDS)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)


def _plot_fill(ax: Any, fill: np.ndarray, efficiency: float) -> None:
    # a histogram rather than one bar per bin: readable for millions of bins
    counts = _histogram_bars(ax, 100 * fill, np.linspace(0, 100, 51), "#55A868")
    ax.axvline(
        100 * efficiency, color="black", linestyle="--", linewidth=1.0, label=f"mean {100 * efficiency:.2f}%"
    )
    ax.set_xlim(0, 100)
    ax.set_title("Fill per bin")
    ax.set_xlabel("fill (% of capacity)")
    _y_scale(ax, counts, "bins")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)


def _plot_samples_per_bin(ax: Any, samples_per_bin: np.ndarray) -> None:
    counts = np.bincount(samples_per_bin) if samples_per_bin.size else np.zeros(1, np.int64)
    ks = np.flatnonzero(counts)
    ax.bar(ks, counts[ks], width=0.8, color="#8172B2")
    ax.set_title("Samples per bin")
    ax.set_xlabel("samples in the bin")
    _y_scale(ax, counts, "bins")
    if samples_per_bin.size:
        mean = samples_per_bin.mean()
        ax.axvline(mean, color="black", linestyle="--", linewidth=1.0, label=f"mean {mean:.2f}")
        ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _y_scale(ax: Any, counts: np.ndarray, label: str) -> None:
    """Log scale when counts span over two orders of magnitude, so that small groups stay visible."""
    nonzero = counts[counts > 0]
    if nonzero.size and nonzero.max() > 100 * nonzero.min():
        ax.set_yscale("log")
        ax.set_ylabel(f"{label} (log scale)")
    else:
        ax.yaxis.set_major_formatter(_THOUSANDS)
        ax.set_ylabel(label)
