"""semwait.py: timed waits on named semaphores, and forks that land while threads open and close
them.

glibc guards its registry of mapped named semaphores with one process-wide lock that it does not
reset in a forked child. A fork that lands while another thread is inside ``sem_open`` or
``sem_close`` leaves that lock held in the child, and the child's at-fork hook (which closes the
parent's attachments) then waits for it for ever. These tests fork for real while threads attach,
decode and close real clients of a real server.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import posix_ipc
from support import seeded_request

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.protocol.names import random_name
from bicodec_shm.protocol.semwait import Waiter

CHILD_EXIT_WITHIN = 10.0  # seconds; a child that runs the at-fork hooks and exits needs ms


def _wait_child(pid: int, within: float) -> int | None:
    """The child's exit code, or None if it had not exited within ``within`` s (then killed)."""
    deadline = time.monotonic() + within
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.001)


def _mapped_semaphores(n: int) -> list[posix_ipc.Semaphore]:
    """``n`` more semaphores mapped in this process (their names unlinked at once, so nothing is
    left behind whatever happens): ``sem_close`` walks every mapping under glibc's lock, so
    this makes each close hold it longer, as in a process with many attachments."""
    prefix = random_name("bcshm-test")
    sems = []
    for i in range(n):
        sem = posix_ipc.Semaphore(f"/{prefix}.pad.{i}", posix_ipc.O_CREX, 0o600, 0)
        sem.unlink()
        sems.append(sem)
    return sems


def test_a_fork_while_threads_attach_decode_and_close_clients_never_hangs_the_child(thread_server, shm_name):
    thread_server(slots=8)
    padding = _mapped_semaphores(500)
    free_name = f"/{shm_name}.free"
    stop = threading.Event()
    errors: list[BaseException] = []
    request = seeded_request(1, 3)

    def clients() -> None:  # what a worker's threads do: attach, decode, close
        try:
            while not stop.is_set():
                with DecoderClient(shm_name, slots=1, timeout=30) as client:
                    client.decode(*request)
        except BaseException as exc:  # noqa: B036 - reported by the test below
            errors.append(exc)

    def waiters() -> None:  # the same sem_open/sem_close calls, back to back: a wide window
        try:
            while not stop.is_set():
                waiter = Waiter()
                waiter.open(free_name)
                waiter.close()
        except BaseException as exc:  # noqa: B036
            errors.append(exc)

    threads = [threading.Thread(target=clients) for _ in range(2)] + [threading.Thread(target=waiters)]
    for t in threads:
        t.start()
    forks, hung = 0, None
    try:
        # Up to 400 forks in 10 s, and at least 50 however loaded the machine (within 60 s).
        t_end, t_last = time.monotonic() + 10.0, time.monotonic() + 60.0
        while not errors and time.monotonic() < t_last and (
            forks < 50 or (forks < 400 and time.monotonic() < t_end)
        ):
            with warnings.catch_warnings():
                # Python >= 3.12 warns about fork() with threads running: that is the point here.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                # The at-fork hooks have run (they closed the parent's attachments); the
                # registry must still be usable here.
                try:
                    child = Waiter()
                    child.open(free_name)
                    child.close()
                finally:
                    os._exit(0)
            forks += 1
            code = _wait_child(pid, CHILD_EXIT_WITHIN)
            if code is None:
                hung = forks
                break
            assert code == 0, f"fork {forks}: the child exited with {code}"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for sem in padding:
            sem.close()
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert not errors, errors
    assert hung is None, f"fork {hung} of {forks}: the child never got out of its at-fork hooks"
    assert forks >= 50, f"only {forks} forks in the time given: the check proved little"
