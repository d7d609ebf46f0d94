"""A device's batch cost, fitted from ``bench_model.py``'s grid: fixed + per padded token, per
dtype, with and without CUDA graphs; and the stand-in that plays it.

The stand-in (``bicodec-shm bench --stand-in A,B,async``) costs ``a + b x rows x longest`` ms a
batch. This script fits ``a`` and ``b`` to every (dtype, graphs) of one or more bench_model JSON
files by least squares on relative error (a batch of 1 x 25 tokens counts as much as one of
32 x 300), and says how well the line holds (the largest relative error over the grid). So the
first GPU run tells whether the stand-in's conclusions (dispatch policy, batching) carry over:
``benchmarks/device_check.sh`` runs the stand-in bench with the fitted costs next to the real
decoder's.

    python benchmarks/fit_batch_costs.py benchmarks/out/bench_model_*.json [--json OUT]
        [--stand-in-for float32:off]       # which fit the printed stand-in flag plays
    python benchmarks/fit_batch_costs.py --print-stand-in OUT.json   # just "A,B,async"

Rows of a graphs run that had no graph for their shape (``eager*`` in bench_model's table) are
left out of the graphs fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def fit_line(padded: np.ndarray, ms: np.ndarray) -> tuple[float, float, float]:
    """(a ms, b ms per padded token, largest relative error) of ``ms ~ a + b x padded``, by
    least squares on relative error; a and b clipped at 0 (refit without the clipped one)."""
    padded, ms = np.asarray(padded, np.float64), np.asarray(ms, np.float64)
    design = np.stack([np.ones_like(padded), padded], axis=1) / ms[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(ms), rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(padded / ms) / np.sum((padded / ms) ** 2))
    elif b < 0:
        a, b = float(np.sum(1 / ms) / np.sum(1 / ms**2)), 0.0
    err = float(np.max(np.abs((a + b * padded) / ms - 1))) if len(ms) else float("nan")
    return float(a), float(b), err


def fits(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One fit per (dtype, graphs) of bench_model result rows."""
    groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in results:
        if r["graphs"] and not r.get("graphed", True):
            continue  # no graph for this shape: an eager decode inside a graphs run
        groups.setdefault((r["dtype"], bool(r["graphs"])), []).append(r)
    out = []
    for (dtype, graphs), rows in sorted(groups.items()):
        if len(rows) < 2:
            continue
        padded = np.array([r["batch"] * r["tokens"] for r in rows], np.float64)
        ms = np.array([r["ms_batch"] for r in rows], np.float64)
        a, b, err = fit_line(padded, ms)
        out.append({"dtype": dtype, "graphs": graphs, "a_ms": a, "b_ms": b, "points": len(rows),
                    "max_rel_err": err, "batches": sorted({r["batch"] for r in rows}),
                    "lengths": sorted({r["tokens"] for r in rows})})  # fmt: skip
    return out


def stand_in_flag(fit: dict[str, Any]) -> str:
    """``--stand-in`` for a fit: an asynchronous device of its costs."""
    return f"{fit['a_ms']:.4g},{fit['b_ms']:.4g},async"


def format_fits(rows: list[dict[str, Any]], device: str = "") -> str:
    head = f"{'dtype':>8} {'graphs':>6} {'a ms':>9} {'b us/token':>11} {'points':>6} {'max err':>8}  stand-in"
    lines = [f"batch cost fitted from bench_model's grid{f' on {device}' if device else ''}: "
             "ms = a + b x rows x longest", head, "-" * len(head)]  # fmt: skip
    for f in rows:
        lines.append(f"{f['dtype']:>8} {'on' if f['graphs'] else 'off':>6} {f['a_ms']:>9.3f} "
                     f"{f['b_ms'] * 1e3:>11.3f} {f['points']:>6} {f['max_rel_err']:>7.0%}  "
                     f"--stand-in {stand_in_flag(f)}")  # fmt: skip
    return "\n".join(lines)


def choose(rows: list[dict[str, Any]], want: str) -> dict[str, Any] | None:
    """The fit named ``DTYPE:on|off``, else the first of that dtype, else the first."""
    dtype, _, graphs = want.partition(":")
    for f in rows:
        if f["dtype"] == dtype and (not graphs or f["graphs"] == (graphs == "on")):
            return f
    return rows[0] if rows else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="*", type=Path, help="bench_model.py JSON files")
    p.add_argument("--json", type=Path, default=None, help="write the fits here")
    p.add_argument("--stand-in-for", default="float32:off", metavar="DTYPE:on|off",
                   help="the fit whose stand-in flag is printed last (default float32:off, the "
                        "server's default: float32, no graphs)")  # fmt: skip
    p.add_argument("--print-stand-in", type=Path, default=None, metavar="FITS_JSON",
                   help="print the chosen stand-in flag of a fits JSON and exit")
    args = p.parse_args(argv)
    if args.print_stand_in is not None:
        try:
            flag = json.loads(args.print_stand_in.read_text()).get("stand_in")
        except (OSError, ValueError) as exc:
            print(f"no fits in {args.print_stand_in}: {exc}", file=sys.stderr)
            return 1
        if not flag:
            print(f"no stand-in in {args.print_stand_in}", file=sys.stderr)
            return 1
        print(flag)
        return 0
    results, device = [], ""
    for path in args.inputs:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
            continue
        results += data.get("results", [])
        device = device or data.get("meta", {}).get("device_name", "")
    rows = fits(results)
    if not rows:
        print("no bench_model rows to fit (give the JSON of a bench_model.py run)", file=sys.stderr)
        return 1
    print(format_fits(rows, device))
    chosen = choose(rows, args.stand_in_for)
    flag = stand_in_flag(chosen)
    print(f"stand-in for {chosen['dtype']}, graphs {'on' if chosen['graphs'] else 'off'}: --stand-in {flag}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "fits": rows, "stand_in": flag,
                                         "stand_in_for": args.stand_in_for}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
