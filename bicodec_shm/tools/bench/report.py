"""Comparison of the systems over repeats, the targets, the noise flags, and the text tables.

Each ratio (bicodec-shm / decoder per process, / the limit, ...) is computed within one
repeat, from runs taken minutes apart on the same machine, and only then summarised over the
repeats as median, min and max; a target is judged on the median.

Noise: a row (one system at one N, over its repeats) is flagged, in the table, the JSON and the
PNG, when its numbers are noise rather than a result (``row_noise``, ``FLAGS``):

- ``few``: a run counted fewer than ``MIN_REQUESTS`` requests (its window held too few);
- ``spread``: its throughput's max / min over the repeats exceeds ``MAX_SPREAD``;
- ``tuner``: the lane tuner explored lane counts during more than ``MAX_TUNER_SHARE`` of a
  window, which then mixes arrangements, some slower by design (exploring measures them).

A ratio is marked (``?``) when either of its rows is flagged or the ratio itself spreads over
``MAX_SPREAD``; a ratio to the limit above 1 is marked ``!`` with a footnote that says why it is
an artefact (``above_limit_note``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .config import COMPUTED, IDEAL, LIMIT, PER_PROCESS, PIPELINED_IDEAL, QUEUE, SHM, TARGETS, Target
from .results import RunResult
from .workload import DEFAULT_MIX, Band, parse_mix

# The per-run numbers summarised over repeats: (key, table header, format).
METRICS = (
    ("audio_s_per_s", "audio s/s", ".3f"),
    ("requests_per_s", "req/s", ".2f"),
    ("latency_p50_ms", "p50 ms", ".0f"),
    ("latency_p99_ms", "p99 ms", ".0f"),
    ("cpu_per_audio_s", "CPU s/audio s", ".3g"),
    ("avg_batch_size", "avg batch", ".2f"),
    ("padding_overhead", "padding", ".0%"),
    ("peak_rss_mib", "peak RSS MiB", ".0f"),
    ("others_cpu_share", "others' load", ".0%"),
    ("requests", "requests", ".0f"),
    ("cut_at_edge", "cut", ".0f"),
)
# Ratios of a system against a reference system in the same repeat and N: (key, header,
# reference, metric).
RATIOS = (
    ("vs_limit", "x limit", LIMIT, "audio_s_per_s"),
    ("vs_per_process", "x per-proc", PER_PROCESS, "audio_s_per_s"),
    ("vs_queue", "x queue", QUEUE, "audio_s_per_s"),
    ("vs_ideal", "x ideal", IDEAL, "audio_s_per_s"),
    ("vs_pipelined_ideal", "x pipelined ideal", PIPELINED_IDEAL, "audio_s_per_s"),
    ("memory_vs_per_process", "mem x per-proc", PER_PROCESS, "peak_rss_mib"),
)


# -- noise --------------------------------------------------------------------------------------
# With fewer requests in a run, one request more or less moves its throughput by over 5 %, and
# the request in flight at the close (left out) is a large share of the window's work.
MIN_REQUESTS = 20
# The largest max / min of a row's throughput over its repeats. Max / min rather than a
# coefficient of variation: with the default 3 repeats a CV is itself a guess from 3 points,
# while max / min is the (min-max) the table prints, so the reader sees the number the flag
# judges. Runs of one system move by 10-15 % between repeats on a shared 2-core machine
# (benchmarks/RESULTS.md); 1.5x is far beyond that.
MAX_SPREAD = 1.5
# The largest share of a window the lane tuner may spend exploring: under a tenth, the mix of
# arrangements moves the throughput by less than the repeat-to-repeat noise above.
MAX_TUNER_SHARE = 0.1
FLAGS = {  # code -> what it means (the table's legend and the JSON's)
    "few": f"a window held fewer than {MIN_REQUESTS} requests: one request more or less moves its "
           "throughput by over 5 %; a longer --window holds more",
    "spread": f"its throughput differs by more than {MAX_SPREAD:g}x (max / min) across the repeats",
    "tuner": f"the lane tuner explored lane counts during more than {MAX_TUNER_SHARE:.0%} of a "
             "window, which then mixes arrangements, some slower by design; --lanes K fixes the "
             "count, a longer --window dilutes the exploration",
    "above-limit": "a ratio to the limit (no IPC) above 1 (see its footnote)",
}  # fmt: skip
NOISE_RULES = {"min_requests": MIN_REQUESTS, "max_spread": MAX_SPREAD,
               "max_tuner_share": MAX_TUNER_SHARE, "flags": FLAGS}  # fmt: skip


def row_noise(runs: Sequence[RunResult]) -> dict[str, Any]:
    """Why one row's runs (one system at one N, its repeats) are noise: ``flags`` (codes of
    ``FLAGS``, empty if none) and the numbers behind them. ``lanes``: every lane count that took
    batches in its windows (bicodec-shm; [] for the others)."""
    runs = _measured(runs)
    flags = []
    least = min((r.requests for r in runs), default=None)
    if least is not None and least < MIN_REQUESTS:
        flags.append("few")
    speeds = [r.audio_s_per_s for r in runs if r.audio_s_per_s > 0]
    spread = max(speeds) / min(speeds) if len(speeds) > 1 else None
    if spread is not None and spread > MAX_SPREAD:
        flags.append("spread")
    shares = [r.tuner_exploring_s / r.wall_seconds for r in runs
              if r.tuner_exploring_s is not None and r.wall_seconds > 0]  # fmt: skip
    tuner = max(shares, default=None)
    if tuner is not None and tuner > MAX_TUNER_SHARE:
        flags.append("tuner")
    return {"flags": flags, "min_requests": least, "spread": spread, "tuner_exploring_share": tuner,
            "lanes": sorted({k for r in runs for k in r.lanes})}  # fmt: skip


def _noise_by_row(results: Sequence[RunResult]) -> dict[tuple[int, str], dict[str, Any]]:
    rows: dict[tuple[int, str], list[RunResult]] = {}
    for r in results:
        rows.setdefault((r.n_clients, r.system), []).append(r)
    return {key: row_noise(runs) for key, runs in rows.items()}


def _replayed(results: Sequence[RunResult]) -> str:
    """The bicodec-shm configuration whose batches the limit replays ("" if no limit ran)."""
    return next((r.replays for r in results if r.system == LIMIT and r.replays), "")


def above_limit_note(n: int, system: str, s: dict[str, Any], noise: dict[str, Any], replayed: str) -> str:
    """Why a ratio to the limit above 1 (``s``: its summary) is not a result."""
    head = f"N={n} {system}: {s['max']:.2f}x the limit (no IPC), above it:"
    lanes = max(noise["lanes"], default=1)
    if lanes > 1:
        return (f"{head} {lanes} lanes decoded at once, which the limit's replay in one "
                "process does not; on a CPU that can be faster, so the limit bounds one lane, "
                "not this row")  # fmt: skip
    if replayed and system != replayed:
        return (f"{head} the limit replays {replayed}'s batches, not this row's, so it is no "
                "bound for this row")  # fmt: skip
    why = [f for f in noise["flags"] if f != "above-limit"]
    cause = (f"of its row's noise ({', '.join(why)})" if why else
             "of the machine's load or the window's edges moving between the two runs "
             "(see others' load)")  # fmt: skip
    return (f"{head} with one lane it decodes the very batches the limit replays, plus the IPC, so "
            f"it cannot be faster: a measurement artefact {cause}")  # fmt: skip


def _mark_ratios(out: dict[int, dict[str, dict[str, dict[str, Any] | None]]],
                 results: Sequence[RunResult]) -> None:  # fmt: skip
    """Give every ratio summary its ``flags``: its rows' noise, its own spread, and
    ``above-limit`` for bicodec-shm above the limit (with its ``note``)."""
    noise = _noise_by_row(results)
    replayed = _replayed(results)
    for n, systems in out.items():
        for system, ratios in systems.items():
            for name, _, ref, _ in RATIOS:
                s = ratios[name]
                if s is None:
                    continue
                s["flags"] = []
                if system == ref:  # 1 by definition
                    continue
                flags = set(noise[(n, system)]["flags"]) | set(noise.get((n, ref), {}).get("flags", ()))
                if s["min"] > 0 and s["max"] / s["min"] > MAX_SPREAD:
                    flags.add("spread")
                if name == "vs_limit" and is_shm(system) and s["max"] > 1.0:
                    flags.add("above-limit")
                    s["note"] = above_limit_note(n, system, s, noise[(n, system)], replayed)
                s["flags"] = [f for f in FLAGS if f in flags]


def is_shm(system: str) -> bool:
    """bicodec-shm, or one of its variants (``bicodec-shm (lanes=2)``)."""
    return system == SHM or system.startswith(f"{SHM} (")


def summarise(values: Iterable[float | None]) -> dict[str, Any] | None:
    """Median, min and max of the values that are not None (None if there are none)."""
    vals = [float(v) for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return None
    return {"median": float(np.median(vals)), "min": min(vals), "max": max(vals), "n": len(vals),
            "values": vals}  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not np.isfinite(a) or not np.isfinite(b) or b == 0:
        return None
    return a / b


def _measured(results: Sequence[RunResult]) -> list[RunResult]:
    """The runs that ran: a skipped system has no numbers (and no wall time). A window in which
    no request completed is measured: 0 audio s/s, flagged ``few``, not hidden."""
    return [r for r in results if r.wall_seconds > 0]


def _order(results: Sequence[RunResult]) -> list[tuple[int, str]]:
    """(N, system) in the order they first ran, the computed systems after the rest of its N."""
    seen: dict[tuple[int, str], None] = {}
    for r in sorted(results, key=lambda r: (r.n_clients, r.system in COMPUTED)):
        seen.setdefault((r.n_clients, r.system), None)
    return list(seen)


Ratios = dict[str, dict[str, float | None]]  # system -> ratio key -> value


def ratios_per_repeat(results: Sequence[RunResult]) -> dict[tuple[int, int], Ratios]:
    """Per (N, repeat) and system: every ratio of ``RATIOS`` within that repeat."""
    by_run: dict[tuple[int, int], dict[str, RunResult]] = {}
    for r in _measured(results):
        by_run.setdefault((r.n_clients, r.repeat), {})[r.system] = r
    out: dict[tuple[int, int], Ratios] = {}
    for key, systems in by_run.items():
        out[key] = {
            s: {name: _ratio(getattr(r, metric), getattr(systems[ref], metric) if ref in systems
                             else None)
                for name, _, ref, metric in RATIOS}
            for s, r in systems.items()
        }  # fmt: skip
    return out


def compare(results: Sequence[RunResult]) -> dict[int, dict[str, dict[str, dict[str, Any] | None]]]:
    """Per N and system: each ratio, computed per repeat, summarised over the repeats."""
    per_repeat = ratios_per_repeat(results)
    out: dict[int, dict[str, dict[str, dict[str, Any] | None]]] = {}
    for n, system in _order(_measured(results)):
        runs = [v[system] for (m, _), v in sorted(per_repeat.items()) if m == n and system in v]
        out.setdefault(n, {})[system] = {name: summarise(run[name] for run in runs)
                                         for name, *_ in RATIOS}  # fmt: skip
    _mark_ratios(out, results)
    return out


def summary(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per (N, system): every metric of ``METRICS`` summarised over the repeats."""
    out = []
    for n, system in _order(results):
        runs = [r for r in results if r.n_clients == n and r.system == system]
        measured = _measured(runs)
        row: dict[str, Any] = {"n_clients": n, "system": system, "runs": len(measured),
                               "note": next((r.note for r in runs if r.note), "")}  # fmt: skip
        for key, *_ in METRICS:
            row[key] = summarise(getattr(r, key) for r in measured)
        row["noise"] = row_noise(measured)
        out.append(row)
    return out


def targets(comparison: dict[int, dict[str, dict[str, dict[str, Any] | None]]], *,
            stand_in: bool, mix: Sequence[Band]) -> list[dict[str, Any]]:  # fmt: skip
    """The targets (config.TARGETS) that apply to this run: this kind of model, this mix, and an N that
    ran. One entry per bicodec-shm variant; ``met`` judges the median (None: not measured)."""
    out = []
    for t in TARGETS:
        if t.stand_in != stand_in or t.n not in comparison:
            continue
        if t.mix is not None and tuple(mix) != parse_mix(t.mix):
            continue
        for system, ratios in comparison[t.n].items():
            if is_shm(system):
                out.append(_judge(t, system, ratios.get(t.key)))
    return out


def _judge(t: Target, system: str, s: dict[str, Any] | None) -> dict[str, Any]:
    measured = None if s is None else s["median"]
    met = None if measured is None else (measured >= t.bound if t.op == ">=" else measured <= t.bound)
    return {"key": t.key, "system": system, "n_clients": t.n, "goal": t.goal, "bound": t.bound,
            "op": t.op, "measured": measured, "min": s and s["min"], "max": s and s["max"],
            "repeats": s and s["n"], "met": met, "noise": list(s.get("flags", ())) if s else []}  # fmt: skip


def format_targets(t: Sequence[dict[str, Any]], *, ran: Sequence[int]) -> str:
    """One line per target that applies; a note instead when none does at the N that ran."""
    if not t:
        where = []
        for x in TARGETS:
            kind = "the stand-in" if x.stand_in else "a real model"
            mix = "" if x.mix is None else ", the default mix" if x.mix == DEFAULT_MIX else f", --mix {x.mix}"
            where.append(f"N={x.n} ({kind}{mix})")
        return (f"targets: none for this run (N={','.join(map(str, ran))}); they are set "
                f"at {'; '.join(dict.fromkeys(where))}")  # fmt: skip
    lines = ["targets (judged on the median over the repeats):"]
    for v in t:
        head = f"N={v['n_clients']} {v['system']}: {v['goal']}:"
        if v["met"] is None:
            lines.append(f"{head} not measured")
            continue
        spread = f" (min {v['min']:.2f}, max {v['max']:.2f})" if v["repeats"] > 1 else ""
        noise = (f", but judged on noise ({', '.join(v['noise'])}): not a result"
                 if v.get("noise") else "")  # fmt: skip
        lines.append(f"{head} {v['measured']:.2f}x{spread}  {'met' if v['met'] else 'NOT MET'}{noise}")
    return "\n".join(lines)


def _fmt(v: float | None, spec: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return none
    return format(v, spec)


def _cell(s: dict[str, Any] | None, spec: str) -> str:
    """``median (min-max)``, or the value alone when the repeats agree or there is one."""
    if s is None:
        return "-"
    med, lo, hi = (format(s[k], spec) for k in ("median", "min", "max"))
    return med if lo == hi else f"{med} ({lo}-{hi})"


def _marks(s: dict[str, Any] | None) -> str:
    """A ratio cell's marks: ``!`` above the limit, ``?`` noise (``_mark_ratios``)."""
    flags = (s or {}).get("flags", ())
    return ("!" if "above-limit" in flags else "") + ("?" if set(flags) - {"above-limit"} else "")


def format_table(results: Sequence[RunResult],
                 comparison: dict[int, dict[str, dict[str, dict[str, Any] | None]]]) -> str:  # fmt: skip
    """Two tables, one row per (N, system): the numbers, then the ratios; each cell is the
    median over the repeats with (min-max) after it. A row whose numbers are noise says so in
    its ``noise`` column, a ratio with ``?`` or ``!``; footnotes say what each means."""
    rows = summary(results)
    flagged = any(row["noise"]["flags"] for row in rows)
    head = ("N", "system", *(h for _, h, _ in METRICS), *(("noise",) if flagged else ()))
    body = []
    for row in rows:
        if not row["runs"]:
            body.append((str(row["n_clients"]), row["system"], row["note"]))
            continue
        noise = (", ".join(row["noise"]["flags"]),) if flagged else ()
        body.append((str(row["n_clients"]), row["system"],
                     *(_cell(row[k], spec) for k, _, spec in METRICS), *noise))  # fmt: skip
    # A column only where some system other than its reference has a value.
    ratio_cols = [(k, h) for k, h, ref, _ in RATIOS
                  if any(c.get(k) for systems in comparison.values()
                         for s, c in systems.items() if s != ref)]  # fmt: skip
    ratio_cells = [(row, [comparison[row["n_clients"]][row["system"]][k] for k, _ in ratio_cols])
                   for row in rows if row["runs"]]  # fmt: skip
    marked = any(_marks(s) for _, cells in ratio_cells for s in cells)
    ratio_head = ("N", "system", *(h for _, h in ratio_cols))
    ratio_body = [(str(row["n_clients"]), row["system"],
                   *(_cell(s, ".2f") + (f" {_marks(s):<2}" if marked else "") for s in cells))
                  for row, cells in ratio_cells]  # fmt: skip
    out = [_grid(head, body, left=2, last_left=flagged)]
    if any(r.window_s for r in results):
        out.append("requests: completed inside the window, counted; cut: completed after it "
                   "closed (in flight at the close), left out")  # fmt: skip
    out += _noise_legend(rows)
    if ratio_cols:
        out += ["", "ratios, computed within each repeat (each system against the reference "
                    "system of the same repeat and N):", _grid(ratio_head, ratio_body, left=2)]  # fmt: skip
        out += _ratio_footnotes(ratio_cells)
    return "\n".join(out)


def _noise_legend(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What each noise flag in the table means, with the thresholds (only the flags shown)."""
    shown = {f for row in rows for f in row["noise"]["flags"]}
    if not shown:
        return []
    lines = ["noise: the numbers of a flagged row are noise, not a result:"]
    for flag, meaning in FLAGS.items():
        if flag not in shown:
            continue
        if flag == "few":
            least = min(r["noise"]["min_requests"] for r in rows if flag in r["noise"]["flags"])
            meaning += f" (fewest here: {least})"
        elif flag == "tuner":
            share = max(r["noise"]["tuner_exploring_share"] for r in rows if flag in r["noise"]["flags"])
            meaning += f" (here up to {share:.0%} of a window)"
        elif flag == "spread":
            spread = max(r["noise"]["spread"] for r in rows if flag in r["noise"]["flags"])
            meaning += f" (here up to {spread:.2f}x)"
        lines.append(f"  {flag}: {meaning}")
    return lines


def _ratio_footnotes(ratio_cells: Sequence[tuple[dict[str, Any], list]]) -> list[str]:
    marks = [s for _, cells in ratio_cells for s in cells if s]
    lines = []
    if any("?" in _marks(s) for s in marks):
        lines.append(f"?  noise, not a result: one of its two rows is flagged (noise column above), or "
                     f"the ratio itself differs by more than {MAX_SPREAD:g}x across the repeats")  # fmt: skip
    lines += [f"!  {s['note']}" for s in marks if "!" in _marks(s)]
    return lines


def _grid(head: tuple[str, ...], rows: list[tuple[str, ...]], *, left: int, last_left: bool = False) -> str:
    """Columns: the first ``left`` left-aligned (and the last with ``last_left``), the rest
    right-aligned; a blank line between groups of rows (a new value in the first column). A
    row shorter than the head ends in a note that spans the remaining columns."""
    widths = [max([len(h)] + [len(r[i]) for r in rows if len(r) == len(head)])
              for i, h in enumerate(head)]  # fmt: skip

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < left or i == len(cells) - 1 < len(head) - 1
                         or (last_left and i == len(head) - 1)
                         else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(head), "  ".join("-" * w for w in widths)]
    for k, r in enumerate(rows):
        if k and r[0] != rows[k - 1][0]:
            out.append("")
        out.append(line(r))
    return "\n".join(out)


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
            "cpu_per_audio_s": med("cpu_per_audio_s"),
        })  # fmt: skip
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
