"""The PNG: throughput, p99 latency and peak memory against N (needs matplotlib, the ``[plot]``
extra). A point whose row is noise (report.py's flags) is drawn hollow."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from .report import summary
from .results import RunResult

PLOT_EXTRA = 'pip install "bicodec-shm[plot]"'
# (summary key, title, axis label, log scale)
PANELS = (
    ("audio_s_per_s", "throughput", "audio seconds per wall second", False),
    ("latency_p99_ms", "p99 request latency", "ms", True),
    ("peak_rss_mib", "peak memory, all its processes", "MiB (summed RSS)", True),
)
NOISE_LABEL = "hollow: noise, not a result (few requests, wide spread or lane tuner exploring)"


def plain(value: float) -> str:
    """A tick label without scientific notation: 1350, 20, 0.5."""
    if value >= 10 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.3g}"


def log_ticks(lo: float, hi: float) -> list[float]:
    """Round values in [lo, hi] for a log axis: powers of ten, else 1-2-5, else 1-9 per decade
    (three or more of them; two of 1-9 will do), else three values spread over the range."""
    if not (0 < lo < hi and math.isfinite(hi)):
        return []
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    ticks: list[float] = []
    for subs in ((1,), (1, 2, 5), tuple(range(1, 10))):
        ticks = [m * 10.0**e for e in decades for m in subs if lo <= m * 10.0**e <= hi]
        if len(ticks) >= 3:
            return ticks
    if len(ticks) >= 2:
        return ticks
    for digits in (2, 3, 4):  # a narrow range: the fewest digits that keep three inside it
        spread = sorted({float(f"{lo * (hi / lo) ** q:.{digits}g}") for q in (0.1, 0.5, 0.9)})
        inside = [t for t in spread if lo <= t <= hi]
        if len(inside) >= 2:
            return inside
    return [lo, hi]


def figure(results: Sequence[RunResult]) -> Any:
    """The figure: one panel per ``PANELS`` entry, one line per system, the median over the
    repeats with bars from min to max; a hollow marker where the row is noise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    rows = [r for r in summary(results) if r["runs"]]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(16, 5.2))
    all_ns = sorted({r["n_clients"] for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    any_noise = False
    for k, system in enumerate(systems):
        color = f"C{k}"
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r["n_clients"])
        for ax, (key, *_) in zip(axes, PANELS):
            points = [(r["n_clients"], r[key], bool(r["noise"]["flags"])) for r in mine if r[key] is not None]
            if not points:
                continue
            ns = [n for n, _, _ in points]
            med = [s["median"] for _, s, _ in points]
            err = [[s["median"] - s["min"] for _, s, _ in points],
                   [s["max"] - s["median"] for _, s, _ in points]]  # fmt: skip
            ax.errorbar(ns, med, yerr=err, color=color, capsize=3, label=system)
            for noisy in (False, True):
                picked = [(n, m) for (n, _, bad), m in zip(points, med) if bad is noisy]
                if picked:
                    any_noise |= noisy
                    ax.plot(*zip(*picked), linestyle="none", marker="o", markersize=7, color=color,
                            markerfacecolor="none" if noisy else color, markeredgewidth=1.5)  # fmt: skip
    for ax, (_, title, unit, log) in zip(axes, PANELS):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ns, [str(n) for n in all_ns])
        ax.minorticks_off()
        ax.set_xlabel("client processes N")
        ax.set_ylabel(unit)
        ax.set_title(f"{title}\n(median, min-max over repeats)", fontsize=10)
        ax.grid(True, alpha=0.3)
        if log and ax.has_data():
            ax.set_yscale("log")
            lo, hi = ax.get_ylim()
            ticks = log_ticks(lo, hi)
            ax.set_yticks(ticks, [plain(t) for t in ticks])
            ax.set_ylim(lo, hi)
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            formatter = ScalarFormatter(useOffset=False)
            formatter.set_scientific(False)
            ax.yaxis.set_major_formatter(formatter)
    # One legend for the three panels, below them: inside a panel it would hide its lines.
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    if any_noise:
        handles.append(Line2D([], [], linestyle="none", marker="o", markersize=7, color="0.3",
                              markerfacecolor="none", markeredgewidth=1.5))  # fmt: skip
        labels.append(NOISE_LABEL)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    rows_of_legend = math.ceil(len(labels) / 3)
    fig.tight_layout(rect=(0, 0.05 + 0.045 * rows_of_legend, 1, 1))
    return fig


def plot(results: Sequence[RunResult], path: str) -> str:
    """Write ``figure(results)`` to ``path``; returns a message for the user."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"no plot: it needs matplotlib, the [plot] extra: {PLOT_EXTRA}"
    fig = figure(results)
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
