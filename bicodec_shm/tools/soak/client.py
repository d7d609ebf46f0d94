"""The client process of the soak (``client_main``) and the fresh client of its end
(``probe_main``), each started as ``python -m bicodec_shm.tools.soak client|probe ...``, with
what they use: the log (``_Log``), the forked children and their deadlines (``_Children``), the
ownership probe, the garbage clock, and what a caller's exception counts as (``_outcome``)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import numpy as np

from .injector import Injected, Interrupted, _Injector

# Injection points (``_Injector``) that one call passes, about (measured on CPython 3.11: a warm
# decode 170, a churn cycle of attach, decode and close 510; more when a call waits or
# retries): an injection picks one of the first SPAN at random, so it lands anywhere in the
# call, its clean-ups included, and now and then past the end of a short one.
_DECODE_POINTS = 220
_CHURN_POINTS = 620
FORK_REQUESTS = 20  # a decoding child's requests, at most
FORK_SECONDS = 15.0  # a decoding child starts no request after this; its exit must follow its last call
BARE_FORK_EXIT = 20.0  # seconds a forked child may take to exit before it counts as hung
THREAD_EXIT = 30.0  # seconds a caller thread may take to finish once asked to stop, past its timeout


def _decoding_fork_exit(call_timeout: float) -> float:
    """Seconds a decoding child may take to exit: its requests' time, one call's timeout past
    it (a call that timed out ends with an error, not a hang), and slack for a loaded machine."""
    return FORK_SECONDS + call_timeout + 30.0


# What a caller may see besides audio: the documented errors, and the faults the soak itself
# raises. Anything else (an internal class, a raw posix_ipc or numpy error) is a bug.
def _outcome(exc: BaseException) -> str:
    import asyncio

    from ...errors import BiCodecShmError, DecodeTimeoutError

    if isinstance(exc, DecodeTimeoutError):
        return "T"  # a request nobody answered, or a slot nobody freed: lost
    if isinstance(exc, (BiCodecShmError, Interrupted, Injected, asyncio.CancelledError)):
        return "E"
    return "U"


def client_main(argv: list[str]) -> int:
    """``python -m bicodec_shm.tools.soak client NAME POOL LOG SEED STOPFILE FORKS OPTIONS``

    OPTIONS is a JSON object of the soak's client options (``_client_options``). One handle is
    shared by ``threads`` synchronous caller threads (this one included) and ``async_calls``
    concurrent asyncio calls in one event-loop thread; ``churn`` more threads each attach a
    handle of their own, decode once and close it, over and over. This thread also forks: on
    SIGUSR1 a child that decodes ``FORK_REQUESTS`` requests with the handle it inherited, and
    every ``bare_fork_every`` seconds (mean) a child that exits at once (its at-fork hooks ran
    while the other threads attach, decode and close). SIGUSR2 closes the shared handle with
    calls in flight and opens a new one.

    Log lines: ``S i`` sent; then ``O i`` correct, ``W i`` wrong audio, ``E i Kind`` a
    documented error, ``R i`` refused as longer than the server holds (documented), ``T i`` a
    timeout (lost), ``U i Kind`` an undocumented exception; ``F`` a fork, ``H what`` something
    hung, ``X slot`` a slot the handle owns without its lock.
    """
    import asyncio
    import faulthandler
    import signal
    import warnings

    from ...client.decoder_client import DecoderClient

    name, pool_path, log_path, seed, stop_file, forks_path, options = argv
    opt = json.loads(options)
    with np.load(pool_path) as z:  # read it all now: a lazy NpzFile is not thread- or fork-safe
        pool = {key: z[key] for key in z.files}
    count = len([k for k in pool if k.startswith("sem_")])
    rng = random.Random(int(seed))
    stopping = threading.Event()
    fork_asked = threading.Event()
    close_asked = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: fork_asked.set())
    signal.signal(signal.SIGUSR2, lambda *_: close_asked.set())
    armed = [False]  # the SIGALRM handler raises only inside a call of the main thread

    def interrupt(*_: object) -> None:
        if armed[0]:
            raise Interrupted()

    signal.signal(signal.SIGALRM, interrupt)
    # Where every thread is, for a client that hangs: the orchestrator sends SIGQUIT first.
    stacks = open(log_path + ".stacks", "a")
    faulthandler.register(signal.SIGQUIT, file=stacks, all_threads=True)
    if opt["garbage_share"]:
        from ...protocol import attachment

        attachment.time = _GarbageClock(opt["garbage_share"])  # what submit() writes as t_submit_ns
    out = _Log(log_path)
    timeout = opt["call_timeout"]

    def connect() -> DecoderClient:
        return DecoderClient(name, slots=opt["handle_slots"], timeout=timeout, connect_timeout=timeout,
                             stop_grace=opt["stop_grace"])  # fmt: skip

    handle = [connect()]  # replaced on close

    def check(i: int, pcm: np.ndarray, dtype: str) -> bool:
        ref = pool[f"ref_{i}"]
        if not isinstance(pcm, np.ndarray) or pcm.shape != ref.shape:
            return False
        if dtype == "int16":
            expected = (np.clip(ref, -1, 1) * 32767).astype(np.int16).astype(np.int32)
            return pcm.dtype == np.int16 and int(np.abs(pcm.astype(np.int32) - expected).max()) <= 1
        return pcm.dtype == np.float32 and float(np.abs(pcm - ref).max()) <= 1e-4

    def failed(i: int, exc: BaseException, how: str) -> None:
        # A request longer than a small server holds, sent to one: the documented refusal.
        too_long = isinstance(exc, ValueError) and lengths[i] > opt["small_max_tokens"]
        tag = "R" if too_long and "more than the" in str(exc) else _outcome(exc)
        out.note(f"{tag} {i}" + ("" if tag == "T" else f" {type(exc).__name__}"))
        if tag != "E" or os.environ.get("BICODEC_SHM_SOAK_DEBUG"):  # the cause, for a failure
            out.detail(f"{how}: {type(exc).__name__}: {exc}")

    lengths = [len(pool[f"sem_{i}"]) for i in range(count)]

    def pick(r: random.Random) -> tuple[int, str]:
        """A request of the pool that fits the server the shared handle is attached to (what
        its header says), or now and then (``oversize_share``) any request of the pool."""
        dtype = r.choice(["int16", "float32"])
        if r.random() < opt["oversize_share"]:
            return r.randrange(count), dtype
        try:
            limit = handle[0].get_stats().get("max_tokens") or max(lengths)
        except Exception:  # closed meanwhile (a close with calls in flight): any will do
            limit = max(lengths)
        fits = [i for i in range(count) if lengths[i] <= limit] or list(range(count))
        return r.choice(fits), dtype

    def think(r: random.Random) -> None:
        """A pause between a thread's calls, now and then: the shared handle goes quiescent
        (every slot back but the warm one) while another thread starts a call."""
        if opt["think_ms"]:
            stopping.wait(min(1.0, r.expovariate(1000 / opt["think_ms"])))

    def one_sync(r: random.Random, injector: _Injector, signals: bool) -> None:
        i, dtype = pick(r)
        out.note(f"S {i}")
        try:
            try:
                if signals and r.random() < opt["interrupt_share"]:
                    armed[0] = True
                    # From 30 us to 50 ms: in the first steps of a call as often as in its waits.
                    signal.setitimer(signal.ITIMER_REAL, 10 ** r.uniform(-4.5, -1.3))
                pcm = injector.run(lambda: handle[0].decode(pool[f"sem_{i}"], pool[f"glb_{i}"], dtype=dtype),
                                   _DECODE_POINTS)  # fmt: skip
            finally:
                armed[0] = False
                if signals:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as exc:
            failed(i, exc, "sync")
            return
        out.note(f"{'O' if check(i, pcm, dtype) else 'W'} {i}")

    def sync_thread(seed: float) -> None:
        r = random.Random(seed)
        injector = _Injector(opt["inject_share"], r)
        while not stopping.is_set():
            one_sync(r, injector, signals=False)
            think(r)

    def cycle(own: list[DecoderClient], i: int, dtype: str) -> np.ndarray:
        own.append(connect())
        pcm = own[0].decode(pool[f"sem_{i}"], pool[f"glb_{i}"], dtype=dtype)
        own[0].close()
        return pcm

    def churn_thread(seed: float) -> None:
        r = random.Random(seed)
        injector = _Injector(opt["inject_share"], r)
        while not stopping.is_set():
            i, dtype = pick(r)
            out.note(f"S {i}")
            own: list[DecoderClient] = []
            try:
                pcm = injector.run(lambda: cycle(own, i, dtype), _CHURN_POINTS)  # noqa: B023 (called at once)
            except BaseException as exc:
                failed(i, exc, "churn")
                continue
            finally:
                for c in own:
                    c.close()  # again, whole this time, if an exception cut the first one short
            out.note(f"{'O' if check(i, pcm, dtype) else 'W'} {i}")

    def async_thread(seed: float) -> None:
        r = random.Random(seed)

        async def one() -> None:
            i, dtype = pick(r)
            out.note(f"S {i}")
            call = handle[0].decode_async(pool[f"sem_{i}"], pool[f"glb_{i}"], dtype=dtype)
            task = asyncio.ensure_future(call)
            if r.random() < opt["cancel_share"]:  # a cancelled request (a client's disconnect)
                asyncio.get_running_loop().call_later(r.uniform(0.0, 0.05), task.cancel)
            try:
                pcm = await task
            except BaseException as exc:
                failed(i, exc, "async")
                return
            out.note(f"{'O' if check(i, pcm, dtype) else 'W'} {i}")

        async def caller() -> None:
            while not stopping.is_set():
                await one()
                if opt["think_ms"]:
                    await asyncio.sleep(min(1.0, r.expovariate(1000 / opt["think_ms"])))

        async def main() -> None:
            await asyncio.gather(*(caller() for _ in range(opt["async_calls"])))

        asyncio.run(main())

    def bare_fork_thread(seed: float) -> None:
        """Forks whose child exits at once: its at-fork hooks run while the other threads
        attach, decode and close (a fork that lands inside glibc's semaphore registry calls of
        another thread must not leave the child waiting forever)."""
        r = random.Random(seed)
        bare = _Children(forks_path)
        while not stopping.wait(r.expovariate(1 / opt["bare_fork_every"])):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the point
                pid = os.fork()
            if pid == 0:
                os._exit(0)
            out.note("F")
            bare.add(pid, "-", BARE_FORK_EXIT)
            for what in bare.poll():
                out.note(f"H {what}")
        for what in bare.wait():
            out.note(f"H {what}")

    def monitor_thread() -> None:
        """Every slot the shared handle owns must be locked by it (the protocol's "no two
        owners"): probed from a descriptor of our own on the same segment."""
        probe = _OwnershipProbe()
        while not stopping.wait(0.02):
            for slot in probe.unlocked_owned(handle[0]):
                out.note(f"X {slot}")
        probe.close()

    threads = [threading.Thread(target=sync_thread, args=(rng.random(),), daemon=True)
               for _ in range(opt["threads"] - 1)]  # fmt: skip
    threads += [threading.Thread(target=churn_thread, args=(rng.random(),), daemon=True)
                for _ in range(opt["churn"])]  # fmt: skip
    if opt["async_calls"]:
        threads.append(threading.Thread(target=async_thread, args=(rng.random(),), daemon=True))
    if opt["bare_fork_every"]:
        threads.append(threading.Thread(target=bare_fork_thread, args=(rng.random(),), daemon=True))
    threads.append(threading.Thread(target=monitor_thread, daemon=True))
    for t in threads:
        t.start()
    children = _Children(forks_path)
    injector = _Injector(opt["inject_share"], rng)
    while not os.path.exists(stop_file):
        if close_asked.is_set():  # close with the other threads' calls in flight, then reopen
            close_asked.clear()
            old, handle[0] = handle[0], connect()
            old.close()
        if fork_asked.is_set():
            fork_asked.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the point
                pid = os.fork()
            if pid == 0:  # the child: this thread only
                out.reopen(f"{log_path}.fork{os.getpid()}")
                child_rng = random.Random(os.getpid())
                child_injector = _Injector(opt["inject_share"], child_rng)
                until = time.monotonic() + FORK_SECONDS
                for _ in range(FORK_REQUESTS):
                    if os.path.exists(stop_file) or time.monotonic() >= until:
                        break
                    one_sync(child_rng, child_injector, signals=True)
                handle[0].close()
                out.close()
                os._exit(0)
            out.note("F")
            children.add(pid, f"{log_path}.fork{pid}", _decoding_fork_exit(timeout))
        for what in children.poll():
            out.note(f"H {what}")
        one_sync(rng, injector, signals=True)
        think(rng)
    stopping.set()
    deadline = time.monotonic() + timeout + THREAD_EXIT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            out.note(f"H thread {t.name}")
    for what in children.wait():
        out.note(f"H {what}")
    # The shared handle still works after everything above (no slot of it wedged): one more
    # call, uninterrupted.
    one_sync(rng, _Injector(0.0, rng), signals=False)
    handle[0].close()
    out.close()
    os._exit(0)  # a hung thread (noted above) must not keep the process alive


class _Log:
    """One client's log: a line per event, line-buffered (a SIGKILL loses nothing written)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.file = open(path, "a", buffering=1)

    def note(self, line: str) -> None:
        with self.lock:
            self.file.write(line + "\n")

    def detail(self, text: str) -> None:
        with self.lock, open(self.path + ".errors", "a") as f:
            f.write(f"{time.monotonic():.3f} {text}\n")

    def reopen(self, path: str) -> None:
        """In a forked child: a log of its own (the parent's lock may have been held at fork).
        The parent's file object is kept, never closed nor flushed here: another thread may
        have been writing a line into its buffer at the fork."""
        self.abandoned = self.file
        self.path, self.lock = path, threading.Lock()
        self.file = open(path, "a", buffering=1)

    def close(self) -> None:
        self.file.close()


class _Children:
    """The forked children of a client: each must exit within its time, or it counts as hung
    (then it is SIGKILLed). Each is also listed in the soak's forks file with its start time,
    so that the orchestrator finds one that outlived a killed parent."""

    def __init__(self, forks_path: str) -> None:
        self.forks_path = forks_path
        self.pending: dict[int, tuple[float, str]] = {}

    def add(self, pid: int, log: str, within: float) -> None:
        self.pending[pid] = (time.monotonic() + within, log)
        with open(self.forks_path, "a") as f:
            f.write(f"{pid} {_start_time(pid)} {log}\n")

    def poll(self) -> list[str]:
        hung = []
        for pid, (deadline, _) in list(self.pending.items()):
            done, _status = os.waitpid(pid, os.WNOHANG)
            if done:
                del self.pending[pid]
            elif time.monotonic() >= deadline:
                os.kill(pid, signal.SIGQUIT)  # its stack, into the parent log's .stacks
                time.sleep(0.5)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del self.pending[pid]
                hung.append(f"fork {pid}")
        return hung

    def wait(self) -> list[str]:
        hung = []
        while self.pending:
            hung += self.poll()
            time.sleep(0.05)
        return hung


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks (/proc: with the pid, names it despite reuse)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


class _OwnershipProbe:
    """Finds slots a handle counts as its own whose lock it does not hold.

    Probes with F_OFD_GETLK through a descriptor of its own on the segment's inode (a lock of
    the handle's open file description shows as held from any other). Reads the handle's books
    under the attachment's lock, with the mapping pinned (``use``): a slot cannot leave them,
    nor its lock drop by the protocol's own steps, while the probe looks."""

    def __init__(self) -> None:
        self.fd = -1
        self.inode: tuple[int, int] | None = None

    def unlocked_owned(self, client) -> list[int]:
        from ...errors import BiCodecShmError
        from ...protocol.attachment import Gone
        from ...protocol.layout import SLOT_BYTE0
        from ...protocol.locks import held_elsewhere

        att = getattr(client, "_att", None)
        if att is None:
            return []
        try:
            with att.use() as seg:
                st = os.fstat(seg._lock_fd)
                if self.inode != (st.st_dev, st.st_ino):
                    self.close()
                    # An open of its own of the very file the handle locks (a named segment or
                    # the memfd handed over a socket), never of whatever the name holds now.
                    self.fd = os.open(f"/proc/self/fd/{seg._lock_fd}", os.O_RDONLY)
                    self.inode = (st.st_dev, st.st_ino)
                with att.lock:
                    if att.retired is not None:
                        return []
                    return [s for s in sorted(att.owned) if not held_elsewhere(self.fd, SLOT_BYTE0 + s)]
        except (Gone, BiCodecShmError, OSError):
            return []

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.inode = -1, None


class _GarbageClock:
    """``time`` for attachment.py, except that a share of submit times is garbage."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.monotonic = time.monotonic

    def monotonic_ns(self) -> int:
        if random.random() < self.share:
            return random.choice((0, 2**64 - 1))
        return time.monotonic_ns()


def probe_main(argv: list[str]) -> int:
    """``python -m bicodec_shm.tools.soak probe NAME POOL TIMEOUT``: a fresh client in a process of
    its own decodes a few pool requests; exit 0 if every answer is the request's own, 1 if one
    is wrong, 2 if a call failed (printed)."""
    from ...client.decoder_client import DecoderClient

    name, pool_path, timeout = argv
    with np.load(pool_path) as z:
        pool = {key: z[key] for key in z.files}
    try:
        with DecoderClient(name, timeout=float(timeout), connect_timeout=float(timeout)) as client:
            limit = client.get_stats().get("max_tokens") or 10**9  # a small server's, maybe
            fits = [i for i in range(len(pool) // 3) if len(pool[f"sem_{i}"]) <= limit]
            for i in fits[:3]:
                pcm = client.decode(pool[f"sem_{i}"], pool[f"glb_{i}"], dtype="float32")
                if pcm.shape != pool[f"ref_{i}"].shape or float(np.abs(pcm - pool[f"ref_{i}"]).max()) > 1e-4:
                    print(f"request {i}: wrong audio", flush=True)
                    return 1
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        return 2
    return 0
