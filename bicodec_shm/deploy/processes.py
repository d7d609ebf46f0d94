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
import time
from collections.abc import Callable

from ..errors import BiCodecShmError
from ..protocol.names import ServerState, probe


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
    keep = ("import sys; from bicodec_shm.deploy.processes import keep_server; "
            "sys.exit(keep_server(sys.argv[1:]))")
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
