"""Server processes started by the package's own tools (demo, soak) and by the tests.

Start-up is the one place that polls: a fresh server has no doorbell to ring yet. The request
path never polls.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from .errors import BiCodecShmError
from .transport import ServerState, probe


def serve_command(name: str, *options: str) -> list[str]:
    """The command line of ``bicodec-shm serve --name NAME OPTIONS`` in this interpreter."""
    return [sys.executable, "-m", "bicodec_shm", "serve", "--name", name, *options]


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
