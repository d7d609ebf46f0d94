"""SIGINT and SIGTERM reach a `bicodec-shm serve` at any moment of its life, start-up included:
it exits promptly and leaves nothing in /dev/shm. And a server that does not stop can say where
it is (SIGUSR1 prints every thread's stack).

Real server processes, started with SIGINT at its default whatever this test run inherited (a
run started as a background job has it ignored, which the server would rightly keep).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import BiCodecShmError
from bicodec_shm.protocol.names import ServerState, leftover_objects, probe, reserve_name

PROMPT = 20.0  # seconds to exit after the signal (it takes 1-3 s on a loaded 2-core machine)
_LAUNCH = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.{}); "
           "runpy.run_module('bicodec_shm', run_name='__main__', alter_sys=True)")  # fmt: skip
SIGINT_DEFAULT = _LAUNCH.format("default_int_handler")
SIGINT_IGNORED = _LAUNCH.format("SIG_IGN")


def _serve(name: str, log, launcher: str = SIGINT_DEFAULT) -> subprocess.Popen:
    # SIGINT at its default across the exec, as from a terminal: a test run started in the
    # background (``cmd &``) ignores SIGINT, its children would inherit that, and a SIGINT sent
    # before the launcher sets its handler would be ignored, as in any background job.
    return subprocess.Popen([sys.executable, "-c", launcher, "serve", "--name", name, "--preset", "tiny",
                             "--threads", "1"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=_sigint_default)  # fmt: skip


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait(condition, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the server exited ({proc.returncode}) before the moment came"
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.002)


def _stop_and_read(proc: subprocess.Popen, log) -> str:
    """Kill the server if it still runs; what it wrote to ``log`` (then closed)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.seek(0)
    said = log.read()
    log.close()
    return said


def _load(name: str, stop: threading.Event) -> None:
    """Requests in flight until ``stop`` (they may fail once the server stops: that is fine)."""
    try:
        with DecoderClient(name, slots=2, timeout=10, connect_timeout=60) as client:
            while not stop.is_set():
                client.decode(list(range(1, 40)), [0] * 32)
    except BiCodecShmError:
        pass


def _execed(pid: int) -> bool:
    """Whether ``pid`` runs the launcher already (its command line is no longer ours)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"runpy" in f.read()
    except OSError:
        return False


MOMENTS = ("interpreter starting", "name reserved", "serving", "serving under load", "random")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_stop_signal_at_any_moment_stops_the_server_promptly_and_leaves_nothing(shm_name, tmp_path, sig,
                                                                                 moment):  # fmt: skip
    rng = random.Random()
    delay = rng.uniform(0.0, 6.0)
    log = open(tmp_path / "serve.log", "w+")
    proc = _serve(shm_name, log)
    stop_load = threading.Event()
    loader = None
    try:
        if moment == "interpreter starting":
            # After the exec: a signal between the fork and the exec reaches the forked copy of
            # this process, whose handler only sets a flag that the exec then discards.
            _wait(lambda: _execed(proc.pid), proc)
        elif moment == "name reserved":  # the model loads now; the name is ours already
            _wait(lambda: leftover_objects(shm_name), proc)
        elif moment.startswith("serving"):
            _wait(lambda: probe(shm_name) is ServerState.SERVING, proc)
            if moment == "serving under load":
                loader = threading.Thread(target=_load, args=(shm_name, stop_load))
                loader.start()
                time.sleep(0.5)
        elif moment == "random":
            time.sleep(delay)  # anywhere from the interpreter's start to serving
        sent = time.monotonic()
        proc.send_signal(sig)
        try:
            code = proc.wait(PROMPT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # where it is, into the log
            time.sleep(2)
            code = None
        took = time.monotonic() - sent
    finally:
        stop_load.set()
        if loader is not None:
            loader.join(30)
        said = _stop_and_read(proc, log)[-4000:]
    where = f"{signal.Signals(sig).name} at {moment!r} (random delay {delay:.2f} s):\n{said}"
    assert code is not None, f"not stopped {PROMPT:g} s after {where}"
    assert leftover_objects(shm_name) == [], f"objects left after {where}"
    # Once it owns the name, a stop signal is a clean stop (SIGTERM's default action would kill
    # it where it stood): 0 once serving, 130 (Ctrl-C) or 143 (SIGTERM) while starting.
    clean = {0, 128 + sig}
    if moment in ("interpreter starting", "random"):
        clean |= {-sig}  # before Python's own handlers (or ours) were set up: nothing was made
    assert code in clean, f"exit code {code} after {where}"
    assert took < PROMPT, where


# A launcher whose `import torch` is signalled as it begins, and says when it ended.
_SIGNAL_IN_TORCH_IMPORT = """
import importlib.abc, importlib.util, os, runpy, signal, sys

class SignalAtTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        run = spec.loader.exec_module

        def exec_module(module):
            os.kill(os.getpid(), signal.SIG{sig})
            run(module)
            print("torch imported", file=sys.stderr, flush=True)
        spec.loader.exec_module = exec_module
        return spec

signal.signal(signal.SIGINT, signal.default_int_handler)
sys.meta_path.insert(0, SignalAtTorch())
runpy.run_module("bicodec_shm", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_stop_signal_while_torch_imports_is_held_until_the_import_ends(shm_name, tmp_path, sig):
    """No stop signal raises inside torch's import: torch runs Python inside C++ callbacks there,
    and the exception a handler raises in one ends the process in ``std::terminate``, past every
    clean-up (a reserved name was once left behind so). The signal is recorded, the import
    finishes, and the start-up then stops cleanly: 130 or 143, nothing left."""
    log = open(tmp_path / "serve.log", "w+")
    proc = _serve(shm_name, log, _SIGNAL_IN_TORCH_IMPORT.format(sig=sig))
    try:
        code = proc.wait(120)
    finally:
        said = _stop_and_read(proc, log)
    assert leftover_objects(shm_name) == [], said
    assert "torch imported" in said, said  # the signal did not cut torch's import short
    assert f"received SIG{sig} while starting: stopping" in said, said
    assert code == 128 + getattr(signal, f"SIG{sig}"), said


def test_a_server_started_with_sigint_ignored_says_so_and_stops_on_sigterm(shm_name, tmp_path):
    log = open(tmp_path / "serve.log", "w+")
    proc = _serve(shm_name, log, SIGINT_IGNORED)
    try:
        _wait(lambda: probe(shm_name) is ServerState.SERVING, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None and probe(shm_name) is ServerState.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(PROMPT) == 0
    finally:
        said = _stop_and_read(proc, log)
    assert "SIGINT is ignored here, as in a background job: stop it with SIGTERM" in said, said
    assert leftover_objects(shm_name) == []


def test_sigusr1_prints_where_every_thread_of_a_serving_server_is(shm_name, tmp_path):
    path = tmp_path / "serve.log"
    log = open(path, "w+")
    proc = _serve(shm_name, log)
    try:
        _wait(lambda: probe(shm_name) is ServerState.SERVING, proc)
        time.sleep(0.5)  # into serve_forever
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while "serve_forever" not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and probe(shm_name) is ServerState.SERVING  # it only printed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(PROMPT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    said = path.read_text()
    assert "Current thread" in said and 'File "' in said and "serve_forever" in said, said
    assert leftover_objects(shm_name) == []


def test_a_ctrl_c_while_the_server_announces_itself_unlinks_what_it_made(shm_name, monkeypatch):
    """From Python: a KeyboardInterrupt anywhere after the segment exists (here while the
    start-up line is logged) leaves nothing behind."""
    from support import reference_model

    from bicodec_shm.server import server as server_module

    def interrupted(message, *args, **kwargs):
        if message.startswith("serving %r"):
            raise KeyboardInterrupt
    monkeypatch.setattr(server_module.log, "info", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server_module.DecoderServer(reference_model(), shm_name, slots=2)
    assert leftover_objects(shm_name) == []


def test_the_start_up_s_signal_handling_is_restored_afterwards():
    """``StartupSignals`` leaves the process's handlers as it found them."""
    from bicodec_shm.server.signals import StartupSignals

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StartupSignals():
        assert signal.getsignal(signal.SIGTERM) is not before[0]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert os.getpid()  # (in the main thread: handlers were really installed above)


def test_an_interrupt_between_creating_the_name_and_reserving_it_leaves_nothing(shm_name, monkeypatch):
    """A Ctrl-C (or a start-up's SIGTERM, raised by its handler) that lands right after the
    name's file was created, before ``reserve_name`` returned it: no file, no descriptor."""
    from bicodec_shm.protocol import locks, names

    real = names.try_lock
    calls = []

    def interrupted(fd, byte):
        calls.append(byte)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(fd, byte)

    monkeypatch.setattr(names, "try_lock", interrupted)
    before = set(locks._lock_fds)
    with pytest.raises(KeyboardInterrupt):
        names.reserve_name(shm_name)
    assert calls and leftover_objects(shm_name) == []
    assert set(locks._lock_fds) == before


def test_a_server_that_fails_before_its_segment_releases_the_reserved_name(shm_name):
    """A name reserved while the model loaded is released when the server's construction fails
    before the segment takes it over: nothing is left, and the name can be reserved again."""
    from support import reference_model

    from bicodec_shm.server.server import DecoderServer

    reserved = reserve_name(shm_name)
    with pytest.raises(ValueError, match="max_batch"):
        DecoderServer(reference_model(), shm_name, max_batch=0, reserved=reserved)
    assert leftover_objects(shm_name) == []
    DecoderServer(reference_model(), shm_name).close()
