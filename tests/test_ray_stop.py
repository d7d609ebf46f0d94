"""``NodeDecoder.stop()`` kills only the processes it started, never a pid read from a header.

The header's ``server_pid`` is informational: any client of the segment can write it. Here it
names an unrelated process (a bystander); the keeper and its server both ignore SIGTERM, so
``stop`` reaches its SIGKILL. No Ray cluster is needed: ``NodeDecoder`` is the plain class Ray
wraps, given a keeper as its constructor would start one (its own session).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray", reason='NodeDecoder needs the [ray] extra: pip install -e ".[ray]"')
import psutil  # noqa: E402

from bicodec_shm.deploy.ray import NodeDecoder  # noqa: E402
from bicodec_shm.protocol.names import leftover_objects  # noqa: E402
from bicodec_shm.protocol.segment import Segment  # noqa: E402

# A process that ignores SIGTERM (a server wedged in a batch); says when it is ready.
_STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "print('ready', flush=True); time.sleep(600)")
# A keeper that ignores SIGTERM and starts a server that ignores it too; prints the server's pid.
_KEEPER = f"""
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
server = subprocess.Popen([sys.executable, "-c", {_STUBBORN!r}], stdout=subprocess.PIPE, text=True)
server.stdout.readline()
print(server.pid, flush=True)
server.wait()
"""


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_stop_sigkills_its_own_keeper_and_server_never_the_pid_a_header_names(shm_name):
    bystander = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE, text=True)
    keeper = subprocess.Popen([sys.executable, "-c", _KEEPER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    seg = Segment.create(shm_name, n_slots=1, max_tokens=10)
    try:
        assert bystander.stdout.readline() == "ready\n"
        server_pid = int(keeper.stdout.readline())
        seg.header["server_pid"] = bystander.pid  # what any client of the segment may write
        decoder = NodeDecoder.__new__(NodeDecoder)
        decoder.name, decoder._stopping, decoder._keeper = shm_name, threading.Event(), keeper
        decoder.stop(timeout=0.5)
        assert keeper.returncode == -9
        assert _gone(server_pid), "the server the keeper started survived stop()"
        assert bystander.poll() is None, "stop() killed the process the header named"
        assert leftover_objects(shm_name) == []
    finally:
        seg.close()
        for proc in (bystander, keeper):
            proc.kill()
            proc.wait()
            proc.stdout.close()
