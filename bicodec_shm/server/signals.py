"""Stop signals of a serving process: SIGINT and SIGTERM become a call, in the main thread only."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


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
