"""A signal handler's exception while a thread of the handle waits (in the main thread: Ctrl-C,
a SIGALRM deadline) never breaks the handle's own lock: the other threads that share the handle
keep their mutual exclusion, nobody sees a ``RuntimeError`` from it, nobody deadlocks on it."""

from __future__ import annotations

import random
import signal
import threading
import time

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import DecodeTimeoutError
from bicodec_shm.tools import soak

GLB = [0] * 32


class _Interrupt(KeyboardInterrupt):
    """What a signal handler raises (Ctrl-C, a SIGALRM deadline)."""


def test_an_exception_from_a_signal_handler_while_waiting_for_the_handles_own_slot_never_breaks_its_lock(
    thread_server, shm_name
):
    """The handle's one slot is in use; the main thread waits for it, in short waits, under a
    storm of SIGALRMs whose handler raises, while another thread of the handle takes the
    handle's lock over and over. A wait that releases the lock it waits with and is then
    interrupted before it re-takes it (``threading.Condition.wait``) makes the waiter's own
    ``with`` release the lock a second time: another thread's hold is dropped under it, and its
    release then raises ``RuntimeError: release unlocked lock``."""
    thread_server(slots=2)
    errors: list[str] = []
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            armed[0] = False
            raise _Interrupt()

    previous = signal.signal(signal.SIGALRM, handler)
    stop = threading.Event()
    try:
        with DecoderClient(shm_name, slots=1, timeout=10) as client:
            client.decode([1, 2, 3], GLB)
            att = client._att
            slot, seq = att.take_slot(time.monotonic() + 10)  # the handle's one slot, in use

            def contend() -> None:  # another thread of the handle, as a monitor or a caller
                while not stop.is_set():
                    try:
                        with att.use():
                            pass
                    except RuntimeError as exc:
                        errors.append(f"other thread: {exc}")

            other = threading.Thread(target=contend, daemon=True)
            other.start()
            rng = random.Random(28)
            interrupted = 0
            end = time.monotonic() + 5.0
            while time.monotonic() < end and not errors:
                try:
                    armed[0] = True
                    # Mostly within the first 150 us: where the wait begins.
                    signal.setitimer(signal.ITIMER_REAL, 10 ** rng.uniform(-5.3, -3.8))
                    att.take_slot(time.monotonic() + 0.003)  # waits, then times out
                except _Interrupt:
                    interrupted += 1
                except DecodeTimeoutError:
                    pass
                except RuntimeError as exc:
                    errors.append(f"waiting thread: {exc}")
                finally:
                    armed[0] = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
                assert att.lock.acquire(timeout=5), "the handle's lock is held by nobody: deadlock"
                att.lock.release()
            stop.set()
            other.join(10)
            assert errors == [], errors[:5]
            assert interrupted > 100, interrupted
            att.give(slot, seq)
            assert client.decode([4, 5], GLB).shape == (640,)  # the handle still works
    finally:
        stop.set()
        signal.signal(signal.SIGALRM, previous)


class _Exactly:
    """An injector's choice: point ``k`` of the call, every time."""

    def __init__(self, k: int) -> None:
        self.k = k

    def random(self) -> float:
        return 0.0

    def randrange(self, lo: int, hi: int) -> int:
        return self.k


def test_an_exception_at_any_point_of_a_wait_for_the_handles_own_slot_leaves_its_lock_free(
    thread_server, shm_name
):
    """The same wait, with the exception placed at each point in turn where CPython would run a
    signal handler (in the package's code and in the standard library's it calls, Condition's
    included): after each, the handle's lock is free and nobody saw a RuntimeError."""
    thread_server(slots=2)
    with DecoderClient(shm_name, slots=1, timeout=10) as client:
        client.decode([1, 2, 3], GLB)
        att = client._att
        slot, seq = att.take_slot(time.monotonic() + 10)  # the handle's one slot, in use
        counter = soak._Injector(1.0, _Exactly(10**9))  # type: ignore[arg-type]
        try:
            counter.run(lambda: att.take_slot(time.monotonic() + 0.005), 10**9 + 1)
        except DecodeTimeoutError:
            pass
        points = counter.passed
        assert points > 20, points
        raised = 0
        for k in range(1, points + 1):
            try:
                soak._Injector(1.0, _Exactly(k)).run(  # type: ignore[arg-type]
                    lambda: att.take_slot(time.monotonic() + 0.005), points + 1)
            except soak.Injected:
                raised += 1
            except DecodeTimeoutError:
                pass  # the point came after the wait (its timeout's slice varies)
            assert not att.lock.locked(), f"point {k} of {points} left the handle's lock held"
        assert raised > points // 2, (raised, points)
        att.give(slot, seq)
        assert client.decode([4, 5], GLB).shape == (640,)
