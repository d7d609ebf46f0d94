"""The PNG: throughput and p99 latency against N (needs matplotlib, the ``[plot]`` extra)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .report import summary
from .results import RunResult

PLOT_EXTRA = 'pip install "bicodec-shm[plot]"'


def plot(results: Sequence[RunResult], path: str) -> str:
    """Throughput and p99 against N, one line per system: the median over the repeats, with
    bars from min to max. Returns a message for the user."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: it needs matplotlib, the [plot] extra: {PLOT_EXTRA}"
    rows = [r for r in summary(results) if r["runs"]]
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(11, 4.2))
    all_ns = sorted({r["n_clients"] for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    for k, system in enumerate(systems):
        style = {"marker": "o", "label": system, "color": f"C{k}", "capsize": 3}
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r["n_clients"])
        for ax, key in ((ax_t, "audio_s_per_s"), (ax_p, "latency_p99_ms")):
            points = [(r["n_clients"], r[key]) for r in mine if r[key] is not None]
            if not points:
                continue
            ns = [n for n, _ in points]
            med = [s["median"] for _, s in points]
            err = [[s["median"] - s["min"] for _, s in points], [s["max"] - s["median"] for _, s in points]]
            ax.errorbar(ns, med, yerr=err, **style)
    for ax, title, unit in ((ax_t, "throughput", "audio seconds per wall second"),
                            (ax_p, "p99 request latency", "ms")):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ns, [str(n) for n in all_ns])
        ax.minorticks_off()
        ax.set_xlabel("client processes N")
        ax.set_ylabel(unit)
        ax.set_title(f"{title} (median, min-max over repeats)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_p.set_yscale("log")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
