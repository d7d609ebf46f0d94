"""``bicodec-shm``: serve | stats | decode | demo | bench | soak | cleanup.

``main(argv=None) -> int`` is the console script; tests call it in-process.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import io
import json
import logging
import os
import re
import signal
import sys
import time
import wave
from collections.abc import Sequence

from .batching import (
    DEFAULT_CUDA_MAX_BATCH_TOKENS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_WAIT_MS,
    DEFAULT_MIN_FILL,
    DEFAULT_REJOIN_MS,
)
from .codecs.layout import MAX_FRAMES, default_max_frames, get_layout
from .errors import BiCodecShmError, ServerAlreadyRunningError
from .group import GroupInfo, group_stats, read_group, validate_group_name
from .processes import StartupSignals, sigint_ignored
from .served import describe_served
from .transport import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SLOTS,
    DEFAULT_START_WAIT,
    MAGIC,
    MAX_SLOTS,
    Layout,
    Phase,
    ServerState,
    check_free_space,
    leftover_objects,
    probe,
    read_header,
    release_name,
    remove_dead,
    reserve_name,
    stats_from_header,
    validate_name,
)
from .validation import as_utterance

DEFAULT_NAME = "bicodec-shm"
SAMPLE_RATE = 16_000
TOKENS_PER_SECOND = 50  # semantic tokens per second of 16 kHz audio (hop 320)
_sleep = time.sleep  # `stats --watch` between samples; tests replace it to drive the intervals
PRESETS = ("spark-tts-0.5b", "tiny")
# Codecs `serve --codec` knows; each SNAC variant has a full-size and a tiny preset.
CODECS = ("bicodec", "snac-24khz", "snac-32khz", "snac-44khz")
SNAC_PRESETS = tuple(f"{size}-{rate}" for rate in ("24khz", "32khz", "44khz") for size in ("snac", "tiny"))
# transport.Segment.create refuses a longer --max-tokens; serve checks it before loading a model.
MAX_TOKENS_LIMIT = MAX_FRAMES
# How long `serve` waits for a live server under its name to stop before refusing (a rolling
# restart: SIGTERM to the old server, which finishes its running batch, and a new `serve` at once).
NAME_GRACE = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a server group's members reuse it
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
    except BrokenPipeError:
        # The reader went away (`stats --watch | head`). The recipe of Python's signal docs:
        # point stdout at /dev/null so that the flush at exit does not raise a second time.
        _silence_stdout()
        return 1


def _silence_stdout() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return  # not a real file (captured in a test): nothing is flushed to a pipe at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bicodec-shm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(metavar="COMMAND")

    s = sub.add_parser("serve", help="run the decoder server (owns the model and the segment)")
    _add_model_args(s)
    s.add_argument("--codec", default="bicodec", choices=CODECS,
                   help="the codec served (default bicodec); snac-24khz is Orpheus TTS's")  # fmt: skip
    s.add_argument("--name", default=DEFAULT_NAME,
                   help=f"segment name clients attach to (default {DEFAULT_NAME})")  # fmt: skip
    _add_server_args(s)
    s.add_argument("--mode", default="0o600", type=_octal,
                   help="permissions: 0o600 this user only, 0o660 also the group")  # fmt: skip
    s.add_argument("--allow-world-access", action="store_true",
                   help="accept a --mode that lets every user of the host attach (not advised)")  # fmt: skip
    s.add_argument("-v", "--verbose", action="store_true")
    s.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on PORT (needs: pip install 'bicodec-shm[metrics]')")
    s.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics endpoint")
    s.set_defaults(func=_cmd_serve, max_tokens=None)  # None: 30 s of the codec's audio

    st = sub.add_parser("stats", help="print a server's live counters")
    st.add_argument("name", nargs="?", default=DEFAULT_NAME)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 1) until interrupted")  # fmt: skip
    st.set_defaults(func=_cmd_stats)

    de = sub.add_parser("decode", help="decode token ids from files into a WAV through a running server")
    de.add_argument("--name", default=DEFAULT_NAME, help=f"the server's name (default {DEFAULT_NAME})")
    de.add_argument("--semantic", required=True, metavar="FILE",
                    help="semantic ids in [0, 8192): .npy, or ints split by spaces/commas")  # fmt: skip
    de.add_argument("--global", dest="global_", required=True, metavar="FILE",
                    help="the 32 global ids in [0, 4096), same formats")  # fmt: skip
    de.add_argument("-o", "--output", required=True, metavar="WAV",
                    help="the 16 kHz mono int16 WAV to write ('-': standard output)")  # fmt: skip
    de.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the audio (default 30)")
    de.set_defaults(func=_cmd_decode)

    d = sub.add_parser("demo", help="a server and N client processes, checked against local decodes")
    _add_model_args(d)
    _add_server_args(d)
    d.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    d.add_argument("--requests", type=int, default=4, help="requests per client (default 4)")
    d.add_argument("--min-len", type=int, default=25, help="shortest request in tokens")
    d.add_argument("--max-len", type=int, default=75, help="longest request in tokens")
    d.add_argument("--check", type=int, default=4, help="results to verify locally (default 4)")
    d.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    d.set_defaults(func=_cmd_demo, preset="spark-tts-0.5b")

    from .soak import HELP_FORMATTER as SOAK_HELP_FORMATTER
    from .soak import add_arguments as add_soak_arguments

    so = sub.add_parser("soak", help="server + clients for a while with random kills; checks every result",
                        formatter_class=SOAK_HELP_FORMATTER)  # fmt: skip

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
                   help="a Spark-TTS model folder or its BiCodec/ folder; for SNAC a folder with "
                        "config.json and pytorch_model.bin (hubertsiuzdak/snac_24khz)")  # fmt: skip
    p.add_argument("--preset", default=None, choices=PRESETS + SNAC_PRESETS,
                   help="architecture with random weights when no --model-dir is given (default: "
                        "the codec's full size; tiny: a small one of the same token layout)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--device", default="cpu",
                   help="torch device, e.g. cuda:0; for serve, several separated by commas "
                        "(cuda:0,cuda:1) run one server per device as a group")  # fmt: skip
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
    p.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                   help="how long a batch may wait to grow once a lane is free (default 0)")
    p.add_argument("--rejoin-ms", type=float, default=DEFAULT_REJOIN_MS,
                   help="how long a free lane waits for the clients it just answered to send "
                        f"again; stops once they have (default {DEFAULT_REJOIN_MS})")  # fmt: skip
    p.add_argument("--max-batch-tokens", type=_batch_tokens, default="auto",
                   help=f"padded-token budget per batch (rows x longest), or none; default "
                        f"{DEFAULT_MAX_BATCH_TOKENS} on CPU, "
                        f"{DEFAULT_CUDA_MAX_BATCH_TOKENS} on CUDA")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="longest request accepted, in frames (BiCodec: tokens); default 30 s of "
                        "audio (BiCodec 1500, SNAC 24 kHz 352)")  # fmt: skip
    p.add_argument("--min-fill", type=float, default=DEFAULT_MIN_FILL,
                   help="a row joins a batch only if its shortest row stays >= this share of its "
                        f"longest (default {DEFAULT_MIN_FILL})")  # fmt: skip
    p.add_argument("--lanes", type=int, default=None,
                   help="decode lanes sharing the weights (default: 1 on CUDA; on a CPU, chosen while "
                        "serving among 1, 2 and 4 by measuring each on the live traffic, every "
                        "choice logged); a number fixes it")  # fmt: skip


def _batch_tokens(text: str) -> int | str | None:
    """``--max-batch-tokens``: a positive integer, "none" (no budget) or "auto" (by device)."""
    if text.lower() in ("auto", "none"):  # "None" too: str(None) from a caller's namespace
        return None if text.lower() == "none" else "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count, 'none' or 'auto': {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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

    from .model.buckets import BucketGrid
    from .model.devices import resolve_device
    from .model.graphs import GraphedDecoder
    from .model.registry import decoder_class

    device = resolve_device(args.device)
    dtype = getattr(args, "dtype", "float32")
    graphs = getattr(args, "cuda_graphs", False)
    if graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA --device, got {args.device!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    codec = getattr(args, "codec", "bicodec")
    preset = resolve_preset(codec, args.preset)
    if graphs and codec != "bicodec":
        raise ValueError(f"--cuda-graphs replays BiCodec only; serve {codec} without it")
    model = decoder_class(codec)
    if args.model_dir:
        decoder = model.from_pretrained(args.model_dir, device=device, dtype=dtype)
        loaded = getattr(decoder.config, "codec_name", "bicodec")
        if loaded != codec:
            raise ValueError(f"--model-dir {args.model_dir} holds a {loaded} model, but --codec is {codec}")
    else:
        if announce:
            print(
                f"bicodec-shm: no --model-dir given: serving the {preset} architecture with "
                f"RANDOM weights (seed {args.seed}); the audio is noise",
                file=sys.stderr,
            )
        decoder = model.from_config(preset, seed=args.seed, dtype=dtype).to(device)
    if graphs:
        # Buckets up to the batches this server forms: with max_batch 16 and the CUDA token
        # budget (batching.py), 16 x 50 and 8 x 300 are buckets, so they replay unpadded.
        grid = BucketGrid.for_max_batch(getattr(args, "max_batch", DEFAULT_MAX_BATCH))
        decoder = GraphedDecoder(decoder, grid=grid, memory_gib=args.graph_memory_gib, mode="graphs")
    return decoder


def resolve_preset(codec: str, preset: str | None) -> str:
    """The model preset of ``--codec`` and ``--preset``: None is the codec's full size, "tiny"
    its tiny one (tiny-24khz for snac-24khz); a preset of another codec is refused."""
    if codec == "bicodec":
        if preset in SNAC_PRESETS:
            raise ValueError(f"--preset {preset} is a SNAC model; add --codec snac-{preset.split('-')[1]}")
        return preset or "spark-tts-0.5b"
    rate = codec.split("-")[1]
    if preset is None or preset == codec:
        return codec
    if preset in ("tiny", f"tiny-{rate}"):
        return f"tiny-{rate}"
    raise ValueError(f"--preset {preset} is not a {codec} model; use tiny, tiny-{rate} or {codec}")


def _check_mode(mode: int, *, allow_world: bool) -> None:
    """Refuse world access to the segment unless it is asked for explicitly (then warn)."""
    if not mode & 0o007:
        return
    what = (f"--mode {mode:#o} lets every user of this host attach: any local process could "
            "submit requests and read the audio of other clients")  # fmt: skip
    if not allow_world:
        raise ValueError(f"{what}; use 0o600 (this user) or 0o660 (this group), or add "
                         "--allow-world-access if you really mean it")  # fmt: skip
    print(f"bicodec-shm: warning: {what} (--allow-world-access)", file=sys.stderr)


def _cmd_serve(args: argparse.Namespace) -> int:
    # Everything that can refuse is checked here, before a model that takes seconds to load.
    _check_mode(args.mode, allow_world=args.allow_world_access)
    group = "," in args.device
    (validate_group_name if group else validate_name)(args.name)
    resolve_preset(args.codec, args.preset)
    if args.max_tokens is None:
        args.max_tokens = default_max_frames(args.codec)
    codec = get_layout(args.codec)
    check_server_args(args)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if group:  # one server per device, named NAME.K, under a supervisor
        from .supervisor import parse_devices, serve_group

        devices = parse_devices(args.device)
        check_free_space(len(devices) * Layout(args.slots, args.max_tokens, codec).total_size)
        wait_for_name(args.name)
        return serve_group(args.name, devices, args.argv, mode=args.mode,
                           metrics_port=args.metrics_port)  # fmt: skip
    if args.metrics_port is not None:
        from .metrics import require_prometheus_client

        require_prometheus_client()
    check_free_space(Layout(args.slots, args.max_tokens, codec).total_size)
    wait_for_name(args.name)
    # `kill -USR1 PID` prints where every thread of the server is (a server that will not stop).
    dumps = _register_stack_dumps()
    try:
        return _serve_one(args)
    finally:
        if dumps:
            faulthandler.unregister(signal.SIGUSR1)


def _register_stack_dumps() -> bool:
    """SIGUSR1 prints every thread's stack to stderr; False where stderr has no descriptor."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return True
        except (AttributeError, ValueError, OSError, RuntimeError):
            continue
    return False


def _serve_one(args: argparse.Namespace) -> int:
    # From owning the name on, SIGINT and SIGTERM stop the start-up cleanly (processes.py).
    with StartupSignals() as startup:
        # Own the name before the model loads: while it loads the name reads as "starting", so
        # the clients of a server that just stopped (a rolling restart) wait for this one.
        reserved = reserve_name(args.name, mode=args.mode, wait=DEFAULT_START_WAIT)
        try:
            from .server import DecoderServer

            decoder = load_decoder(args)
        except BaseException:
            release_name(reserved, args.name)
            raise
        startup.deferred()  # the server below owns `reserved`, and must reach hand_to
        server = DecoderServer(
            decoder,
            args.name,
            slots=args.slots,
            max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms,
            rejoin_ms=args.rejoin_ms,
            max_batch_tokens=args.max_batch_tokens,
            min_fill=args.min_fill,
            lanes=args.lanes,
            max_tokens=args.max_tokens,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            mode=args.mode,
            reserved=reserved,
        )
        startup.hand_to(server)
        how = ("SIGINT is ignored here, as in a background job: stop it with SIGTERM"
               if sigint_ignored() else "Ctrl-C to stop")  # fmt: skip
        print(f"bicodec-shm: serving on {args.name!r} ({how})", file=sys.stderr, flush=True)
        server.serve_forever()
    return 0


def check_server_args(args: argparse.Namespace) -> None:
    """The limits ``DecoderServer`` and ``Segment.create`` check, as one-line errors naming the
    option, before anything is loaded (the same bounds, so neither refuses later)."""
    checks = [
        (1 <= args.slots <= MAX_SLOTS, f"--slots must be in 1..{MAX_SLOTS}, got {args.slots}"),
        (1 <= args.max_tokens <= MAX_TOKENS_LIMIT,
         f"--max-tokens must be in 1..{MAX_TOKENS_LIMIT}, got {args.max_tokens}"),
        (args.max_batch >= 1, f"--max-batch must be >= 1, got {args.max_batch}"),
        (args.max_wait_ms >= 0, f"--max-wait-ms must be >= 0, got {args.max_wait_ms}"),
        (args.rejoin_ms >= 0, f"--rejoin-ms must be >= 0, got {args.rejoin_ms}"),
        (not isinstance(args.max_batch_tokens, int) or args.max_batch_tokens >= 1,
         f"--max-batch-tokens must be >= 1, got {args.max_batch_tokens}"),
        (0.0 <= args.min_fill <= 1.0, f"--min-fill must be in [0, 1], got {args.min_fill}"),
        (args.lanes is None or 1 <= args.lanes <= 64, f"--lanes must be in 1..64, got {args.lanes}"),
        (args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def wait_for_name(name: str, grace: float | None = None) -> None:
    """Refuse, before the model loads, a name that a live server (or group) serves.

    A server that is stopping still serves until its running batches end, and a rolling restart
    starts the new ``serve`` at once: so a served name gets ``grace`` seconds (``NAME_GRACE``)
    to be let go of first, with a line saying so. A name that is starting or stopping without
    serving (BUSY) is left to ``Segment.create``, which waits for it."""
    grace = NAME_GRACE if grace is None else grace
    deadline = time.monotonic() + grace
    said = False
    while probe(name) is ServerState.SERVING and not _stopping(name):
        if time.monotonic() >= deadline:
            raise ServerAlreadyRunningError(
                f"{name!r} is already being served{_pid_clause(name)}: stop that server first "
                "(Ctrl-C in its terminal, or SIGTERM) or choose another --name"
            )
        if not said and grace > 0:
            print(f"bicodec-shm: {name!r} is being served{_pid_clause(name)}; waiting up to "
                  f"{grace:g} s for it to stop (a rolling restart) before refusing",
                  file=sys.stderr, flush=True)  # fmt: skip
            said = True
        time.sleep(0.05)


def _stopping(name: str) -> bool:
    """True if the server of ``name`` has marked its header as stopping (it will let go)."""
    header = read_header(name)
    return (header is not None and int(header["magic"]) == MAGIC
            and int(header["phase"]) in (Phase.STOPPING, Phase.STOPPED))  # fmt: skip


def _pid_clause(name: str) -> str:
    """" (server pid N)" or " (a server group, supervisor pid N)", as far as it can be read."""
    try:
        info = read_group(name)
        if info is not None:
            return f" (a server group, supervisor pid {info.supervisor_pid})"
        header = read_header(name)
    except (BiCodecShmError, ValueError, OSError):
        return ""
    if header is None or int(header["magic"]) != MAGIC:
        return ""
    return f" (server pid {int(header['server_pid'])})"


def _cmd_stats(args: argparse.Namespace) -> int:
    if args.watch is not None and args.watch <= 0:
        raise ValueError(f"--watch must be > 0 seconds, got {args.watch}")
    info = read_group(args.name)
    if info is not None:
        return _group_stats(args, info)
    header = read_header(args.name)
    if header is None:
        raise BiCodecShmError(f"no bicodec-shm segment named {args.name!r} in /dev/shm; "
                              f"{describe_served(exclude=args.name)}")  # fmt: skip
    stats = _stats(args.name, header)
    if args.watch is None:
        print(json.dumps(stats, indent=2) if args.json else format_stats(args.name, stats))
        return 0
    return _watch(args, stats)


def _stats(name: str, header) -> dict:
    stats = stats_from_header(header)
    stats["server_alive"] = probe(name) is ServerState.SERVING
    return stats


def _watch(args: argparse.Namespace, stats: dict) -> int:
    """One line per interval: a timestamp and the rates within that interval (like vmstat)."""
    if not args.json:
        print(format_stats(args.name, stats))
        print(WATCH_COLUMNS, flush=True)
    before, t_before = stats, time.monotonic()
    while True:
        _sleep(args.watch)
        header, now = read_header(args.name), time.monotonic()
        stamp = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        if header is None:
            line = {"time": stamp, "segment": None}
            print(json.dumps(line) if args.json else f"{stamp}  no segment named {args.name!r} (stopped?)",
                  flush=True)  # fmt: skip
            continue
        stats = _stats(args.name, header)
        if stats["server_epoch"] != before["server_epoch"]:  # a new server: counters restart at 0
            before = _ZERO
            if not args.json:
                print(f"{stamp}  new server (pid {stats['server_pid']}); rates from its start", flush=True)
        rates = interval_rates(before, stats, now - t_before)
        if args.json:
            print(json.dumps({"time": stamp, "interval": rates, "totals": stats}), flush=True)
        else:
            print(format_watch_line(stamp, rates, stats), flush=True)
        before, t_before = stats, now


_ZERO = {k: 0 for k in ("requests", "batches", "tokens", "failed", "completed")} | {
    "batch_size_histogram": {}, "avg_queue_wait_ms": 0.0}  # fmt: skip


def _group_stats(args: argparse.Namespace, info: GroupInfo) -> int:
    """``stats N`` of a server group: the members side by side, or with ``--watch`` one line
    per member and interval."""
    stats = group_stats(info)
    # The group object stays "alive" while its supervisor runs, even with every member down.
    stats["members_serving"] = sum(bool(st.get("server_alive")) for st in stats["members"].values())
    stats["serving"] = bool(stats["supervisor_alive"] and stats["members_serving"])
    if args.watch is None:
        print(json.dumps(stats, indent=2) if args.json else format_group_stats(stats))
        return 0
    if not args.json:
        print(format_group_stats(stats))
        print(f"{WATCH_COLUMNS}  member", flush=True)
    before, t_before = stats["members"], time.monotonic()
    while True:
        _sleep(args.watch)
        info, now = read_group(args.name), time.monotonic()
        stamp = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        if info is None:
            print(json.dumps({"time": stamp, "group": None}) if args.json
                  else f"{stamp}  no group named {args.name!r} (stopped?)", flush=True)  # fmt: skip
            continue
        members = group_stats(info)["members"]
        for member, st in members.items():
            if "requests" not in st:
                print(json.dumps({"time": stamp, "member": member, "segment": None}) if args.json
                      else f"{stamp}  {member} is down", flush=True)  # fmt: skip
                continue
            prev = before.get(member, {})
            prev = prev if prev.get("server_epoch") == st["server_epoch"] else _ZERO
            rates = interval_rates(prev, st, now - t_before)
            line = {"time": stamp, "member": member, "interval": rates, "totals": st}
            print(json.dumps(line) if args.json else f"{format_watch_line(stamp, rates, st)}  {member}",
                  flush=True)  # fmt: skip
        before, t_before = members, now


WATCH_COLUMNS = (f"{'time':<19}  {'req/s':>7}  {'batch/s':>7}  {'audio s/s':>9}  {'avg batch':>9}  "
                 f"{'queue ms':>8}  {'failed':>6}  {'requests':>8}  server")  # fmt: skip


def interval_rates(before: dict, after: dict, seconds: float) -> dict:
    """Rates between two ``stats_from_header`` snapshots taken ``seconds`` apart.

    Audio seconds come from the real (unpadded) frames decoded (BiCodec: 50 tokens a second).
    """
    seconds = max(seconds, 1e-9)
    requests = after["requests"] - before["requests"]
    batches = after["batches"] - before["batches"]
    rows = _rows(after) - _rows(before)
    queued_ms = _queued_ms(after) - _queued_ms(before)
    completed = after["completed"] - before["completed"]
    return {
        "seconds": seconds,
        "requests": requests,
        "failed": after["failed"] - before["failed"],
        "requests_per_s": requests / seconds,
        "batches_per_s": batches / seconds,
        "audio_s_per_s": (after["tokens"] - before["tokens"]) / _frames_per_second(after) / seconds,
        "avg_batch_size": rows / batches if batches else 0.0,
        "avg_queue_wait_ms": queued_ms / completed if completed else 0.0,
    }


def _rows(stats: dict) -> int:
    """Requests decoded in all batches so far, from the batch-size histogram."""
    return sum(b * n for b, n in stats["batch_size_histogram"].items())


def _queued_ms(stats: dict) -> float:
    return stats["avg_queue_wait_ms"] * stats["completed"]  # the average is over completed ones


def format_watch_line(stamp: str, rates: dict, stats: dict) -> str:
    r, state = rates, "alive" if stats.get("server_alive") else "dead"
    return (f"{stamp:<19}  {r['requests_per_s']:>7.1f}  {r['batches_per_s']:>7.1f}  "
            f"{r['audio_s_per_s']:>9.2f}  {r['avg_batch_size']:>9.2f}  "
            f"{r['avg_queue_wait_ms']:>8.1f}  {r['failed']:>6}  {stats['requests']:>8}  {state}")  # fmt: skip


def format_stats(name: str, stats: dict) -> str:
    """A two-column table of ``stats_from_header`` output."""
    rows = [("segment", name), *stats_rows(stats)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_group_stats(stats: dict) -> str:
    """A server group's ``group_stats``: one column per member (a member that is down: "-")."""
    members = stats["members"]
    columns = {m: dict([("device", st["device"]), ("restarts", st["restarts"])]
                       + (stats_rows(st) if "requests" in st else [("server pid", "down")]))
               for m, st in members.items()}  # fmt: skip
    keys = list(max(columns.values(), key=len))
    alive = "alive" if stats["supervisor_alive"] else "not serving"
    up = sum(bool(st.get("server_alive")) for st in members.values())
    state = f"{up} of {len(members)} serving" if up else "DOWN: no member serves"
    rows = [("member", list(members))] + [(k, [columns[m].get(k, "-") for m in members]) for k in keys]
    width = max(len(k) for k, _ in rows)
    widths = [max(len(str(row[1][i])) for row in rows) for i in range(len(members))]
    lines = [f"group {stats['group']}: {len(members)} members, {state}; supervisor pid "
             f"{stats['supervisor_pid']} ({alive}), {stats['requests']} requests in all"]  # fmt: skip
    for key, values in rows:
        cells = "  ".join(f"{str(v):<{w}}" for v, w in zip(values, widths))
        lines.append(f"{key:<{width}}  {cells}".rstrip())
    return "\n".join(lines)


def _frames_per_second(stats: dict) -> float:
    """Frames (BiCodec: tokens) per second of audio of the codec ``stats`` names."""
    try:
        return get_layout(stats.get("codec", "bicodec")).frame_rate
    except ValueError:
        return TOKENS_PER_SECOND


def stats_rows(stats: dict) -> list[tuple[str, object]]:
    """The rows of ``format_stats`` after the segment's name."""
    return [
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
        ("codec", stats.get("codec", "-")),
    ]


def _cmd_decode(args: argparse.Namespace) -> int:
    from .client import DecoderClient

    # Everything that can refuse without the server is checked before it is asked to decode.
    validate_name(args.name)
    try:
        semantic = read_ids(args.semantic, what="--semantic")
        global_ids = read_ids(args.global_, what="--global")
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename}: {exc.strerror}") from None
    if args.output != "-":
        check_writable(args.output)
    state = probe(args.name)
    if state in (ServerState.ABSENT, ServerState.DEAD):
        raise BiCodecShmError(
            f"no bicodec-shm server is running under the name {args.name!r}; "
            f"{describe_served()} (start one with `bicodec-shm serve --name {args.name}`, "
            "or pass the name of a running one with --name)"
        )
    starting = state is ServerState.BUSY  # a server is starting (or stopping): wait for it
    with DecoderClient(args.name, timeout=args.timeout,
                       connect_timeout=args.timeout if starting else 0.0) as client:  # fmt: skip
        pcm = client.decode(semantic, global_ids)  # (320·T,) int16
    data = wav_bytes(pcm)
    if args.output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        try:
            with open(args.output, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise BiCodecShmError(f"cannot write {args.output}: {exc.strerror}") from None
    where = "standard output" if args.output == "-" else args.output
    print(f"wrote {where}: {len(semantic)} tokens, {len(pcm) / SAMPLE_RATE:.2f} s of 16 kHz mono int16",
          file=sys.stderr)  # fmt: skip
    return 0


def check_writable(path: str) -> None:
    """Refuse an output path that cannot be written, without creating anything."""
    if os.path.isdir(path):
        raise ValueError(f"-o {path} is a folder: name the WAV file to write")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"-o {path}: the folder {folder} does not exist")
    target = path if os.path.exists(path) else folder
    if not os.access(target, os.W_OK):
        raise ValueError(f"-o {path}: {target} is not writable by this user")


# A batch in a file: the CLI decodes one utterance per call.
_CLI_BATCH_HINT = "run `bicodec-shm decode` once per row, each row in its own file"


def read_ids(path: str, *, what: str):  # -> np.ndarray (N,) integer
    """Token ids from a ``.npy`` file (any integer dtype and the API's shape rule: leading
    dimensions of size 1, as in Spark-TTS's (1, T), are dropped) or a text file of integers
    separated by whitespace and/or commas (surrounding brackets allowed).

    The file's format and shape are checked here; ranges and lengths are the client's checks.
    """
    import numpy as np

    if path.endswith(".npy"):
        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"{what} {path}: not a numpy array file ({exc})") from None
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what} {path}: ids must be integers, the array is {arr.dtype}")
        return as_utterance(arr, what=f"{what} {path}", batch_hint=_CLI_BATCH_HINT)
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    words = [w for w in re.split(r"[\s,]+", text.strip().strip("[]")) if w]
    ids = []
    for i, word in enumerate(words):
        try:
            ids.append(int(word))
        except ValueError:
            raise ValueError(
                f"{what} {path}: item {i} is {word[:20]!r}, not an integer "
                "(expected ints separated by spaces or commas, or a .npy file)"
            ) from None
    return np.asarray(ids, dtype=np.int64)


def wav_bytes(pcm) -> bytes:
    """(N,) int16 samples -> a complete 16 kHz mono WAV file, written by ``wave``."""
    import numpy as np

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())
    return buf.getvalue()


def _cmd_cleanup(args: argparse.Namespace) -> int:
    state = probe(args.name)
    if state in (ServerState.SERVING, ServerState.BUSY):
        raise BiCodecShmError(f"a server of {args.name!r} is alive ({state.value}); stop it instead")
    removed = remove_dead(args.name)  # under the name's OWNER lock, like a takeover
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
