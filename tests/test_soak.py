"""The chaos test: short soaks in CI with every fault at once (the defaults of `bicodec-shm
soak`), on a random seed that a failure prints; nothing lost, wrong, hung or leaked.

The defaults include exceptions at random bytecodes of the package's code in every caller
thread, a handle shared by three synchronous threads and two asyncio calls, handles attached and
closed in a loop by another thread, and forks (every ~50 ms per client) while all of that runs."""

from __future__ import annotations

import json
import os
import random
import re
import sys

import pytest

from bicodec_shm.tools.cli import main


def _chaos(tmp_path, capsys, seed: int, *extra: str) -> dict:
    out = tmp_path / "soak.json"
    rc = main(["soak", "--clients", "6", "--kill-every", "1.5", "--seed", str(seed),
               "--json", str(out), *extra])  # fmt: skip
    printed = capsys.readouterr().out
    # A soak that stops early writes no JSON: say the seed that reruns it, and what it printed.
    rerun = f"chaos seed {seed} (rerun: bicodec-shm soak --seed {seed} {' '.join(extra)})"
    assert out.exists(), f"{rerun}: the soak stopped early (rc {rc})\n{printed}"
    result = json.loads(out.read_text())
    # The seed decides the weights and the whole fault schedule: rerun a failure with it.
    assert rc == 0, f"chaos seed {seed} (rerun: bicodec-shm soak --seed {seed} {' '.join(extra)})\n{printed}"
    assert result["lost"] == result["timed_out"] == result["wrong_audio"] == 0, f"seed {seed}"
    assert result["undocumented_errors"] == result["unlocked_owned"] == 0, f"seed {seed}"
    assert result["fresh_client_failures"] == 0, f"seed {seed}"
    assert result["leaked_slots"] == 0 and result["left_in_dev_shm"] == 0, f"seed {seed}"
    assert result["hung_clients"] == result["hung_threads"] == result["hung_forks"] == 0, f"seed {seed}"
    # Every fault of the mix happened: exceptions at random bytecodes, cancellations, and many
    # forks while other threads attached and closed.
    kinds = result["errors_by_kind"]
    assert kinds.get("Injected", 0) > 0 and kinds.get("CancelledError", 0) > 0, kinds
    assert result["forks"] > 100, result["forks"]
    return result


@pytest.mark.slow
def test_chaos_every_answer_is_the_requests_own_under_every_fault_at_once(tmp_path, capsys):
    """Random closes with calls in flight, SIGKILL and SIGSTOP of clients and the server,
    rolling restarts, forks while threads attach and close, exceptions at random bytecodes in
    threads that share a handle, cancelled asyncio calls, KeyboardInterrupt inside decode() and
    garbage submit times, all at once; every answer is compared with the request's lone decode,
    and afterwards a fresh client in another process still gets a slot and its own audio."""
    seed = int(os.environ.get("BICODEC_SHM_CHAOS_SEED", random.randrange(2**31)))
    result = _chaos(tmp_path, capsys, seed, "--duration", "40")
    assert result["client_kills"] > 0 and result["server_kills"] + result["server_term_restarts"] >= 1
    assert result["client_forks"] >= 1 and result["client_closes"] >= 1
    assert result["correct"] > 50


@pytest.mark.slow
def test_chaos_with_a_server_group_whose_members_die(tmp_path, capsys):
    seed = int(os.environ.get("BICODEC_SHM_CHAOS_SEED", random.randrange(2**31)))
    result = _chaos(tmp_path, capsys, seed, "--group", "--duration", "20", "--kill-server-every", "7",
                    "--term-server-every", "0")  # fmt: skip
    assert result["server_kills"] >= 1 and result["correct"] > 30


@pytest.mark.slow
def test_chaos_with_the_segment_handed_over_its_socket(tmp_path, capsys):
    """The whole fault mix against a server started with ``--mode 0o660``: the memfd handed over
    NAME.sock, semaphores inside it, liveness by the connection, across kills and restarts."""
    seed = int(os.environ.get("BICODEC_SHM_CHAOS_SEED", random.randrange(2**31)))
    result = _chaos(tmp_path, capsys, seed, "--mode", "0o660", "--duration", "20", "--kill-server-every", "7")
    assert result["server_kills"] + result["server_term_restarts"] >= 1 and result["correct"] > 30


def test_soak_help_shows_every_default_and_the_defaults_are_the_full_fault_mix(capsys):
    with pytest.raises(SystemExit):
        main(["soak", "--help"])
    options = " ".join(capsys.readouterr().out.split("options:")[1].split())  # argparse wraps lines
    shown = dict(re.findall(r"(--[a-z-]+) [A-Z_]+ [^(]*(?:\([^d][^)]*\) )*\(default: ([^)]*)\)", options))
    assert shown == {"--duration": "60.0", "--clients": "8", "--kill-every": "1.0",
                     "--kill-server-every": "20.0", "--term-server-every": "15.0",
                     "--fork-every": "4.0", "--close-every": "5.0", "--stop-every": "8.0",
                     "--interrupt-share": "0.03", "--garbage-share": "0.03", "--inject-share": "0.1",
                     "--cancel-share": "0.05", "--threads": "3", "--async-calls": "12", "--churn": "1",
                     "--handle-slots": "3", "--small-server-share": "0.5", "--small-slots": "16",
                     "--oversize-share": "0.05",
                     "--bare-fork-every": "0.05", "--think-ms": "5.0", "--call-timeout": "60.0",
                     "--stop-grace": "5.0",
                     "--seed": "0", "--slots": "64", "--pool": "48",
                     "--max-len": "150", "--json": "None"}  # fmt: skip
    assert "the server's architecture (random weights) (default: tiny)" in options


# -- the soak's own instruments ------------------------------------------------------------------


def _package_file(soak) -> str:
    """A file name in the package outside the soak's folder (which the injector leaves alone)."""
    return os.path.join(os.path.dirname(os.path.dirname(soak.__file__)), "attachment.py")


def test_injected_exceptions_land_only_where_cpython_runs_signal_handlers_and_reach_every_one():
    """The injector raises at each of its points in turn: a ``with lock`` block is left locked
    by none (CPython delivers no exception between a block's last statement and its
    ``__exit__``), and every point, through the block and after it, is reached."""
    import threading

    from bicodec_shm.tools import soak

    lock, books = threading.Lock(), {}

    def step(slot: int) -> int:  # compiled as if it were the package's: see below
        with lock:
            books[slot] = len(books)
            books.pop(slot)
        for _ in range(2):
            pass
        return slot

    step.__code__ = step.__code__.replace(co_filename=_package_file(soak))

    class Exactly:  # picks point k, then never
        def __init__(self, k: int) -> None:
            self.k = k

        def random(self) -> float:
            return 0.0

        def randrange(self, lo: int, hi: int) -> int:
            return self.k

    raised = 0
    for k in range(1, 20):
        injector = soak._Injector(1.0, Exactly(k))  # type: ignore[arg-type]
        try:
            assert injector.run(lambda: step(7), 100) == 7
        except soak.Injected:
            raised += 1
        assert not lock.locked(), f"point {k} left the lock held"
        assert books == {}
    # Entry; after len(), books.pop() and __exit__ (calls into C); after range(); two backward
    # jumps. None between the store and the pop: ``books`` never keeps the slot.
    assert raised == 7

    def failing() -> None:  # a call into C that raises inside the block
        with lock:
            books.pop("missing")

    failing.__code__ = failing.__code__.replace(co_filename=step.__code__.co_filename)
    for k in range(1, 20):
        try:
            soak._Injector(1.0, Exactly(k)).run(failing, 100)  # type: ignore[arg-type]
        except (soak.Injected, KeyError):
            pass
        # No point on the way into the block's handler (no signal is checked there): the
        # handler's __exit__ always runs.
        assert not lock.locked(), f"point {k} landed between the error and the block's __exit__"


def test_a_forked_child_that_does_not_exit_in_time_counts_as_hung(tmp_path):
    from bicodec_shm.tools import soak

    children = soak._Children(str(tmp_path / "forks.txt"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        quick, stuck = os.fork(), None
        if quick == 0:
            os._exit(0)
        stuck = os.fork()
        if stuck == 0:
            import time

            time.sleep(60)  # as a child blocked for ever in an at-fork hook
            os._exit(0)
    children.add(quick, "-", 30.0)
    children.add(stuck, "-", 0.3)
    assert children.wait() == [f"fork {stuck}"]  # killed and reaped; the quick one was not hung
    listed = (tmp_path / "forks.txt").read_text().split()
    assert listed[0] == str(quick) and listed[3] == str(stuck)


def test_timeouts_undocumented_errors_hangs_and_unlocked_slots_fail_the_soak(tmp_path):
    from bicodec_shm.tools import soak

    log = tmp_path / "client-0.log"
    log.write_text("S 1\nO 1\nS 2\nT 2\nS 3\nU 3 Gone\nS 4\nE 4 Injected\nF\nH fork 99\nX 5\nS 6\n")
    args = type("Args", (), {"clients": 1})()
    result = soak._tally([(str(log), False)], args, 0, 0, 0, 0, 0, 0, 0, 1.0)
    assert (result.sent, result.correct, result.timed_out, result.undocumented_errors) == (5, 1, 1, 1)
    assert result.undocumented_by_kind == {"Gone": 1} and result.errors_by_kind == {"Injected": 1}
    assert (result.forks, result.hung_forks, result.unlocked_owned, result.lost) == (1, 1, 1, 1)
    assert not result.ok
    clean = tmp_path / "client-1.log"
    clean.write_text("S 1\nO 1\nS 2\nE 2 ClientClosedError\nF\nS 3\nR 3 ValueError\n")
    tallied = soak._tally([(str(clean), False)], args, 0, 0, 0, 0, 0, 0, 0, 1.0)
    # A request longer than a small server holds, refused with the documented error: answered.
    assert tallied.ok and (tallied.refused_too_long, tallied.lost) == (1, 0)


def test_no_exception_is_injected_into_a_finalizer_that_the_collector_runs_during_a_call():
    """An exception in ``__del__`` never reaches a caller (Python prints and drops it), so the
    injector leaves finalizers alone; pytest turns a dropped one into a failure."""
    from bicodec_shm.tools import soak

    package_file = _package_file(soak)
    finalized = []

    class Handle:
        def __del__(self) -> None:
            finalized.append(1)
            finalized.append(len(finalized))  # points in here, if it were injected into

    Handle.__del__.__code__ = Handle.__del__.__code__.replace(co_filename=package_file)

    def step() -> None:
        Handle()  # dropped at once: its __del__ runs inside the call

    step.__code__ = step.__code__.replace(co_filename=package_file)

    class Exactly:
        def __init__(self, k: int) -> None:
            self.k = k

        def random(self) -> float:
            return 0.0

        def randrange(self, lo: int, hi: int) -> int:
            return self.k

    for k in range(1, 8):
        try:
            soak._Injector(1.0, Exactly(k)).run(step, 100)  # type: ignore[arg-type]
        except soak.Injected:
            pass
    # Every finalizer that began ran to its end (point 1, the call's entry, comes before any).
    assert finalized == [x for n in range(6) for x in (1, 2 * n + 1)]


def test_a_server_that_fails_to_start_fails_the_soak_with_what_it_printed(tmp_path):
    """A restart that exits while starting names its exit code and the end of its output (a
    chaos run once ended with only 'the server exited with code 1 while starting')."""
    from bicodec_shm.errors import BiCodecShmError
    from bicodec_shm.tools.soak import orchestrator

    failing = [sys.executable, "-c", "import sys; print('cannot create the name: it is taken', "
               "file=sys.stderr); sys.exit(1)"]  # fmt: skip
    first = orchestrator._start(failing, str(tmp_path))
    with pytest.raises(BiCodecShmError, match=r"exited with code 1 while starting; its output") as info:
        orchestrator._wait_serving(f"bcshm-never-{os.getpid()}", first)
    assert "cannot create the name: it is taken" in str(info.value)
    second = orchestrator._start(failing, str(tmp_path))
    second.wait()
    assert sorted(os.listdir(tmp_path)) == ["server-0.log", "server-1.log"]  # each server its own log
