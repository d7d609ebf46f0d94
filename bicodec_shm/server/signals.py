"""Stop signals of a serving process: SIGINT and SIGTERM become a call, in the main thread only."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


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
