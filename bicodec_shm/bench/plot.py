"""The PNG: throughput and p99 latency against N (needs matplotlib, the ``[plot]`` extra)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .config import SYSTEMS
from .systems import RunResult


def plot(results: Sequence[RunResult], path: str) -> str:
    """Throughput and p99 against N, one line per system; returns a message for the user."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'bicodec-shm[plot]')"
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(11, 4.2))
    all_ns = sorted({r.n_clients for r in results})
    for k, system in enumerate(SYSTEMS):
        style = {"marker": "o", "label": system, "color": f"C{k}"}  # one colour per system
        rows = sorted((r for r in results if r.system == system and r.requests), key=lambda r: r.n_clients)
        if not rows:
            continue
        ns = [r.n_clients for r in rows]
        ax_t.plot(ns, [r.audio_s_per_s for r in rows], **style)
        p99 = [(r.n_clients, r.latency_p99_ms) for r in rows if r.latency_p99_ms is not None]
        if p99:
            ax_p.plot(*zip(*p99), **style)
    for ax, title, unit in ((ax_t, "throughput", "audio seconds per wall second"),
                            (ax_p, "p99 request latency", "ms")):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ns, [str(n) for n in all_ns])
        ax.minorticks_off()
        ax.set_xlabel("client processes N")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_p.set_yscale("log")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
