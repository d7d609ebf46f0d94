"""Comparison of the systems, the issue's targets, and the text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .config import LIMIT, PER_PROCESS, SHM, TARGET_N, TARGETS
from .systems import RunResult


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not np.isfinite(a) or not np.isfinite(b) or b == 0:
        return None
    return a / b


def compare(results: Sequence[RunResult]) -> dict[int, dict[str, dict[str, float | None]]]:
    """Per N and system: throughput against the limit and against decoder-per-process, and
    memory against decoder-per-process."""
    by_n: dict[int, dict[str, RunResult]] = {}
    for r in results:
        if r.requests:  # a skipped system has no numbers to compare
            by_n.setdefault(r.n_clients, {})[r.system] = r
    out: dict[int, dict[str, dict[str, float | None]]] = {}
    for n, systems in by_n.items():
        limit, own = systems.get(LIMIT), systems.get(PER_PROCESS)
        out[n] = {
            s: {
                "vs_limit": _ratio(r.audio_s_per_s, limit.audio_s_per_s if limit else None),
                "vs_per_process": _ratio(r.audio_s_per_s, own.audio_s_per_s if own else None),
                "memory_vs_per_process": _ratio(r.peak_rss_mib, own.peak_rss_mib if own else None),
            }
            for s, r in systems.items()
        }
    return out


def targets(comparison: dict[int, dict[str, dict[str, float | None]]],
            n: int = TARGET_N) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The issue's targets for bicodec-shm at ``n`` clients: measured value and whether met."""
    shm = comparison.get(n, {}).get(SHM, {})
    out = {}
    for key, (goal, bound, op) in TARGETS.items():
        measured = shm.get(key)
        met = None if measured is None else (measured >= bound if op == ">=" else measured <= bound)
        out[key] = {"goal": goal, "n_clients": n, "bound": bound, "measured": measured, "met": met}
    return out


def _fmt(v: float | None, spec: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return none
    return format(v, spec)


def format_table(results: Sequence[RunResult],
                 comparison: dict[int, dict[str, dict[str, float | None]]]) -> str:  # fmt: skip
    """One row per (N, system): absolute numbers with the ratios next to them."""
    head = ("N", "system", "audio s/s", "req/s", "x limit", "x per-proc", "p50 ms", "p99 ms",
            "avg batch", "peak RSS MiB", "mem x per-proc", "CPU s/audio s", "others' load")  # fmt: skip
    rows = []
    for r in results:
        c = comparison.get(r.n_clients, {}).get(r.system, {})
        if r.note.startswith("skipped"):
            rows.append((str(r.n_clients), r.system, r.note))
            continue
        rows.append((
            str(r.n_clients), r.system, _fmt(r.audio_s_per_s, ".3f"), _fmt(r.requests_per_s, ".3f"),
            _fmt(c.get("vs_limit"), ".2f"), _fmt(c.get("vs_per_process"), ".2f"),
            _fmt(r.latency_p50_ms, ".0f"), _fmt(r.latency_p99_ms, ".0f"),
            _fmt(r.avg_batch_size, ".2f"), _fmt(r.peak_rss_mib, ".0f"),
            _fmt(c.get("memory_vs_per_process"), ".2f"), _fmt(_cpu_per_audio(r), ".2f"),
            _fmt(r.others_cpu_share, ".0%"),
        ))  # fmt: skip
    return _grid(head, rows, left=2)


def _cpu_per_audio(r: RunResult) -> float | None:
    """CPU seconds per audio second: the cost of the work, much less noisy than wall time."""
    return r.cpu_seconds / r.audio_seconds if r.audio_seconds else None


def _grid(head: tuple[str, ...], rows: list[tuple[str, ...]], *, left: int) -> str:
    """Columns: the first ``left`` left-aligned, the rest right-aligned; a blank line between
    groups of rows (a new value in the first column). A row shorter than the head ends in a
    note that spans the remaining columns."""
    widths = [max([len(h)] + [len(r[i]) for r in rows if len(r) == len(head)])
              for i, h in enumerate(head)]  # fmt: skip

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < left or i == len(cells) - 1 < len(head) - 1
                         else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(head), "  ".join("-" * w for w in widths)]
    for k, r in enumerate(rows):
        if k and r[0] != rows[k - 1][0]:
            out.append("")
        out.append(line(r))
    return "\n".join(out)


def format_targets(t: dict[str, dict[str, Any]]) -> str:
    lines = []
    for v in t.values():
        if v["met"] is None:
            lines.append(f"N={v['n_clients']}: {v['goal']}: not measured")
            continue
        lines.append(f"N={v['n_clients']}: {v['goal']}: measured {v['measured']:.2f}x  "
                     f"{'met' if v['met'] else 'NOT MET'}")  # fmt: skip
    return "\n".join(lines)


def format_sweep(results: Sequence[RunResult]) -> str:
    """Median over repeats per (max_wait_ms, max_batch_tokens), best throughput marked."""
    groups = sweep_summary(results)
    best = max(groups, key=lambda g: g["audio_s_per_s"]) if groups else None
    best_p99 = min(groups, key=lambda g: g["latency_p99_ms"]) if groups else None
    head = ("max_wait_ms", "max_batch_tokens", "runs", "audio s/s", "req/s", "p50 ms", "p99 ms",
            "avg batch", "padding", "peak RSS MiB", "CPU s/audio s", "others' load", "")  # fmt: skip
    rows = []
    for g in groups:
        mark = " ".join(m for m, hit in (("<- best throughput", g is best),
                                         ("<- best p99", g is best_p99)) if hit)  # fmt: skip
        rows.append((
            f"{g['max_wait_ms']:g}", str(g["max_batch_tokens"]), str(g["runs"]),
            _fmt(g["audio_s_per_s"], ".3f"), _fmt(g["requests_per_s"], ".3f"),
            _fmt(g["latency_p50_ms"], ".0f"), _fmt(g["latency_p99_ms"], ".0f"),
            _fmt(g["avg_batch_size"], ".2f"), _fmt(g["padding_overhead"], ".0%"),
            _fmt(g["peak_rss_mib"], ".0f"), _fmt(g["cpu_per_audio_s"], ".2f"),
            _fmt(g["others_cpu_share"], ".0%"), mark,
        ))  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]  # fmt: skip
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths)).rstrip(),
           "  ".join("-" * w for w in widths[:-1])]  # fmt: skip
    out += ["  ".join(c.rjust(w) if i < len(r) - 1 else c for i, (c, w) in
                      enumerate(zip(r, widths))).rstrip() for r in rows]  # fmt: skip
    return "\n".join(out)


def sweep_summary(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per (max_wait_ms, max_batch_tokens): the median of each metric over the repeats."""
    groups: dict[tuple, list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.policy["max_wait_ms"], r.policy["max_batch_tokens"] or 0), []).append(r)
    out = []
    for (wait, budget), runs in sorted(groups.items()):

        def med(key: str, runs: list[RunResult] = runs) -> float | None:
            vals = [getattr(r, key) for r in runs if getattr(r, key) is not None]
            return float(np.median(vals)) if vals else None

        out.append({
            "max_wait_ms": wait, "max_batch_tokens": budget or None, "runs": len(runs),
            "audio_s_per_s": med("audio_s_per_s"), "requests_per_s": med("requests_per_s"),
            "latency_p50_ms": med("latency_p50_ms"), "latency_p99_ms": med("latency_p99_ms"),
            "avg_batch_size": med("avg_batch_size"), "padding_overhead": med("padding_overhead"),
            "peak_rss_mib": med("peak_rss_mib"), "others_cpu_share": med("others_cpu_share"),
            "cpu_per_audio_s": float(np.median([_cpu_per_audio(r) or 0.0 for r in runs])),
        })  # fmt: skip
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
