"""``bicodec-shm soak``: a server and N client processes for a while, with random faults.

Clients send random requests drawn from a pool whose reference audio (each request decoded alone,
unpadded, in this process) is written to a file they load with numpy; every result is compared
with it (float32 within 1e-4, int16 within 1 LSB). In each client process one handle is shared
by ``--threads`` synchronous caller threads and ``--async-calls`` concurrent asyncio calls, and
``--churn`` more threads attach a handle of their own, decode once and close it, over and over.
Meanwhile, at random:

- clients are SIGKILLed and replaced;
- the server is SIGKILLed and restarted after a random pause (``--kill-server-every``);
- the server gets SIGTERM and a new one is started at once, a rolling restart
  (``--term-server-every``);
- a client forks with its threads running (``--fork-every``): the child decodes a few
  requests with the handle it inherited, then exits; its parent may be killed meanwhile;
- every client forks every ``--bare-fork-every`` seconds (mean) a child that exits at once,
  while its other threads attach, decode and close: a child that does not exit within
  ``BARE_FORK_EXIT`` seconds is hung;
- a client closes its shared handle with calls in flight and opens a new one
  (``--close-every``);
- a client or the server is SIGSTOPped for a moment (``--stop-every``);
- a share of calls, in every caller thread, gets an exception at a random bytecode of the
  package's code (``--inject-share``; ``sys.settrace`` opcode events), so between any two steps
  of the client's state changes, as a signal handler's exception may land;
- a share of the main thread's calls is interrupted by a SIGALRM handler raising
  ``KeyboardInterrupt`` after a random 30 us to 50 ms (``--interrupt-share``);
- a share of asyncio calls is cancelled at a random moment (``--cancel-share``), and a share of
  requests carries a garbage submit time (``--garbage-share``: 0 or the largest u64, as a buggy
  or hostile client would);
- with ``--group``, the server is a group of two members: server kills hit one member (the
  supervisor restarts it), rolling restarts replace the whole group;
- a share of the servers started (``--small-server-share``) has smaller limits than the others:
  half the ``--max-tokens`` and ``--small-slots`` slots, fewer than the clients' handles want in
  all. Callers size their requests to fit the server they are attached to (its ``max_tokens``
  from ``get_stats()``), but a share (``--oversize-share``) sends any request of the pool: one
  longer than the server holds must get the documented ``ValueError`` naming the limit
  (*refused as too long*), never a loss.

Each client's shared handle has ``--handle-slots`` slots for its ``--threads`` caller threads
and ``--async-calls`` asyncio calls: many more requests than slots, waiting in line for them.

Each client appends one line per event to its own log, line-buffered, so that a killed client
loses nothing already said (``client_main`` lists the tags). At the end:

- *lost*: sent by a client that was not killed, and never answered (hang or silent loss);
- *timed out*: a call that ended with ``DecodeTimeoutError`` (``--call-timeout``, far longer than
  any fault here lasts): a request nobody answered, or a slot nobody freed;
- *undocumented errors*: a caller saw an exception outside the documented tree;
- *slots owned without their lock*: a thread of each client checks, every 20 ms, that every
  slot the shared handle counts as its own is locked by it;
- *fresh client*: once the faults stop, with every client still running, a new client in a
  process of its own must get a slot and its own audio;
- *hung*: a client that does not exit once asked to, a caller thread that does not finish, a
  forked child that does not exit;
- *killed in flight*: sent by a client that was then SIGKILLed (not an error of ours);
- *leaked slots*: slots not FREE, or bells still locked, once every client is gone and the
  reaper has run;
- *left in /dev/shm*: objects of the name after the server's clean stop.

All of these but *killed in flight* must be 0. A failed soak keeps its clients' logs and names
the folder (``BICODEC_SHM_SOAK_DEBUG=1`` also records every error's message).

One module per job:

- ``injector``: ``Injected`` and ``Interrupted``, and ``_Injector``, which raises one at a
  random point of a call where CPython would run a signal handler (in the package's code, never
  in this folder's);
- ``client``: the client process (``client_main``, which lists its log's tags), its forked
  children (``_Children``), the ownership probe, the garbage clock, and the fresh client of the
  end (``probe_main``);
- ``orchestrator``: the pool of requests and their references, the server and the clients, the
  schedule of faults, and the checks once the faults stop (``run_soak``);
- ``result``: ``SoakResult``, the count of the clients' logs (``_tally``), the printed table;
- this module: the options and their defaults, ``main`` and ``run_and_report``; ``__main__``
  runs ``main`` (``python -m bicodec_shm.tools.soak``, also how the orchestrator starts its
  client and probe processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ...client.decoder_client import STOP_GRACE
from .client import _Children, client_main, probe_main
from .injector import Injected, Interrupted, _Injector
from .orchestrator import make_pool, run_soak
from .result import SoakResult, _tally, format_result

__all__ = [
    "HELP_FORMATTER", "Injected", "Interrupted", "SoakResult", "_Children", "_Injector", "_tally",
    "add_arguments", "client_main", "format_result", "main", "make_pool", "probe_main",
    "run_and_report", "run_soak",
]


# The defaults run the whole fault mix the README advertises, at rates that give a one-minute
# run (the default --duration) about 60 client kills, 3 server kills, 4 rolling restarts and 15
# forks: every fault happens more than once. Each mean is jittered by 0.5x to 1.5x.
DEFAULT_DURATION = 60.0
DEFAULT_KILL_EVERY = 1.0
DEFAULT_KILL_SERVER_EVERY = 20.0
DEFAULT_TERM_SERVER_EVERY = 15.0
DEFAULT_FORK_EVERY = 4.0
DEFAULT_CLOSE_EVERY = 5.0
DEFAULT_STOP_EVERY = 8.0
DEFAULT_INTERRUPT_SHARE = 0.03
DEFAULT_GARBAGE_SHARE = 0.03
DEFAULT_INJECT_SHARE = 0.1
DEFAULT_CANCEL_SHARE = 0.05
DEFAULT_BARE_FORK_EVERY = 0.05
DEFAULT_CALL_TIMEOUT = 60.0
DEFAULT_THINK_MS = 5.0
DEFAULT_ASYNC_CALLS = 12  # with 3 threads, 15 requests at once on a handle of 3 slots
DEFAULT_SMALL_SERVER_SHARE = 0.5
DEFAULT_SMALL_SLOTS = 16  # fewer than 8 clients' handles of 3 slots want
DEFAULT_OVERSIZE_SHARE = 0.05
HELP_FORMATTER = argparse.ArgumentDefaultsHelpFormatter  # every option's default in --help


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The soak's options; build ``p`` with ``formatter_class=HELP_FORMATTER`` to show defaults."""
    p.add_argument("--duration", type=float, default=DEFAULT_DURATION, help="seconds of faults")
    p.add_argument("--clients", type=int, default=8, help="client processes decoding at once")
    p.add_argument("--kill-every", type=float, default=DEFAULT_KILL_EVERY,
                   help="mean seconds between client SIGKILLs (0: none)")  # fmt: skip
    p.add_argument("--kill-server-every", type=float, default=DEFAULT_KILL_SERVER_EVERY,
                   help="mean seconds between server SIGKILLs, each followed by a restart (0: none)")
    p.add_argument("--term-server-every", type=float, default=DEFAULT_TERM_SERVER_EVERY,
                   help="mean seconds between rolling restarts: SIGTERM + a new server (0: none)")
    p.add_argument("--fork-every", type=float, default=DEFAULT_FORK_EVERY,
                   help="mean seconds between client forks (0: none)")  # fmt: skip
    p.add_argument("--close-every", type=float, default=DEFAULT_CLOSE_EVERY,
                   help="mean seconds between client handle closes with calls in flight (0: none)")
    p.add_argument("--stop-every", type=float, default=DEFAULT_STOP_EVERY,
                   help="mean seconds between SIGSTOPs of a client or the server (0: none)")
    p.add_argument("--interrupt-share", type=float, default=DEFAULT_INTERRUPT_SHARE,
                   help="share of synchronous calls interrupted by KeyboardInterrupt")
    p.add_argument("--garbage-share", type=float, default=DEFAULT_GARBAGE_SHARE,
                   help="share of requests with a garbage submit time")
    p.add_argument("--inject-share", type=float, default=DEFAULT_INJECT_SHARE,
                   help="share of calls, in every caller thread, that get an exception at a random "
                        "bytecode of the package's code")  # fmt: skip
    p.add_argument("--cancel-share", type=float, default=DEFAULT_CANCEL_SHARE,
                   help="share of asyncio calls cancelled at a random moment")
    p.add_argument("--threads", type=int, default=3,
                   help="synchronous caller threads per client, sharing its handle")
    p.add_argument("--async-calls", type=int, default=DEFAULT_ASYNC_CALLS,
                   help="concurrent asyncio calls per client, on the same handle")
    p.add_argument("--handle-slots", type=int, default=3,
                   help="slots of each client's shared handle (its callers wait in line for them)")
    p.add_argument("--small-server-share", type=float, default=DEFAULT_SMALL_SERVER_SHARE,
                   help="share of servers started with half the --max-len as --max-tokens and "
                        "--small-slots slots (not with --group)")  # fmt: skip
    p.add_argument("--small-slots", type=int, default=DEFAULT_SMALL_SLOTS,
                   help="the --slots of a small server")
    p.add_argument("--oversize-share", type=float, default=DEFAULT_OVERSIZE_SHARE,
                   help="share of requests drawn from the whole pool, not sized to fit the server")
    p.add_argument("--churn", type=int, default=1,
                   help="threads per client that attach a handle of their own, decode once and close it")
    p.add_argument("--bare-fork-every", type=float, default=DEFAULT_BARE_FORK_EVERY,
                   help="mean seconds between each client's forks whose child exits at once (0: none)")
    p.add_argument("--think-ms", type=float, default=DEFAULT_THINK_MS,
                   help="mean pause between a caller thread's calls, in ms (0: none)")
    p.add_argument("--call-timeout", type=float, default=DEFAULT_CALL_TIMEOUT,
                   help="the clients' timeout; a call that times out counts as lost")
    p.add_argument("--stop-grace", type=float, default=STOP_GRACE,
                   help="the clients' stop_grace: seconds to wait for a rolling restart's new server")
    p.add_argument("--mode", type=lambda v: int(v, 8), default=0o600,
                   help="the server's --mode: 0o660 hands the segment over its socket (default 0o600)")
    p.add_argument("--group", action="store_true",
                   help="serve with a group of two members (server kills hit one member)")
    p.add_argument("--preset", default="tiny", choices=("tiny", "spark-tts-0.5b"),
                   help="the server's architecture (random weights)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the fault schedule")
    p.add_argument("--slots", type=int, default=64, help="the server's --slots")
    p.add_argument("--pool", type=int, default=48, help="distinct requests with references")
    p.add_argument("--max-len", type=int, default=150, help="longest request in tokens")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    if argv and argv[0] == "probe":
        return probe_main(argv[1:])
    p = argparse.ArgumentParser(prog="bicodec-shm soak", description=__doc__.splitlines()[0],
                                formatter_class=HELP_FORMATTER)  # fmt: skip
    add_arguments(p)
    return run_and_report(p.parse_args(argv))


def run_and_report(args: argparse.Namespace) -> int:
    result = run_soak(args)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0 if result.ok else 1
