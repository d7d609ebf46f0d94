"""``bicodec-shm soak``: a server and N client processes for a while, with random kills.

Clients send random requests drawn from a pool whose reference audio (each request decoded alone,
unpadded, in this process) is written to a file they load with numpy; every result is compared
with it (float32 within 1e-4, int16 within 1 LSB). Each client decodes from two threads at once
(synchronous calls and asyncio calls). Meanwhile, at random:

- clients are SIGKILLed and replaced;
- the server is SIGKILLed and restarted after a random pause (``--kill-server-every``);
- the server gets SIGTERM and a new one is started at once, a rolling restart
  (``--term-server-every``);
- a client forks with its asyncio thread running (``--fork-every``): the child decodes a few
  requests with the handle it inherited, then exits; its parent may be killed meanwhile;
- a client closes its handle with calls in flight and opens a new one (``--close-every``);
- a client or the server is SIGSTOPped for a moment (``--stop-every``);
- a share of synchronous calls is interrupted by a SIGALRM handler raising
  ``KeyboardInterrupt`` (``--interrupt-share``), and a share of requests carries a garbage
  submit time (``--garbage-share``: 0 or the largest u64, as a buggy or hostile client would);
- with ``--group``, the server is a group of two members: server kills hit one member (the
  supervisor restarts it), rolling restarts replace the whole group.

Each client appends one line per event to its own log, line-buffered, so that a killed client
loses nothing already said: ``S i`` sent, ``O i`` correct, ``W i`` wrong audio, ``E i Kind``
failed with a clear error. At the end:

- *lost*: sent by a client that was not killed, and never answered (hang or silent loss);
- *killed in flight*: sent by a client that was then SIGKILLed (not an error of ours);
- *leaked slots*: slots not FREE, or bells still locked, once every client is gone and the
  reaper has run;
- *left in /dev/shm*: objects of the name after the server's clean stop.

Lost, wrong, leaked and left-over must all be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..client.decoder_client import STOP_GRACE
from ..deploy.processes import serve_command, stop_server, wait_until_serving
from ..protocol.header import read_header
from ..protocol.layout import SlotState
from ..protocol.names import ServerState, leftover_objects, probe, random_name, unlink_all


@dataclass
class SoakResult:
    seconds: float
    clients: int
    client_kills: int
    server_kills: int
    server_term_restarts: int
    client_forks: int
    client_closes: int
    stops: int
    hung_clients: int
    sent: int
    correct: int
    failed_clearly: int
    killed_in_flight: int
    lost: int
    wrong_audio: int
    leaked_slots: int
    left_in_dev_shm: int
    errors_by_kind: dict

    @property
    def ok(self) -> bool:
        return (self.lost == self.wrong_audio == self.leaked_slots == self.left_in_dev_shm
                == self.hung_clients == 0)  # fmt: skip


# -- the client process ------------------------------------------------------------------


def client_main(argv: list[str]) -> int:
    """``python -m bicodec_shm.tools.soak client NAME POOL LOG SEED STOPFILE FORKS``

    SIGUSR1 asks the client to fork: the child appends "PID LOG" to the file FORKS, decodes
    ``FORK_REQUESTS`` requests with the handle it inherited, and exits.
    """
    import asyncio
    import signal
    import threading
    import warnings

    from ..client.decoder_client import DecoderClient
    from ..errors import BiCodecShmError

    name, pool_path, log_path, seed, stop_file, forks_path, interrupt_share, garbage_share, grace = argv
    interrupt_share, garbage_share, grace = float(interrupt_share), float(garbage_share), float(grace)
    with np.load(pool_path) as z:  # read it all now: a lazy NpzFile is not thread- or fork-safe
        pool = {key: z[key] for key in z.files}
    count = len([k for k in pool if k.startswith("sem_")])
    rng = random.Random(int(seed))
    fork_asked = threading.Event()
    close_asked = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: fork_asked.set())
    signal.signal(signal.SIGUSR2, lambda *_: close_asked.set())

    class Interrupted(KeyboardInterrupt):
        """Ctrl-C, as a SIGALRM handler raises it in the middle of a call."""

    def interrupt(*_: object) -> None:
        raise Interrupted()

    signal.signal(signal.SIGALRM, interrupt)
    if garbage_share:
        from ..protocol import attachment

        attachment.time = _GarbageClock(garbage_share)  # what submit() writes as t_submit_ns
    log = open(log_path, "a", buffering=1)
    log_lock = threading.Lock()

    def connect() -> DecoderClient:
        return DecoderClient(name, slots=3, timeout=60, connect_timeout=60, stop_grace=grace)

    handle = [connect()]  # replaced on close

    def note(line: str) -> None:
        with log_lock:
            log.write(line + "\n")

    def check(i: int, pcm: np.ndarray, dtype: str) -> bool:
        ref = pool[f"ref_{i}"]
        if pcm.shape != ref.shape:
            return False
        if dtype == "int16":
            expected = (np.clip(ref, -1, 1) * 32767).astype(np.int16).astype(np.int32)
            return int(np.abs(pcm.astype(np.int32) - expected).max()) <= 1
        return float(np.abs(pcm - ref).max()) <= 1e-4

    def failed(i: int, exc: BaseException, how: str) -> None:
        note(f"E {i} {type(exc).__name__}")
        if os.environ.get("BICODEC_SHM_SOAK_DEBUG"):  # each message too, for a failure's cause
            with open(log_path + ".errors", "a") as f:
                f.write(f"{time.monotonic():.3f} {how} {exc}\n")

    def one_sync(r: random.Random) -> None:
        i, dtype = r.randrange(count), r.choice(["int16", "float32"])
        note(f"S {i}")
        try:
            if r.random() < interrupt_share:
                signal.setitimer(signal.ITIMER_REAL, r.uniform(0.0, 0.05))
            pcm = handle[0].decode(pool[f"sem_{i}"], pool[f"glb_{i}"], dtype=dtype)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except (BiCodecShmError, Interrupted) as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
            failed(i, exc, "sync")
            return
        note(f"{'O' if check(i, pcm, dtype) else 'W'} {i}")

    def async_thread() -> None:
        r = random.Random(rng.random())

        async def one() -> None:
            i, dtype = r.randrange(count), r.choice(["int16", "float32"])
            note(f"S {i}")
            try:
                pcm = await handle[0].decode_async(pool[f"sem_{i}"], pool[f"glb_{i}"], dtype=dtype)
            except BiCodecShmError as exc:
                failed(i, exc, "async")
                return
            note(f"{'O' if check(i, pcm, dtype) else 'W'} {i}")

        async def loop() -> None:
            while not os.path.exists(stop_file):
                await one()

        asyncio.run(loop())

    helper = threading.Thread(target=async_thread, daemon=True)
    helper.start()
    while not os.path.exists(stop_file):
        if close_asked.is_set():  # close with the async thread's calls in flight, then reopen
            close_asked.clear()
            old, handle[0] = handle[0], connect()
            old.close()
        if fork_asked.is_set():
            fork_asked.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the point
                pid = os.fork()
            if pid == 0:  # the child: the inherited handle, this thread only
                log.close()
                log = open(f"{log_path}.fork{os.getpid()}", "a", buffering=1)
                log_lock = threading.Lock()
                with open(forks_path, "a") as forks:
                    forks.write(f"{os.getpid()} {log.name}\n")
                child_rng = random.Random(os.getpid())
                for _ in range(FORK_REQUESTS):
                    if os.path.exists(stop_file):
                        break
                    one_sync(child_rng)
                handle[0].close()
                log.close()
                os._exit(0)
        one_sync(rng)
    helper.join(90)
    handle[0].close()
    log.close()
    return 0


class _GarbageClock:
    """``time`` for attachment.py, except that a share of submit times is garbage."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.monotonic = time.monotonic

    def monotonic_ns(self) -> int:
        if random.random() < self.share:
            return random.choice((0, 2**64 - 1))
        return time.monotonic_ns()


FORK_REQUESTS = 20


# -- the orchestrator --------------------------------------------------------------------


def make_pool(path: str, *, preset: str, seed: int, size: int, max_len: int) -> None:
    """Random requests and their lone, unpadded decodes (the ground truth)."""
    import torch

    from ..model import BiCodecDecoder

    model = BiCodecDecoder.from_config(preset, seed=seed)
    rng = np.random.default_rng(seed)
    arrays = {}
    for i in range(size):
        sem = rng.integers(0, 8192, int(rng.integers(1, max_len + 1)))
        glb = rng.integers(0, 4096, 32)
        ref = model.detokenize(torch.as_tensor(sem)[None], torch.as_tensor(glb)[None])[0]
        arrays[f"sem_{i}"], arrays[f"glb_{i}"], arrays[f"ref_{i}"] = sem, glb, ref.numpy()
    np.savez(path, **arrays)


def run_soak(args: argparse.Namespace) -> SoakResult:
    from tqdm import tqdm

    name = random_name("bcshm-soak")
    work = tempfile.mkdtemp(prefix="bicodec-soak-")
    pool = os.path.join(work, "pool.npz")
    stop_file = os.path.join(work, "stop")
    forks_path = os.path.join(work, "forks.txt")
    make_pool(pool, preset=args.preset, seed=args.seed, size=args.pool, max_len=args.max_len)
    rng = random.Random(args.seed)
    server_cmd = serve_command(name, "--preset", args.preset, "--seed", str(args.seed),
                               "--slots", str(args.slots), "--threads", "1",
                               "--max-tokens", str(args.max_len),
                               *(("--device", "cpu,cpu") if args.group else ()))  # fmt: skip
    members = [f"{name}.{k}" for k in range(2)] if args.group else [name]
    logs: list[tuple[str, bool]] = []  # (log path, was killed)
    clients: dict[int, tuple[subprocess.Popen, str]] = {}
    kills = server_kills = term_restarts = forks = closes = stops = 0
    stopped: tuple[subprocess.Popen | int, float] | None = None  # (process or pid, until)
    server = _start(server_cmd)
    wait_until_serving(name, server)
    t0 = time.monotonic()

    def spawn(k: int) -> None:
        log = os.path.join(work, f"client-{len(logs)}.log")
        cmd = [sys.executable, "-m", "bicodec_shm.tools.soak", "client", name, pool, log,
               str(rng.randrange(2**31)), stop_file, forks_path, str(args.interrupt_share),
               str(args.garbage_share), str(args.stop_grace)]  # fmt: skip
        clients[k] = (subprocess.Popen(cmd), log)

    def next_time(every: float, now: float) -> float:
        return now + rng.uniform(0.5, 1.5) * every if every else float("inf")

    try:
        for k in range(args.clients):
            spawn(k)
            logs.append((clients[k][1], False))
        t0 = time.monotonic()
        next_client_kill = t0 + rng.uniform(0.2, 2 * args.kill_every) if args.kill_every else float("inf")
        next_server_kill = next_time(args.kill_server_every, t0)
        next_term = next_time(args.term_server_every, t0)
        next_fork = next_time(args.fork_every, t0)
        next_close = next_time(args.close_every, t0)
        next_stop = next_time(args.stop_every, t0)

        def resume() -> None:
            nonlocal stopped
            if stopped is not None:
                _signal(stopped[0], signal.SIGCONT)
                stopped = None

        with tqdm(total=int(args.duration), desc="soak", unit="s", file=sys.stderr) as bar:
            while (now := time.monotonic()) < t0 + args.duration:
                if now >= next_client_kill:
                    k = rng.randrange(args.clients)
                    proc, log = clients[k]
                    proc.kill()
                    proc.wait()
                    logs[[p for p, _ in logs].index(log)] = (log, True)
                    kills += 1
                    spawn(k)
                    logs.append((clients[k][1], False))
                    next_client_kill = now + rng.uniform(0.1, 2 * args.kill_every)
                if stopped is not None and now >= stopped[1]:
                    resume()
                if now >= next_close:
                    closes += _signal(clients[rng.randrange(args.clients)][0], signal.SIGUSR2)
                    next_close = next_time(args.close_every, now)
                if now >= next_stop and stopped is None:
                    # A client, or the server (a member of a group), frozen for a moment.
                    target = (clients[rng.randrange(args.clients)][0] if rng.random() < 0.5
                              else _server_pid(server, members, rng))  # fmt: skip
                    if target is not None and _signal(target, signal.SIGSTOP):
                        stopped = (target, now + rng.uniform(0.2, 1.5))
                        stops += 1
                    next_stop = next_time(args.stop_every, now)
                if now >= next_fork:
                    forks += _signal(clients[rng.randrange(args.clients)][0], signal.SIGUSR1)
                    next_fork = next_time(args.fork_every, now)
                if now >= next_server_kill:
                    resume()
                    if args.group:  # one member dies; its supervisor restarts it
                        member = _server_pid(server, members, rng)
                        if member is not None and _signal(member, signal.SIGKILL):
                            server_kills += 1
                    else:
                        server.kill()
                        server.wait()
                        server_kills += 1
                        time.sleep(rng.uniform(0.0, 2.0))  # clients must wait, then resubmit
                        server = _start(server_cmd)
                        wait_until_serving(name, server)
                    next_server_kill = next_time(args.kill_server_every, time.monotonic())
                if now >= next_term:
                    resume()
                    # A rolling restart: the new server starts at once and waits for the old
                    # one to finish its batch and let go of the name.
                    server.send_signal(signal.SIGTERM)
                    replacement = _start(server_cmd)
                    if server.wait(60) != 0:
                        raise RuntimeError("the server did not stop cleanly on SIGTERM")
                    server = replacement
                    wait_until_serving(name, server)
                    term_restarts += 1
                    next_term = next_time(args.term_server_every, time.monotonic())
                time.sleep(0.05)
                elapsed = min(int(time.monotonic() - t0), int(args.duration))
                if elapsed > bar.n:
                    bar.update(elapsed - bar.n)
        resume()
        open(stop_file, "w").close()
        hung = 0
        for proc, _ in clients.values():
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                hung += 1
                proc.kill()
                proc.wait()
        fork_logs, hung_forks = _finish_forks(forks_path, timeout=90)
        logs += [(path, False) for path in fork_logs]
        if args.group:  # wait for a member killed last to be back
            deadline = time.monotonic() + 60
            while not all(probe(m) is ServerState.SERVING for m in members) and time.monotonic() < deadline:
                time.sleep(0.1)
        leaked = sum(_leaked_slots(m, wait=2.0) for m in members)
    finally:
        if stopped is not None:
            _signal(stopped[0], signal.SIGCONT)
        for proc, _ in clients.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stop_server(server)
    left = sum(len(leftover_objects(n)) for n in {name, *members})
    for n in {name, *members}:
        unlink_all(n)
    result = _tally(logs, args, kills, server_kills, term_restarts, forks, hung + hung_forks,
                    leaked, left, time.monotonic() - t0)  # fmt: skip
    result.client_closes, result.stops = closes, stops
    shutil.rmtree(work, ignore_errors=True)
    return result


def _signal(target: subprocess.Popen | int, sig: int) -> bool:
    """Send ``sig`` to a process (a Popen or a pid); False if it is gone."""
    try:
        if isinstance(target, subprocess.Popen):
            if target.poll() is not None:
                return False
            target.send_signal(sig)
        else:
            os.kill(target, sig)
        return True
    except ProcessLookupError:
        return False


def _server_pid(server: subprocess.Popen, members: list[str], rng: random.Random) -> subprocess.Popen | int | None:
    """The server process, or with a group one member's (its pid from its segment's header:
    the same PID namespace here)."""
    if len(members) == 1:
        return server
    header = read_header(rng.choice(members))
    return int(header["server_pid"]) if header is not None and int(header["server_pid"]) else None


def _finish_forks(forks_path: str, timeout: float) -> tuple[list[str], int]:
    """Logs of the forked children, once they have exited (they are not our children: poll)."""
    try:
        with open(forks_path) as f:
            entries = [line.split() for line in f.read().splitlines() if line.strip()]
    except OSError:
        return [], 0
    deadline = time.monotonic() + timeout
    hung = 0
    for pid, _ in entries:
        while _alive(int(pid)):
            if time.monotonic() >= deadline:
                os.kill(int(pid), signal.SIGKILL)
                hung += 1
                break
            time.sleep(0.05)
    return [path for _, path in entries], hung


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A forked child whose parent died is reparented and reaped; one whose parent lives but
    # has not waited for it is a zombie: exited all the same.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tally(logs, args, kills, server_kills, term_restarts, forks, hung, leaked, left,
           seconds) -> SoakResult:  # fmt: skip
    sent = correct = failed = killed_in_flight = lost = wrong = 0
    kinds: dict[str, int] = {}
    for path, was_killed in logs:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        pending = 0
        for line in lines:
            tag = line[:1]
            if tag == "S":
                sent += 1
                pending += 1
                continue
            pending -= 1
            if tag == "O":
                correct += 1
            elif tag == "W":
                wrong += 1
            elif tag == "E":
                failed += 1
                kind = line.split()[-1]
                kinds[kind] = kinds.get(kind, 0) + 1
        if was_killed:
            killed_in_flight += pending
        else:
            lost += pending
    return SoakResult(
        seconds=round(seconds, 1), clients=args.clients, client_kills=kills,
        server_kills=server_kills, server_term_restarts=term_restarts, client_forks=forks,
        client_closes=0, stops=0,
        hung_clients=hung, sent=sent, correct=correct, failed_clearly=failed,
        killed_in_flight=killed_in_flight, lost=lost, wrong_audio=wrong, leaked_slots=leaked,
        left_in_dev_shm=left, errors_by_kind=kinds,
    )  # fmt: skip


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


def _leaked_slots(name: str, wait: float) -> int:
    """Slots still owned, plus bells still locked, once every client has exited and the reaper
    had ``wait`` seconds."""
    from ..protocol.segment import Segment

    deadline = time.monotonic() + wait
    with Segment.attach(name) as seg:
        while True:
            busy = int((seg.slots["state"] != SlotState.FREE).sum())
            if busy == 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        held_bells = [b for b in range(seg.layout.n_slots) if not seg.try_lock_bell(b)]
    return busy + len(held_bells)


def format_result(r: SoakResult) -> str:
    rows = [
        ("duration", f"{r.seconds:.0f} s"),
        ("client processes", r.clients),
        ("client kills (SIGKILL)", r.client_kills),
        ("server kills (SIGKILL)", r.server_kills),
        ("rolling restarts (SIGTERM)", r.server_term_restarts),
        ("client forks", r.client_forks),
        ("client closes (calls in flight)", r.client_closes),
        ("SIGSTOP/SIGCONT (client or server)", r.stops),
        ("hung clients", r.hung_clients),
        ("requests sent", r.sent),
        ("completed correctly", r.correct),
        ("failed with a clear error", f"{r.failed_clearly} {r.errors_by_kind or ''}".strip()),
        ("killed in flight", r.killed_in_flight),
        ("lost (never answered)", r.lost),
        ("wrong audio", r.wrong_audio),
        ("leaked slots", r.leaked_slots),
        ("objects left in /dev/shm", r.left_in_dev_shm),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# The defaults run the whole fault mix the README advertises, at rates that give a one-minute
# run (the default --duration) about 60 client kills, 3 server kills, 4 rolling restarts and 15
# forks: every fault happens more than once. Each mean is jittered by 0.5x to 1.5x.
DEFAULT_DURATION = 60.0
DEFAULT_KILL_EVERY = 1.0
DEFAULT_KILL_SERVER_EVERY = 20.0
DEFAULT_TERM_SERVER_EVERY = 15.0
DEFAULT_FORK_EVERY = 4.0
DEFAULT_CLOSE_EVERY = 5.0
DEFAULT_STOP_EVERY = 8.0
DEFAULT_INTERRUPT_SHARE = 0.03
DEFAULT_GARBAGE_SHARE = 0.03
HELP_FORMATTER = argparse.ArgumentDefaultsHelpFormatter  # every option's default in --help


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The soak's options; build ``p`` with ``formatter_class=HELP_FORMATTER`` to show defaults."""
    p.add_argument("--duration", type=float, default=DEFAULT_DURATION, help="seconds of faults")
    p.add_argument("--clients", type=int, default=8, help="client processes decoding at once")
    p.add_argument("--kill-every", type=float, default=DEFAULT_KILL_EVERY,
                   help="mean seconds between client SIGKILLs (0: none)")  # fmt: skip
    p.add_argument("--kill-server-every", type=float, default=DEFAULT_KILL_SERVER_EVERY,
                   help="mean seconds between server SIGKILLs, each followed by a restart (0: none)")
    p.add_argument("--term-server-every", type=float, default=DEFAULT_TERM_SERVER_EVERY,
                   help="mean seconds between rolling restarts: SIGTERM + a new server (0: none)")
    p.add_argument("--fork-every", type=float, default=DEFAULT_FORK_EVERY,
                   help="mean seconds between client forks (0: none)")  # fmt: skip
    p.add_argument("--close-every", type=float, default=DEFAULT_CLOSE_EVERY,
                   help="mean seconds between client handle closes with calls in flight (0: none)")
    p.add_argument("--stop-every", type=float, default=DEFAULT_STOP_EVERY,
                   help="mean seconds between SIGSTOPs of a client or the server (0: none)")
    p.add_argument("--interrupt-share", type=float, default=DEFAULT_INTERRUPT_SHARE,
                   help="share of synchronous calls interrupted by KeyboardInterrupt")
    p.add_argument("--garbage-share", type=float, default=DEFAULT_GARBAGE_SHARE,
                   help="share of requests with a garbage submit time")
    p.add_argument("--stop-grace", type=float, default=STOP_GRACE,
                   help="the clients' stop_grace: seconds to wait for a rolling restart's new server")
    p.add_argument("--group", action="store_true",
                   help="serve with a group of two members (server kills hit one member)")
    p.add_argument("--preset", default="tiny", choices=("tiny", "spark-tts-0.5b"),
                   help="the server's architecture (random weights)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the fault schedule")
    p.add_argument("--slots", type=int, default=64, help="the server's --slots")
    p.add_argument("--pool", type=int, default=48, help="distinct requests with references")
    p.add_argument("--max-len", type=int, default=150, help="longest request in tokens")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    p = argparse.ArgumentParser(prog="bicodec-shm soak", description=__doc__.splitlines()[0],
                                formatter_class=HELP_FORMATTER)  # fmt: skip
    add_arguments(p)
    return run_and_report(p.parse_args(argv))


def run_and_report(args: argparse.Namespace) -> int:
    result = run_soak(args)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
