"""Ground truth for tests: the tiny model decoded one item at a time, unpadded."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(TESTS, "decode_worker.py")


@functools.lru_cache(maxsize=None)
def load_script(path: str | os.PathLike[str]):
    """The Python script at ``path`` (a fixture's make-script, say) as a module, run once."""
    import importlib.util

    name = os.path.splitext(os.path.basename(os.fspath(path)))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_model(seed: int = 0):
    """The same random tiny model the test servers build (``serve --preset tiny --seed 0``)."""
    import torch

    from bicodec_shm.model import BiCodecDecoder

    torch.set_num_threads(1)
    return BiCodecDecoder.from_config("tiny", seed=seed)


def single_decode(semantic: np.ndarray, global_ids: np.ndarray) -> np.ndarray:
    """(T,), (32,) -> (320·T,) float32: one item alone, no padding, no batch."""
    import torch

    model = reference_model()
    out = model.detokenize(
        torch.as_tensor(np.asarray(semantic, np.int64))[None],
        torch.as_tensor(np.asarray(global_ids, np.int64))[None],
    )
    return out[0].numpy()


JIT_DEPRECATED = "`torch.jit.script` is deprecated"


@contextlib.contextmanager
def without_jit_deprecation() -> Iterator[None]:
    """Silence torch.jit.script's deprecation, which the reference packages trigger on import
    (snac 1.2.1 and descript-audio-codec 1.0.0 script their Snake): a DeprecationWarning on torch
    2.10-2.13, a FutureWarning from 2.14 on, so it goes by the message (warnings are errors)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", JIT_DEPRECATED)
        yield


def seed_int16(audio: np.ndarray) -> np.ndarray:
    """The seed's PCM conversion, written out independently of the package."""
    return (np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16)


def encode_clip(seed: int, i: int) -> np.ndarray:
    """Clip ``i`` of ``seed`` for the encode tests: (N,) float32 noise in [-1, 1] at 16 kHz,
    0.4 to 1 s long (20 to 50 semantic frames); torch-free, for client processes too."""
    rng = np.random.default_rng([seed, i])
    n = int(rng.integers(6400, 16000))
    return np.clip(rng.standard_normal(n) * 0.2, -1, 1).astype(np.float32)


def qwen3_clip(seed: int, i: int) -> np.ndarray:
    """Clip ``i`` of ``seed`` for the Qwen3-TTS encode tests: (N,) float32 noise at 24 kHz, 1
    sample to 0.5 s long (1 to 7 frames of 1920 samples, most ending in a partial one);
    torch-free, for client processes too."""
    rng = np.random.default_rng([seed, i, 12])
    n = int(rng.integers(1, 12000))
    return (rng.standard_normal(n) * 0.2).astype(np.float32)


@functools.lru_cache(maxsize=None)
def reference_encoder(seed: int = 0):
    """The random tiny encoder the test servers build (``serve --encode --preset tiny --seed 0``)."""
    import torch

    from bicodec_shm.model.bicodec.tokenizer import BiCodecEncoder

    torch.set_num_threads(1)
    return BiCodecEncoder.from_config("tiny", seed=seed)


def assert_lone_encode(result, clip: np.ndarray) -> None:
    """``result`` (an ``EncodedAudio``, or (semantic, global) arrays) is exactly what the
    reference encoder gives ``clip`` alone."""
    semantic, global_ids = (result.semantic_ids, result.global_ids) if hasattr(result, "codes") else result
    lone = reference_encoder().tokenize(clip[None])
    np.testing.assert_array_equal(semantic, lone.semantic_ids[0].numpy())
    np.testing.assert_array_equal(global_ids, lone.global_ids[0].numpy())


def random_request(rng: np.random.Generator, min_len: int = 5, max_len: int = 60):
    n = int(rng.integers(min_len, max_len + 1))
    return rng.integers(0, 8192, n), rng.integers(0, 4096, 32)


def seeded_request(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A request of exactly ``n`` random semantic ids and 32 global ids, from ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 8192, n), rng.integers(0, 4096, 32)


def assert_lone_int16(pcm, semantic: np.ndarray, global_ids: np.ndarray) -> None:
    """``pcm`` is int16 audio within 1 LSB of the request's own lone decode."""
    assert isinstance(pcm, np.ndarray), repr(pcm)
    assert np.abs(pcm.astype(np.int32) - seed_int16(single_decode(semantic, global_ids))).max() <= 1


def join_within(threads, within: float) -> None:
    """Join every thread within ``within`` seconds in all; fail if one still runs (a hang)."""
    deadline = time.monotonic() + within
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), "a call hung"


def check_in_forked_child(check, within: float = 120.0) -> None:
    """Fork; in the child run ``check()`` (True: pass) and exit with its verdict; assert that
    the child passed within ``within`` seconds. The parent's threads go on running in the
    parent only, as in a worker that forks while it has calls in flight.

    ``check`` must not run torch when a parent thread may be inside it (an in-process server):
    the child inherits whatever lock that thread held at fork (a static initialiser's guard),
    and waits on it forever. Compute what the child compares with before forking."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork() with threads running: that is what these tests do.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1  # an exception in check()
        try:
            code = 0 if check() else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], within)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child hung (no verdict within {within:.0f} s)")
        verdict = os.read(r, 1)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    assert verdict == b"\x00", f"the forked child failed its check (code {verdict!r})"
    assert os.waitstatus_to_exitcode(status) == 0


def client_worker_arguments(doc: str, *, dtype: str, concurrent: int):
    """The arguments every client worker script takes (decode_worker.py, snac_worker.py): NAME
    SEED N_REQUESTS OUT.npz [--dtype D] [--concurrent N]; the script adds its own."""
    import argparse

    p = argparse.ArgumentParser(description=doc)
    p.add_argument("name")
    p.add_argument("seed", type=int)
    p.add_argument("n", type=int)
    p.add_argument("out")
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--concurrent", type=int, default=concurrent, help="asyncio requests in flight")
    return p


def run_limited(calls, limit: int) -> list:
    """Run the coroutines that ``calls`` (zero-argument callables) make, at most ``limit`` at
    once, in one event loop; returns their results in order."""
    import asyncio

    async def run():
        gate = asyncio.Semaphore(limit)

        async def one(call):
            async with gate:
                return await call()

        return await asyncio.gather(*(one(call) for call in calls))

    return asyncio.run(run())


def worker_command(*args: str) -> list[str]:
    return [sys.executable, WORKER, *args]


class GatedDecoder:
    """The tiny model, except that every batch waits until the test opens ``gate`` (so that
    requests pile up, or stay in flight, for as long as a test needs)."""

    def __init__(self) -> None:
        import threading

        self.model = reference_model()
        self.device, self.config = self.model.device, self.model.config
        self.gate = threading.Event()

    def detokenize(self, *args):
        self.gate.wait(60)
        return self.model.detokenize(*args)


class SteppedDecoder:
    """The tiny model, one batch at a time under the test's control: batch i announces itself
    (``wait_entered(i + 1)`` returns) and then waits until the test has called ``step()`` i + 1
    times. So a test knows which batch is running, and what is queued behind it, without sleeps."""

    def __init__(self) -> None:
        import threading

        self.model = reference_model()
        self.device, self.config = self.model.device, self.model.config
        self.calls: list[int] = []  # rows of each batch, in order
        self._opened = 0
        self._cond = threading.Condition()

    def detokenize(self, semantic_ids, global_ids, lengths):
        with self._cond:
            index = len(self.calls)
            self.calls.append(int(semantic_ids.shape[0]))
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._opened > index, 60):
                raise RuntimeError(f"batch {index} was never let through")
        return self.model.detokenize(semantic_ids, global_ids, lengths)

    def wait_entered(self, batches: int, timeout: float = 30.0) -> None:
        """Until the ``batches``-th batch has reached the decoder; fails after ``timeout``."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= batches, timeout), self.calls

    def step(self) -> None:
        """Let the next batch through."""
        with self._cond:
            self._opened += 1
            self._cond.notify_all()


def reap(proc, timeout: float = 30.0) -> None:
    """Wait for ``proc`` (a ``subprocess.Popen``) to exit, kill it after ``timeout`` seconds,
    and close its stdout pipe."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def wait_for(predicate, timeout: float = 30.0, what: str = "a condition") -> None:
    """Poll ``predicate`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def submitted_requests(segment, server=None) -> int:
    """Requests a server holds or can read now: BUSY slots, and READY slots whose ``req.I`` is
    posted (the client's last step of a submit). Read from the shared table and semaphores.
    With ``server`` (one in this process), READY slots it confirmed (took ``req.I``) but has not
    batched yet count too: a server that batches only where it pays may leave them waiting."""
    from bicodec_shm.protocol.layout import BUSY, READY

    states = segment.slots["state"]
    ready = np.flatnonzero(states == READY).tolist()
    confirmed = server._confirmed.copy() if server is not None else {}  # one step under the GIL
    return int((states == BUSY).sum()) + sum(segment.req(slot).value > 0 or slot in confirmed
                                             for slot in ready)  # fmt: skip


def wait_submitted(segment, count: int, timeout: float = 30.0, server=None) -> None:
    """Until ``count`` requests are submitted (see ``submitted_requests``): with a gated
    decoder, the batches that run are in the decoder and every other request is queued, so
    opening the gate then lets the queued ones form a batch together."""
    wait_for(lambda: submitted_requests(segment, server) >= count, timeout,
             f"{count} submitted requests")  # fmt: skip


class ReadLog:
    """Records what a ``DecoderServer``'s dispatcher reads: the slots of every non-empty scan
    of the table (``_scan``), in order. So a test waits until the server has seen a
    request, rather than sleep and hope it has."""

    def __init__(self, server) -> None:
        import threading

        self.reads: list[list[int]] = []
        self._cond = threading.Condition()
        real = server._scan

        def recording(seg):
            waiting = real(seg)
            if waiting:  # every confirmed request waiting after this scan
                with self._cond:
                    self.reads.append([s for chunk in server._checked for s in chunk.slots.tolist()])
                    self._cond.notify_all()
            return waiting

        server._scan = recording  # the dispatcher looks it up on every scan

    def __len__(self) -> int:
        with self._cond:
            return len(self.reads)

    def wait_read(self, slots=None, since: int = 0, timeout: float = 30.0) -> bool:
        """Until a scan after the first ``since`` ones has read every slot of ``slots`` (any
        slot if None); False after ``timeout``."""
        want = None if slots is None else {int(s) for s in slots}

        def seen() -> bool:
            return any(want is None or want <= set(read) for read in self.reads[since:])

        with self._cond:
            return self._cond.wait_for(seen, timeout)


# -- ports ------------------------------------------------------------------------------------
# Choosing a port by binding port 0, closing the socket and passing the number on races every
# other process on the machine for that port. Either hand the bound socket over (bound_socket),
# or let the server bind port 0 itself and ask the kernel which port it got (listening_port).
# Only where neither is possible (Ray's ports) is a number chosen ahead (free_port), and then
# the start is retried on a clash (retry_on_port_clash).


def bound_socket(host: str = "127.0.0.1"):
    """A TCP socket bound to a free port of ``host`` (not listening), inheritable: pass its
    ``fileno()`` to the server under test (``pass_fds``), which then owns the port from the
    start. The caller closes its copy once the server has it."""
    import socket

    sock = socket.socket()
    try:
        sock.bind((host, 0))
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def listening_port(pid: int, timeout: float = 60.0, proc=None) -> int:
    """The TCP port that process ``pid`` listens on (a server told to bind port 0): waits until
    it listens; fails after ``timeout``, or at once if ``proc`` (its Popen) has exited."""
    import psutil

    found: list[int] = []

    def listens() -> bool:
        assert proc is None or proc.poll() is None, f"the server exited ({proc.returncode})"
        conns = psutil.Process(pid).net_connections(kind="tcp")
        found[:] = sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})
        return bool(found)

    wait_for(listens, timeout, f"process {pid} to listen on a TCP port")
    assert len(found) == 1, f"process {pid} listens on several ports: {found}"
    return found[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago: only for servers that can neither take a socket nor
    bind port 0 themselves, and then only under ``retry_on_port_clash``."""
    with bound_socket(host) as sock:
        return sock.getsockname()[1]


class PortClash(Exception):
    """Raised by a start that failed because another process took its port first."""


def retry_on_port_clash(start, attempts: int = 3, what: str = "the server"):
    """``start()`` (which chooses fresh ports on every call), again on ``PortClash``, at most
    ``attempts`` times; then fail saying that the ports kept being taken."""
    clashes = []
    for _ in range(attempts):
        try:
            return start()
        except PortClash as clash:
            clashes.append(str(clash))
    raise AssertionError(f"{what} could not start: another process took its port {attempts} times "
                         "between choosing and binding:\n" + "\n".join(clashes))  # fmt: skip


# -- a Python another user can run ------------------------------------------------------------
# Tests that play an ordinary user (a server or client that is not root) run a process as uid
# 1000 with ``setpriv``. That uid may reach nothing of the test run's own: the virtualenv's
# interpreter may be a link into root's 0700 home, and the tree and its site-packages may lie
# there too. So a copy is prepared that it can run: this package's tree and the torch-free
# dependencies (numpy, posix_ipc) in a fresh world-readable directory, run by an interpreter of
# the same minor version (their binary wheels are built for it) that the uid may execute.

UNPRIVILEGED_UID = 1000  # no account needed: setpriv takes numbers
TORCH_FREE_DEPENDENCIES = ("numpy", "posix_ipc")


class NoUnprivilegedPython(Exception):
    """No Python could be prepared for the other uid; the message says why."""


@dataclasses.dataclass(frozen=True)
class UnprivilegedPython:
    """Runs this package's torch-free layers as ``uid`` (an ordinary user): made by
    ``prepare_unprivileged_python``; tests take it as the ``unprivileged_python`` fixture.
    ``run("-c", CODE, ARG)`` runs Python code; ``argv("-m", "bicodec_shm", "stats", NAME)`` is
    a command line for ``subprocess``, to be run with ``env=self.env, cwd=self.home``. Torch is
    not there: a server's model needs it, its name and segment do not."""

    uid: int
    prefix: tuple[str, ...]  # setpriv ... python
    env: dict[str, str]
    home: str  # its HOME and working directory, writable by the uid

    def argv(self, *args: str) -> list[str]:
        return [*self.prefix, *args]

    def run(self, *args: str, timeout: float = 120.0, **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv(*args)`` as the uid; text output captured."""
        kwargs = {"env": self.env, "cwd": self.home, "capture_output": True, "text": True, **kwargs}
        return subprocess.run(self.argv(*args), timeout=timeout, **kwargs)


def in_ci() -> bool:
    """True where the environment says the run is CI's (``CI=true``, as most CI systems set)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_or_fail_in_ci(why: str) -> None:
    """Skip the test for ``why``; under CI fail it instead: a check CI should run but cannot
    is a broken CI, not a skip nobody reads."""
    import pytest

    if in_ci():
        pytest.fail(f"CI must run this test, but cannot: {why}", pytrace=False)
    pytest.skip(why)


def _reachable_by_others(path: str) -> bool:
    """Every directory from / down to ``path`` is searchable by other users."""
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _open_up(tree: str) -> None:
    """Directories 0755, files readable by all (executable ones by all too)."""
    for directory, _, files in os.walk(tree):
        os.chmod(directory, 0o755)
        for f in files:
            path = os.path.join(directory, f)
            mode = os.stat(path).st_mode
            os.chmod(path, 0o755 if mode & stat.S_IXUSR else 0o644)


def _copy_distribution(module: str, site_dir: str) -> None:
    """Copy every installed file of the distribution that provides ``module`` into ``site_dir``
    (its RECORD: also a wheel's vendored libraries, such as ``numpy.libs``)."""
    import importlib.metadata as md

    names = md.packages_distributions().get(module)
    if not names:
        raise NoUnprivilegedPython(f"{module} is not installed as a distribution here")
    dist = md.distribution(names[0])
    for entry in dist.files or ():
        if ".." in entry.parts:  # scripts outside site-packages (bin/f2py)
            continue
        src = str(dist.locate_file(entry))
        if os.path.isfile(src):
            dest = os.path.join(site_dir, *entry.parts)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(src, dest)


def _interpreters() -> list[str]:
    """Interpreters to try, this one first: its real file, then those of its minor version on
    the machine (binary wheels fit only those)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = [sys.executable, os.path.realpath(sys.executable), getattr(sys, "_base_executable", "")]
    found += [shutil.which(version) or "", shutil.which("python3") or ""]
    for directory in ("/usr/bin", "/usr/local/bin", "/bin"):
        found += [os.path.join(directory, version), os.path.join(directory, "python3")]
    return [p for p in dict.fromkeys(found) if p and os.path.isfile(p)]


_PROBE = """
import sys, os
want, root = tuple(map(int, sys.argv[1].split("."))), sys.argv[2]
assert sys.version_info[:2] == want, f"Python {sys.version.split()[0]}, not {sys.argv[1]}"
import bicodec_shm.protocol.segment, bicodec_shm.client
for name in ["bicodec_shm", *sys.argv[3:]]:
    where = os.path.realpath(sys.modules[name].__file__)
    assert where.startswith(root), f"{name} from {where}, not from the copy"
"""


@contextlib.contextmanager
def prepare_unprivileged_python(
    uid: int = UNPRIVILEGED_UID, modules: tuple[str, ...] = TORCH_FREE_DEPENDENCIES
) -> Iterator[UnprivilegedPython]:
    """Prepare a Python that ``uid`` may run, with this tree's ``bicodec_shm`` and ``modules``
    importable from a private copy; remove the copy afterwards. Needs root and ``setpriv``;
    raises ``NoUnprivilegedPython`` saying why where it cannot (the ``unprivileged_python``
    fixture of conftest.py skips then, or fails under CI).

        with prepare_unprivileged_python() as user:
            done = user.run("-c", "import os; print(os.getuid())")
            assert done.stdout == "1000\\n"

    The copy lies in a fresh 0755 directory under the first temporary directory that every
    user can reach (``$TMPDIR`` may be in a private home); only the package's own tree and
    ``modules`` (with everything their distributions installed) are copied, so an installed
    copy elsewhere, or the tree under test, is never what the uid imports."""
    if os.geteuid() != 0:
        raise NoUnprivilegedPython("needs root: to run a process as another uid")
    setpriv = shutil.which("setpriv") or ("/usr/bin/setpriv" if os.path.exists("/usr/bin/setpriv") else None)
    if setpriv is None:
        raise NoUnprivilegedPython("needs setpriv (util-linux) to run a process as another uid")
    bases = [b for b in dict.fromkeys([tempfile.gettempdir(), "/tmp", "/var/tmp"])
             if os.path.isdir(b) and _reachable_by_others(b)]  # fmt: skip
    if not bases:
        raise NoUnprivilegedPython("no temporary directory that other users can reach")
    top = tempfile.mkdtemp(prefix="bcshm-unpriv-", dir=bases[0])
    try:
        site_dir, home = os.path.join(top, "site"), os.path.join(top, "home")
        shutil.copytree(os.path.join(os.path.dirname(TESTS), "bicodec_shm"),
                        os.path.join(site_dir, "bicodec_shm"),
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        for module in modules:
            _copy_distribution(module, site_dir)
        os.mkdir(home)
        _open_up(top)
        os.chmod(home, 0o777)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "PYTHONPATH": site_dir,
               "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", "LC_ALL": "C.UTF-8"}  # fmt: skip
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        tried = []
        for python in _interpreters():
            prefix = (setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", python)
            user = UnprivilegedPython(uid, prefix, env, home)
            try:
                probe = user.run("-c", _PROBE, version, os.path.realpath(site_dir), *modules)
            except (OSError, subprocess.TimeoutExpired) as exc:
                tried.append(f"{python}: {exc}")
                continue
            if probe.returncode == 0:
                yield user
                return
            last = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
            tried.append(f"{python}: {last}")
        raise NoUnprivilegedPython(f"no interpreter that uid {uid} may run imports the copy in "
                                   f"{top}: " + "; ".join(tried))  # fmt: skip
    finally:
        shutil.rmtree(top, ignore_errors=True)


def plant_ready(seg, slot: int, **fields) -> None:
    """Write a READY request of 2 tokens (id 5) into ``slot`` of a segment this test serves
    itself, as a client's submit would (a valid identity at the slot's claim epoch), with
    ``fields`` (slot field -> value) over the defaults; for reading it back with
    ``slot_io.check_headers``."""
    from bicodec_shm.protocol.layout import NO_BELL, READY

    seg.tokens[slot, :2] = 5
    seg.request_id[slot] = (7, int(seg.slots["generation"][slot]), 1)
    header = {**dict(n_tokens=2, n_global=32, dtype=0, notify=NO_BELL), **fields}
    for field, value in {**header, "state": READY}.items():  # the state word last
        seg.slots[field][slot] = value


@contextlib.contextmanager
def bare_attachment(name: str, n_slots: int, max_tokens: int = 10):
    """``(segment, attachment)``: a segment that serves (no server reads it) and a client's
    attachment to it, both closed and unlinked afterwards."""
    from bicodec_shm.protocol.attachment import Attachment
    from bicodec_shm.protocol.segment import Segment

    seg = Segment.create(name, n_slots=n_slots, max_tokens=max_tokens)
    att = None
    try:
        seg.start_serving()
        att = Attachment(seg.name, max_slots=n_slots, owner_uid=None)
        yield seg, att
    finally:
        if att is not None:
            att.close(RuntimeError("test over"), wait=0)
        seg.stop_serving()
        seg.unlink()
        seg.close()
