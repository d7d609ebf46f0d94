"""``bicodec-shm``: serve | stats | demo | bench | soak | cleanup.

``main(argv=None) -> int`` is the console script; tests call it in-process.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from .batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_WAIT_MS
from .errors import BiCodecShmError
from .transport import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SLOTS,
    header_server_alive,
    leftover_objects,
    read_header,
    stats_from_header,
    unlink_all,
    validate_name,
)

DEFAULT_NAME = "bicodec-shm"
PRESETS = ("spark-tts-0.5b", "tiny")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (BiCodecShmError, ValueError) as exc:
        print(f"bicodec-shm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bicodec-shm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(metavar="COMMAND")

    s = sub.add_parser("serve", help="run the decoder server (owns the model and the segment)")
    _add_model_args(s)
    s.add_argument("--name", default=DEFAULT_NAME, help="segment name clients attach to")
    _add_server_args(s)
    s.add_argument("--mode", default="0o600", type=_octal,
                   help="permissions: 0o600 this user only, 0o660 also the group")  # fmt: skip
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(func=_cmd_serve)

    st = sub.add_parser("stats", help="print a server's live counters")
    st.add_argument("name", nargs="?", default=DEFAULT_NAME)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 1) until interrupted")  # fmt: skip
    st.set_defaults(func=_cmd_stats)

    d = sub.add_parser("demo", help="a server and N client processes, checked against local decodes")
    _add_model_args(d)
    _add_server_args(d)
    d.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    d.add_argument("--requests", type=int, default=4, help="requests per client (default 4)")
    d.add_argument("--min-len", type=int, default=25, help="shortest request in tokens")
    d.add_argument("--max-len", type=int, default=75, help="longest request in tokens")
    d.add_argument("--check", type=int, default=4, help="results to verify locally (default 4)")
    d.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    d.set_defaults(func=_cmd_demo)

    so = sub.add_parser("soak", help="server + clients for a while with random kills; checks every result")
    from .soak import add_arguments as add_soak_arguments

    add_soak_arguments(so)
    so.set_defaults(func=_cmd_soak)

    b = sub.add_parser("bench", help="throughput: shared server vs a decoder per process vs a Queue server")
    from .bench import add_arguments as add_bench_arguments

    add_bench_arguments(b)
    b.set_defaults(func=_cmd_bench)

    c = sub.add_parser("cleanup", help="unlink the objects of a name whose server is dead")
    c.add_argument("name", nargs="?", default=DEFAULT_NAME)
    c.set_defaults(func=_cmd_cleanup)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None,
                   help="a Spark-TTS model folder or its BiCodec/ folder")  # fmt: skip
    p.add_argument("--preset", default="spark-tts-0.5b", choices=PRESETS,
                   help="architecture with random weights when no --model-dir is given")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype; norms, Snake and audio stay float32 (default float32)")  # fmt: skip
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                   help="replay CUDA graphs captured over (batch, length) buckets (default off)")  # fmt: skip
    p.add_argument("--graph-memory-gib", type=float, default=8.0, metavar="GIB",
                   help="most GPU memory the CUDA graphs may take (default 8)")  # fmt: skip


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help="request slots in all")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    p.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS)
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                   help="padded-token budget per batch (rows x longest)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="longest request accepted, in tokens (1500 = 30 s)")  # fmt: skip


def _octal(text: str) -> int:
    try:
        mode = int(text, 8) if not text.startswith("0o") else int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r}") from None
    if mode & ~0o777:
        raise argparse.ArgumentTypeError(f"mode {text} has bits outside 0o777")
    return mode


def load_decoder(args: argparse.Namespace, *, announce: bool = True):  # -> BiCodecDecoder
    """Build the decoder the command line asks for (imports torch); a ``GraphedDecoder`` with
    ``--cuda-graphs``. A device this torch cannot use is a one-line ``ValueError``."""
    import torch

    from .model import BiCodecDecoder
    from .model.devices import resolve_device
    from .model.graphs import GraphedDecoder

    device = resolve_device(args.device)
    dtype = getattr(args, "dtype", "float32")
    graphs = getattr(args, "cuda_graphs", False)
    if graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA --device, got {args.device!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_dir:
        decoder = BiCodecDecoder.from_pretrained(args.model_dir, device=device, dtype=dtype)
    else:
        if announce:
            print(
                f"bicodec-shm: no --model-dir given: serving the {args.preset} architecture with "
                f"RANDOM weights (seed {args.seed}); the audio is noise",
                file=sys.stderr,
            )
        decoder = BiCodecDecoder.from_config(args.preset, seed=args.seed, dtype=dtype).to(device)
    if graphs:
        decoder = GraphedDecoder(decoder, memory_gib=args.graph_memory_gib, mode="graphs")
    return decoder


def _cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    validate_name(args.name)
    from .server import DecoderServer

    decoder = load_decoder(args)
    server = DecoderServer(
        decoder,
        args.name,
        slots=args.slots,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_batch_tokens=args.max_batch_tokens,
        max_tokens=args.max_tokens,
        mode=args.mode,
    )
    print(f"bicodec-shm: serving on {args.name!r} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    while True:
        header = read_header(args.name)
        if header is None:
            raise BiCodecShmError(f"no bicodec-shm segment named {args.name!r} in /dev/shm")
        stats = stats_from_header(header)
        stats["server_alive"] = header_server_alive(header)
        if args.json:
            print(json.dumps(stats, indent=None if args.watch else 2), flush=True)
        else:
            print(format_stats(args.name, stats), flush=True)
        if args.watch is None:
            return 0
        time.sleep(args.watch)


def format_stats(name: str, stats: dict) -> str:
    """A two-column table of ``stats_from_header`` output."""
    rows = [
        ("segment", name),
        ("server pid", f"{stats['server_pid']} ({'alive' if stats.get('server_alive') else 'dead'})"),
        ("slots / max tokens", f"{stats['slots']} / {stats['max_tokens']}"),
        ("requests", stats["requests"]),
        ("failed", stats["failed"]),
        ("batches", stats["batches"]),
        ("avg batch size", f"{stats['avg_batch_size']:.2f}"),
        ("avg batch time", f"{stats['avg_batch_time_ms']:.2f} ms"),
        ("avg queue wait", f"{stats['avg_queue_wait_ms']:.2f} ms"),
        ("tokens (padded)", f"{stats['tokens']} ({stats['padded_tokens']})"),
        ("reclaimed slots", stats["reclaimed"]),
        ("batch sizes", " ".join(f"{b}:{n}" for b, n in stats["batch_size_histogram"].items()) or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _cmd_cleanup(args: argparse.Namespace) -> int:
    header = read_header(args.name)
    if header is not None and header_server_alive(header):
        raise BiCodecShmError(
            f"the server of {args.name!r} (pid {int(header['server_pid'])}) is alive; stop it instead"
        )
    removed = unlink_all(args.name)
    left = leftover_objects(args.name)
    print(f"removed {removed} object(s) of {args.name!r}" + (f"; still there: {left}" if left else ""))
    return 0 if not left else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_and_report

    return run_and_report(args)


def _cmd_soak(args: argparse.Namespace) -> int:
    from .soak import run_and_report

    return run_and_report(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)
