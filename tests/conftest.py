"""Shared fixtures: randomly named segments that are always unlinked, and server processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import pytest

from bicodec_shm.deploy import processes
from bicodec_shm.protocol.names import leftover_objects, random_name, unlink_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread_for_small_models(request):
    """Run tiny-model tests on one thread: as fast as two for this size, and when another process
    holds a core, two OpenMP threads stall at every op (measured: 4 s instead of 25 ms a decode)."""
    if "full" in request.fixturenames:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A fresh segment name; everything under it is unlinked afterwards, pass or fail."""
    name = random_name("bcshm-test")
    yield name
    unlink_all(name)
    assert leftover_objects(name) == []


def wait_until_serving(name: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    processes.wait_until_serving(name, proc, timeout)


def serve_command(name: str, *extra: str) -> list[str]:
    """``bicodec-shm serve`` on the tiny model that ``support.reference_model()`` rebuilds."""
    return processes.serve_command(name, "--preset", "tiny", "--seed", "0", "--threads", "1", *extra)


@pytest.fixture
def start_server(shm_name: str) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start ``bicodec-shm serve --preset tiny`` under ``shm_name``; stopped afterwards."""
    procs: list[subprocess.Popen] = []
    # The servers' logs go to a file: a pipe nobody reads fills up and blocks the server.
    log = tempfile.TemporaryFile()

    def start(*extra: str, wait: bool = True, name: str = shm_name) -> subprocess.Popen:
        proc = subprocess.Popen(serve_command(name, *extra), cwd=ROOT, stderr=log)
        procs.append(proc)
        if wait:
            wait_until_serving(name, proc=proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGCONT)  # a test may have left it stopped
            except ProcessLookupError:
                pass
        processes.stop_server(proc, timeout=20)
    log.close()


@pytest.fixture
def thread_server(shm_name: str):
    """Start a ``DecoderServer`` in a thread of the test process (tiny model by default)."""
    from support import reference_model

    from bicodec_shm.server.server import DecoderServer

    started = []

    def start(decoder=None, **kwargs):
        server = DecoderServer(decoder or reference_model(), shm_name, **kwargs)
        started.append((server, server.start_thread()))
        return server

    yield start
    for server, thread in started:
        server.stop()
        # A stop's bound is the batches running when it comes (DecoderServer.stop), milliseconds
        # for the tests' models and a decoder whose gate the test opened: 20 s is a hang.
        thread.join(20)
        assert not thread.is_alive(), "the server thread was still alive 20 s after stop()"


@pytest.fixture(scope="session")
def unprivileged_python():
    """A ``support.UnprivilegedPython``: runs this tree's torch-free layers as uid 1000 (an
    ordinary user), wherever the virtualenv lies. Skips where none can be prepared (not root,
    no setpriv, no interpreter of this minor version that the uid may run), with the reason;
    under CI (``CI=true``) it fails instead, so that tests of an unprivileged user never
    silently stop running there."""
    from support import NoUnprivilegedPython, skip_or_fail_in_ci
    from support import prepare_unprivileged_python as prepare

    with contextlib.ExitStack() as stack:
        try:
            user = stack.enter_context(prepare())
        except NoUnprivilegedPython as why:
            skip_or_fail_in_ci(str(why))
        yield user


@pytest.fixture
def exact_math():
    """The server's CUDA math (no TF32, deterministic cuDNN), restored afterwards."""
    import torch

    from bicodec_shm.model.devices import exact_cuda_math

    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)  # fmt: skip
    exact_cuda_math()
    yield
    (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
     torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved  # fmt: skip
