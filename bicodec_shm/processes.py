"""Server processes started by the package's own tools (demo, soak) and by the tests.

Start-up is the one place that polls: a fresh server has no doorbell to ring yet. The request
path never polls.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import BiCodecShmError
from .transport import ServerState, probe


def serve_command(name: str, *options: str) -> list[str]:
    """The command line of ``bicodec-shm serve --name NAME OPTIONS`` in this interpreter."""
    return [sys.executable, "-m", "bicodec_shm", "serve", "--name", name, *options]


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the kernel send the child SIGTERM when its parent dies, so a
    server started by a supervisor or a Ray actor stops cleanly (and unlinks its segment) even
    when its owner is SIGKILLed.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits: start the child from a
    thread that lives as long as its owner (the supervisor's main thread; the actor's own
    server thread).
    """
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child
    parent = os.getpid()

    def preexec() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise BiCodecShmError("prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return preexec


def keeper_command(command: list[str]) -> list[str]:
    """``command`` run under ``keep_server`` in this interpreter (no torch, no Ray imported)."""
    keep = "import sys; from bicodec_shm.processes import keep_server; sys.exit(keep_server(sys.argv[1:]))"
    return [sys.executable, "-c", keep, *command]


def keep_server(command: list[str]) -> int:
    """Run ``command`` (a server) as this process's child until it exits; returns its status.

    For owners that SIGKILL their children when they exit (a Ray worker does): the owner's
    SIGKILL lands on this keeper, and the server, a grandchild, then gets SIGTERM (its
    PR_SET_PDEATHSIG) and stops cleanly, unlinking its segment. SIGTERM and SIGINT to the keeper
    are passed on to the server; the keeper itself gets SIGTERM when its owner dies.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        raise BiCodecShmError("prctl(PR_SET_PDEATHSIG) failed")
    server = subprocess.Popen(command, preexec_fn=die_with_parent())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: server.send_signal(signum))
    code = server.wait()
    return code if code >= 0 else 128 - code  # killed by signal N: exit 128 + N, as a shell says


def is_serving(name: str) -> bool:
    """True once a live server has finished creating ``name`` and serves it."""
    return probe(name) is ServerState.SERVING


def wait_until_serving(name: str, server: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Block until ``name`` is served; raise if ``server`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise BiCodecShmError(f"the server exited with code {server.returncode} while starting")
        if is_serving(name):
            return
        time.sleep(0.02)
    raise BiCodecShmError(f"the server of {name!r} did not come up within {timeout:.0f} s")


def stop_server(server: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (a clean stop that unlinks the segment), then SIGKILL if it does not exit."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def on_stop_signals(handler: Callable[[int], None]) -> Callable[[], None]:
    """Call ``handler(signum)`` on SIGINT and SIGTERM; returns the function that restores the
    previous handlers. Outside the main thread (where Python cannot set handlers) it does
    nothing and so does what it returns.

    A SIGINT that this process was started with ignored stays ignored: that is how a shell's
    background job (``serve &``, ``nohup``) and a parent that stops its children in order (the
    bench) keep a terminal's Ctrl-C away from it."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signals.insert(0, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: handler(signum))

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


class StartupSignals:
    """SIGINT and SIGTERM during a server's start-up: a prompt, clean exit, with nothing left.

    Python's defaults would leave objects behind: SIGTERM kills the process outright, and the
    ``KeyboardInterrupt`` of a Ctrl-C that lands after the segment was created, but before
    ``serve_forever`` takes the signals over, unwinds past every clean-up. From ``__enter__``
    on, a stop signal is handled in one of three ways, switched by the start-up as it goes:

    - ``interruptible()`` (the default; the model loading): it raises at once
      (``KeyboardInterrupt`` for SIGINT, ``SystemExit(128 + N)`` for SIGTERM), and the
      start-up's ``finally``/``except`` blocks release what they own;
    - ``deferred()`` (creating the server: short, and its result must reach the caller): it is
      only recorded;
    - ``hand_to(server)``: the server is asked to stop (``server.stop()``), for a recorded
      signal at once; ``serve_forever`` then stops right away and unlinks everything.

    A SIGINT this process was started with ignored stays ignored (see ``on_stop_signals``).
    Main thread only (elsewhere nothing is installed). ``__exit__`` restores the handlers.
    """

    def __init__(self) -> None:
        self.received: int | None = None  # a signal recorded while deferred
        self._server: Any = None
        self._defer = False
        self._restore: Callable[[], None] = lambda: None

    def __enter__(self) -> StartupSignals:
        self._restore = on_stop_signals(self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def interruptible(self) -> None:
        self._defer = False
        if self.received is not None and self._server is None:
            self._raise(self.received)

    def deferred(self) -> None:
        self._defer = True

    def hand_to(self, server: Any) -> None:
        self._server = server
        if self.received is not None:
            server.stop()

    def _on_signal(self, signum: int) -> None:
        server = self._server
        if server is not None:
            server.stop()
            return
        first = self.received is None
        if first:
            self.received = signum
        # Only the first raises: a second one must not cut short the clean-up the first began.
        if first and not self._defer:
            self._raise(signum)

    @staticmethod
    def _raise(signum: int) -> None:
        print(f"bicodec-shm: received {signal.Signals(signum).name} while starting: stopping",
              file=sys.stderr, flush=True)  # fmt: skip
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


def sigint_ignored() -> bool:
    """Whether this process ignores SIGINT (started so: a shell's background job, ``nohup``)."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN
