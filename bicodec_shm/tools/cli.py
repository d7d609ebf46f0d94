"""``bicodec-shm``: serve | stats | decode | demo | bench | soak | cleanup.

``main(argv=None) -> int`` is the console script; tests call it in-process.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from .._version import __version__
from ..client.stream_settings import StreamSettings
from ..codecs.layout import MAX_FRAMES, default_max_frames, get_layout
from ..errors import BiCodecShmError, ServerAlreadyRunningError
from ..protocol.group import validate_group_name
from ..protocol.layout import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SLOTS,
    DEFAULT_START_WAIT,
    MAX_SLOTS,
    Layout,
    shared_mode,
)
from ..protocol.names import (
    ServerState,
    check_free_space,
    leftover_objects,
    probe,
    release_name,
    remove_dead,
    reserve_name,
    validate_name,
)
from ..server.batch_costs import BATCHING_MODES
from ..server.batching import (
    DEFAULT_CUDA_MAX_BATCH_TOKENS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_WAIT_MS,
    DEFAULT_MIN_FILL,
    DEFAULT_REJOIN_MS,
)
from ..server.dispatch_policy import DISPATCH_MODES
from ..server.signals import StartupSignals, sigint_ignored
from .decode_cmd import _cmd_decode
from .model_args import (
    CODECS,
    add_model_args,
    check_encodable,
    import_model_code,
    load_decoder,
    load_encoder,
    resolve_preset,
)
from .stats_cmd import _cmd_stats, marked_stopping, pid_clause

DEFAULT_NAME = "bicodec-shm"
# Every command's name defaults to $BICODEC_SHM_NAME when it is set (the examples' servers and
# workers read the same variable), so that an operator sets the name once per host or container.
NAME_ENV = "BICODEC_SHM_NAME"
LOG_LEVELS = ("debug", "info", "warning", "error")
STATS_DESCRIPTION = """\
Prints a server's live counters (a group's: its members side by side).

Exit status, so that it serves as a health probe (Docker HEALTHCHECK, a Kubernetes exec probe):
  0  a live server serves NAME
  1  nothing serves NAME: it is absent, starting, stopping, or its server died (the line printed
     on standard error says which, and what to do: start a server, or `bicodec-shm cleanup NAME`)
With --watch it runs until interrupted, one line per interval."""
# protocol.segment.Segment.create refuses a longer --max-tokens; serve checks it before loading a model.
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
    if getattr(args, "log_level", None):
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in ``--help``, unless its help already says it (or it has none to
    show: a flag, or a default that depends on something else, which its help then explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default is argparse.SUPPRESS or default == [])
        if shown and "default" not in text and "%(default)" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _logging_options() -> argparse.ArgumentParser:
    """``--log-level``, ``-v`` and ``-q`` for the commands that log."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("logging")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="what to log on standard error (info: start, stop, each choice of lanes, "
                        "dead clients reclaimed, failures; debug adds routine events)")  # fmt: skip
    x.add_argument("-v", "--verbose", dest="log_level", action="store_const", const="debug",
                   help="the same as --log-level debug")  # fmt: skip
    x.add_argument("-q", "--quiet", dest="log_level", action="store_const", const="warning",
                   help="the same as --log-level warning: only what needs attention")  # fmt: skip
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bicodec-shm", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)  # fmt: skip
    p.add_argument("--version", action="version", version=f"bicodec-shm {__version__}")
    sub = p.add_subparsers(metavar="COMMAND")
    logs = _logging_options()
    name = os.environ.get(NAME_ENV) or DEFAULT_NAME
    named = f"(default: ${NAME_ENV} if set, else {DEFAULT_NAME})"

    s = sub.add_parser("serve", help="run the decoder server (owns the model and the segment)",
                       formatter_class=HelpFormatter, parents=[logs])  # fmt: skip
    add_model_args(s)
    s.add_argument("--codec", default="bicodec", choices=CODECS,
                   help="the codec served; snac-24khz is Orpheus TTS's")  # fmt: skip
    s.add_argument("--name", default=name, help=f"segment name clients attach to {named}")
    _add_server_args(s)
    s.add_argument("--mode", default="0o600", type=_octal,
                   help="who may attach: 0o600 this user, 0o660 also the group (over NAME.sock)")  # fmt: skip
    s.add_argument("--allow-world-access", action="store_true",
                   help="accept a --mode that lets every user of the host attach (not advised)")  # fmt: skip
    s.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on PORT (default: none; needs: pip install "
                        "'bicodec-shm[metrics]')")  # fmt: skip
    s.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics endpoint binds to (default: 127.0.0.1, this host only; "
                        "0.0.0.0 exposes it to the network: every IPv4 interface)")  # fmt: skip
    s.add_argument("--encode", action="store_true",
                   help="also encode: clients send audio and get its codes back (DecoderClient.encode; "
                        "bicodec and qwen3-tts-12hz only. BiCodec: the encoder of --model-dir's "
                        "Spark-TTS folder, with its wav2vec2-large-xlsr-53/; qwen3-tts-12hz: the "
                        "speech tokenizer folder's encoder; default: off, no encoder is loaded)")  # fmt: skip
    s.add_argument("--warm-up", choices=("auto", "none"), default="auto",
                   help="auto: on a CPU, build the kernels of the first three windows of the "
                        "codec's default stream, 1-4 rows at each lane thread count, before "
                        "serving (2 s at most); none: each shape's kernels build at its first "
                        "batch (default auto)")  # fmt: skip
    s.set_defaults(func=_cmd_serve, max_tokens=None)  # None: 30 s of the codec's audio

    st = sub.add_parser("stats", help="print a server's live counters; exits 0 only while it serves",
                        formatter_class=HelpFormatter, description=STATS_DESCRIPTION)  # fmt: skip
    st.add_argument("name", nargs="?", default=name, help=f"the server's (or group's) name {named}")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 1) until interrupted")  # fmt: skip
    st.set_defaults(func=_cmd_stats)

    de = sub.add_parser("decode", help="decode token ids from files into a WAV through a running server",
                        formatter_class=HelpFormatter)  # fmt: skip
    de.add_argument("--name", default=name, help=f"the server's name {named}")
    de.add_argument("--semantic", required=True, metavar="FILE",
                    help="semantic ids in [0, 8192): .npy, or ints split by spaces/commas")  # fmt: skip
    de.add_argument("--global", dest="global_", required=True, metavar="FILE",
                    help="the 32 global ids in [0, 4096), same formats")  # fmt: skip
    de.add_argument("-o", "--output", required=True, metavar="WAV",
                    help="the 16 kHz mono int16 WAV to write ('-': standard output)")  # fmt: skip
    de.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the audio")
    de.set_defaults(func=_cmd_decode)

    d = sub.add_parser("demo", help="a server and N client processes, checked against local decodes",
                       formatter_class=HelpFormatter, parents=[logs])  # fmt: skip
    add_model_args(d)
    _add_server_args(d)
    d.add_argument("--clients", type=int, default=4, help="client processes")
    d.add_argument("--requests", type=int, default=4, help="requests per client")
    d.add_argument("--min-len", type=int, default=25, help="shortest request in tokens")
    d.add_argument("--max-len", type=int, default=75, help="longest request in tokens")
    d.add_argument("--check", type=int, default=4, help="results to verify against local decodes")
    d.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    d.set_defaults(func=_cmd_demo, preset="spark-tts-0.5b")

    from .soak import HELP_FORMATTER as SOAK_HELP_FORMATTER
    from .soak import add_arguments as add_soak_arguments

    so = sub.add_parser("soak", help="server + clients for a while with random kills; checks every result",
                        formatter_class=SOAK_HELP_FORMATTER)  # fmt: skip

    add_soak_arguments(so)
    so.set_defaults(func=_cmd_soak)

    b = sub.add_parser("bench", help="throughput: shared server vs a decoder per process vs a Queue server",
                       formatter_class=HelpFormatter)  # fmt: skip
    from .bench import add_arguments as add_bench_arguments

    add_bench_arguments(b)
    b.set_defaults(func=_cmd_bench)

    c = sub.add_parser("cleanup", help="unlink the objects of a name whose server is dead",
                       formatter_class=HelpFormatter)  # fmt: skip
    c.add_argument("name", nargs="?", default=name, help=f"the dead server's (or group's) name {named}")
    c.set_defaults(func=_cmd_cleanup)
    return p




def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=int, default=DEFAULT_SLOTS,
                   help="request slots in all, shared by every client: size it to the requests in "
                        "flight at once (workers x concurrency + 1)")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="most rows in one forward pass")
    p.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                   help="how long a batch may wait to grow once a lane is free")
    p.add_argument("--rejoin-ms", type=float, default=DEFAULT_REJOIN_MS,
                   help="how long a free lane waits for the clients it just answered to send "
                        "again; stops once they have, and waits longer (up to 25 ms) where they "
                        "measure to take longer; 0: never")  # fmt: skip
    p.add_argument("--max-batch-tokens", type=_batch_tokens, default="auto",
                   help=f"padded-token budget per batch (rows x longest), or none; default "
                        f"{DEFAULT_MAX_BATCH_TOKENS} on CPU, "
                        f"{DEFAULT_CUDA_MAX_BATCH_TOKENS} on CUDA")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="longest request accepted, in frames (BiCodec: tokens); default 30 s of "
                        "audio (BiCodec 1500, SNAC 24 kHz 352)")  # fmt: skip
    p.add_argument("--min-fill", type=float, default=DEFAULT_MIN_FILL,
                   help="a row joins a batch only if its shortest row stays >= this share of its "
                        "longest")  # fmt: skip
    p.add_argument("--lanes", type=int, default=None,
                   help="decode lanes sharing the weights (default: 1 on CUDA; on a CPU, predicted "
                        "from the first batches' load, then chosen among 1, 2 and 4 by measuring "
                        "each on the live traffic, every choice logged); a number fixes it")  # fmt: skip
    p.add_argument("--batching", choices=BATCHING_MODES, default="auto",
                   help="auto: batch only where the server's own batches measure that it pays "
                        "(every choice logged); static: every row the bounds above admit "
                        "(default auto)")  # fmt: skip
    p.add_argument("--dispatch", choices=DISPATCH_MODES, default="auto",
                   help="auto: plan the next batch at once, or wait for the running batch's "
                        "clients, whichever the measured batch cost and client turnaround say "
                        "serves more (every change logged); pipeline or wait fixes it (default "
                        "auto)")  # fmt: skip


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
    if args.encode:
        check_encodable(args.codec)
    if args.max_tokens is None:
        args.max_tokens = default_max_frames(args.codec)
    codec = get_layout(args.codec)
    check_server_args(args)
    if group:  # one server per device, named NAME.K, under a supervisor
        from ..deploy.supervisor import parse_devices, serve_group

        devices = parse_devices(args.device)
        if not shared_mode(args.mode):  # a segment shared with the group is a memfd, not in /dev/shm
            check_free_space(len(devices) * Layout(args.slots, args.max_tokens, codec).total_size)
        wait_for_name(args.name)
        return serve_group(args.name, devices, args.argv, mode=args.mode,
                           metrics_port=args.metrics_port)  # fmt: skip
    if args.metrics_port is not None:
        from ..server.metrics import require_prometheus_client

        require_prometheus_client()
    if not shared_mode(args.mode):
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
    # From owning the name on, SIGINT and SIGTERM stop the start-up cleanly (server/signals.py).
    with StartupSignals() as startup:
        # Own the name before the model loads: while it loads the name reads as "starting", so
        # the clients of a server that just stopped (a rolling restart) wait for this one.
        reserved = reserve_name(args.name, mode=args.mode, wait=DEFAULT_START_WAIT)
        try:
            # A signal while torch imports would end the process where no clean-up runs
            # (import_model_code): it is only recorded then, and stops the start-up after.
            startup.deferred()
            from ..server.kernel_warmup import KERNEL_CACHE_CAPACITY
            from ..server.server import DecoderServer

            import_model_code(args)
            startup.interruptible()
            # Before the first convolution, which reads it (server/kernel_warmup.py).
            os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))
            decoder = load_decoder(args)
            encoder = load_encoder(args) if args.encode else None  # no --encode: nothing loaded
            warm_up_frames = _warm_up_frames(args) if args.warm_up == "auto" else []
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
            batching=args.batching,
            dispatch=args.dispatch,
            max_tokens=args.max_tokens,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            mode=args.mode,
            reserved=reserved,
            encoder=encoder,
            warm_up_frames=warm_up_frames,
        )
        startup.hand_to(server)
        how = ("SIGINT is ignored here, as in a background job: stop it with SIGTERM"
               if sigint_ignored() else "Ctrl-C to stop")  # fmt: skip
        print(f"bicodec-shm: serving on {args.name!r} ({how})", file=sys.stderr, flush=True)
        server.serve_forever()
    return 0


def _warm_up_frames(args: argparse.Namespace) -> list[int]:
    """The first windows of a stream of the served codec's default preset, fitted to the
    server's --max-tokens: the shapes its clients' streams open with."""
    from ..server.kernel_warmup import WARM_UP_WINDOWS  # torch is imported by now (_serve_one)

    settings = StreamSettings.preset("default", args.codec).fitted(args.max_tokens)
    return settings.opening_windows(WARM_UP_WINDOWS)


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
    while probe(name) is ServerState.SERVING and not marked_stopping(name):
        if time.monotonic() >= deadline:
            raise ServerAlreadyRunningError(
                f"{name!r} is already being served{pid_clause(name)}: stop that server first "
                "(Ctrl-C in its terminal, or SIGTERM) or choose another --name"
            )
        if not said and grace > 0:
            print(f"bicodec-shm: {name!r} is being served{pid_clause(name)}; waiting up to "
                  f"{grace:g} s for it to stop (a rolling restart) before refusing",
                  file=sys.stderr, flush=True)  # fmt: skip
            said = True
        time.sleep(0.05)












































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
