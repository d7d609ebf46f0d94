"""The options of ``bicodec-shm bench`` that name server keywords, bicodec-shm variants and
stand-in costs: parsed and checked before anything starts (cli.py defines the rest)."""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
from collections.abc import Sequence
from typing import Any

from .config import RESERVED_SERVER_ARGS, SHM, ShmVariant
from .standin import STAND_IN_PRESETS


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _stand_in_costs(text: str) -> tuple[float, float, bool]:
    """``--stand-in``: a preset name (standin.py) or ``A_MS,B_MS[,async]`` (synchronous unless
    ``async``: an asynchronous device, as the modern preset) -> (a, b, async)."""
    preset = STAND_IN_PRESETS.get(text.strip())
    if preset is not None:
        return preset.a_ms, preset.b_ms, preset.asynchronous
    parts = [p.strip() for p in text.split(",")]
    asynchronous = len(parts) == 3 and parts[2] == "async"
    try:
        costs = _floats(",".join(parts[:2] if asynchronous else parts))
    except argparse.ArgumentTypeError:
        costs = []
    if len(costs) != 2 or min(costs) < 0:
        raise argparse.ArgumentTypeError(
            f"expected a preset ({', '.join(STAND_IN_PRESETS)}) or A_MS,B_MS[,async], two numbers "
            f">= 0, got {text!r}")  # fmt: skip
    return costs[0], costs[1], asynchronous


def parse_server_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value): VALUE as a Python literal (2, 1.5, None, True, "x"), or
    else as the string itself."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. lanes=2, got {text!r}")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return key, value


def check_server_options(options: dict[str, Any]) -> None:
    """Raise ValueError unless this ``DecoderServer`` accepts every keyword in ``options``
    (imports the server, hence torch, so only called when there are options)."""
    bad = sorted(set(options) & set(RESERVED_SERVER_ARGS))
    if bad:
        raise ValueError(f"--server-arg {', '.join(bad)}: set by the benchmark; use --max-batch, "
                         "--max-wait-ms, --max-batch-tokens (they drive the queue server too)")  # fmt: skip
    if not options:
        return
    from ...server.server import DecoderServer

    params = inspect.signature(DecoderServer.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"this DecoderServer does not accept {', '.join(f'{k}=' for k in unknown)}; "
                         f"its keyword arguments are {', '.join(accepted)}")  # fmt: skip


def _lane_counts(text: str) -> tuple[int | None, ...]:
    """``--lanes``: "1,2,auto" -> (1, 2, None); None is the server's own choice."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "auto":
            out.append(None)
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected lane counts or 'auto', got {text!r}") from None
    return tuple(out)


def _policy_names(allowed: Sequence[str]):
    """``--dispatch`` / ``--batching``: "a,b" -> ("a", "b"), each one of ``allowed``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if n not in allowed]
        if bad or not names or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(
                f"expected distinct values of {', '.join(allowed)}, got {text!r}")  # fmt: skip
        return names

    return parse


def shm_variants(server_args: Sequence[tuple[str, Any]], lanes: Sequence[int | None] | None,
                 dispatch: Sequence[str] | None = None,
                 batching: Sequence[str] | None = None) -> tuple[ShmVariant, ...]:  # fmt: skip
    """The bicodec-shm configurations to run: one per combination of the ``--lanes``,
    ``--dispatch`` and ``--batching`` values given, or just one."""
    options = dict(server_args)
    axes: list[list[tuple[str, str, Any]]] = []  # per axis: (label part, keyword, value or None)
    if lanes is not None:
        if "lanes" in options:
            raise ValueError("give lanes either as --lanes or as --server-arg lanes=K, not both")
        fixed = [k for k in lanes if k is not None]
        if not lanes or (fixed and min(fixed) < 1) or len(set(lanes)) != len(lanes):
            raise ValueError(f"--lanes needs distinct values >= 1 or auto, got "
                             f"{','.join('auto' if k is None else str(k) for k in lanes)}")  # fmt: skip
        axes.append([(f"lanes={'auto' if k is None else k}", "lanes", k) for k in lanes])
    for key, values in (("dispatch", dispatch), ("batching", batching)):
        if values is not None:
            if key in options:
                raise ValueError(f"give {key} either as --{key} or as --server-arg {key}=..., not both")
            axes.append([(f"{key}={v}", key, v) for v in values])
    if not axes:
        return (ShmVariant(SHM, options),)
    out = []
    for combo in itertools.product(*axes):
        extra = {key: value for _, key, value in combo if value is not None}
        out.append(ShmVariant(f"{SHM} ({', '.join(part for part, _, _ in combo)})", {**options, **extra}))
    return tuple(out)
