"""The soak's orchestrator: the pool of requests and their references (``make_pool``), the
server and the client processes, the schedule of faults, and the checks once they stop
(``run_soak``): hung clients and forks, the fresh client, leaked slots, /dev/shm."""

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

import numpy as np

from ...deploy.processes import serve_command, stop_server, wait_until_serving
from ...errors import BiCodecShmError
from ...protocol.header import read_header
from ...protocol.layout import SlotState
from ...protocol.names import ServerState, leftover_objects, probe, random_name, unlink_all
from .client import THREAD_EXIT, _decoding_fork_exit, _start_time
from .result import SoakResult, _tally


def make_pool(path: str, *, preset: str, seed: int, size: int, max_len: int) -> None:
    """Random requests and their lone, unpadded decodes (the ground truth)."""
    import torch

    from ...model import BiCodecDecoder

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

    def server_cmd() -> list[str]:
        """The next server's command: now and then one with smaller limits (see the module)."""
        small = not args.group and rng.random() < args.small_server_share
        slots, max_tokens = (args.small_slots, small_max_tokens(args)) if small else (args.slots,
                                                                                         args.max_len)
        return serve_command(name, "--preset", args.preset, "--seed", str(args.seed),
                             "--slots", str(slots), "--threads", "1", "--max-tokens", str(max_tokens),
                             "--mode", oct(getattr(args, "mode", 0o600)),
                             *(("--device", "cpu,cpu") if args.group else ()))  # fmt: skip

    members = [f"{name}.{k}" for k in range(2)] if args.group else [name]
    logs: list[tuple[str, bool]] = []  # (log path, was killed)
    clients: dict[int, tuple[subprocess.Popen, str]] = {}
    kills = server_kills = term_restarts = forks = closes = stops = 0
    stopped: tuple[subprocess.Popen | int, float] | None = None  # (process or pid, until)
    server = _start(server_cmd(), work)
    _wait_serving(name, server)
    t0 = time.monotonic()

    def spawn(k: int) -> None:
        log = os.path.join(work, f"client-{len(logs)}.log")
        cmd = [sys.executable, "-m", "bicodec_shm.tools.soak", "client", name, pool, log,
               str(rng.randrange(2**31)), stop_file, forks_path,
               json.dumps(_client_options(args))]  # fmt: skip
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
                        server = _start(server_cmd(), work)
                        _wait_serving(name, server)
                    next_server_kill = next_time(args.kill_server_every, time.monotonic())
                if now >= next_term:
                    resume()
                    # A rolling restart: the new server starts at once and waits for the old
                    # one to finish its batch and let go of the name.
                    server.send_signal(signal.SIGTERM)
                    replacement = _start(server_cmd(), work)
                    if server.wait(60) != 0:
                        raise RuntimeError("the server did not stop cleanly on SIGTERM")
                    server = replacement
                    _wait_serving(name, server)
                    term_restarts += 1
                    next_term = next_time(args.term_server_every, time.monotonic())
                time.sleep(0.05)
                elapsed = min(int(time.monotonic() - t0), int(args.duration))
                if elapsed > bar.n:
                    bar.update(elapsed - bar.n)
        resume()
        # With every client still running (a wedged handle keeps its slots while its process
        # lives), a fresh client in another process must still get a slot and its own audio.
        fresh = _fresh_client(name, pool, args.call_timeout)
        open(stop_file, "w").close()
        hung = 0
        for proc, _ in clients.values():
            try:
                # At worst: its threads' last calls, its children, and one more call.
                proc.wait(timeout=2 * args.call_timeout + THREAD_EXIT + 30
                          + _decoding_fork_exit(args.call_timeout))
            except subprocess.TimeoutExpired:
                hung += 1
                proc.send_signal(signal.SIGQUIT)  # its threads' stacks, into its log's .stacks
                time.sleep(1.0)
                proc.kill()
                proc.wait()
        fork_logs, hung_forks = _finish_forks(forks_path, timeout=_decoding_fork_exit(args.call_timeout))
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
    result = _tally(logs, args, kills, server_kills, term_restarts, forks, hung, leaked, left,
                    time.monotonic() - t0)  # fmt: skip
    result.client_closes, result.stops = closes, stops
    result.hung_forks += hung_forks
    result.fresh_client_detail = fresh
    result.fresh_client_failures = int(fresh != "ok")
    if result.ok and not os.environ.get("BICODEC_SHM_SOAK_KEEP"):
        shutil.rmtree(work, ignore_errors=True)
    else:  # the clients' logs (and, with BICODEC_SHM_SOAK_DEBUG=1, every error's message)
        result.work_dir = work
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


def _server_pid(server: subprocess.Popen, members: list[str],
                rng: random.Random) -> subprocess.Popen | int | None:  # fmt: skip
    """The server process, or with a group one member's (its pid from its segment's header:
    the same PID namespace here)."""
    if len(members) == 1:
        return server
    header = read_header(rng.choice(members))
    return int(header["server_pid"]) if header is not None and int(header["server_pid"]) else None


def _finish_forks(forks_path: str, timeout: float) -> tuple[list[str], int]:
    """Logs of the decoding forked children, once every forked child has exited (they are not
    our children: poll); and how many did not exit within ``timeout`` (hung). Their parents
    waited for the others: this finds those that outlived a killed parent."""
    try:
        with open(forks_path) as f:
            entries = [line.split() for line in f.read().splitlines() if len(line.split()) == 3]
    except OSError:
        return [], 0
    deadline = time.monotonic() + timeout
    hung = 0
    for pid, started, _ in entries:
        while _alive(int(pid)) and _start_time(int(pid)) == started:  # that child, not a reused pid
            if time.monotonic() >= deadline:
                os.kill(int(pid), signal.SIGKILL)
                hung += 1
                break
            time.sleep(0.05)
    return [path for _, _, path in entries if path != "-"], hung


def _fresh_client(name: str, pool: str, timeout: float) -> str:
    """"ok" if a fresh client in a process of its own decodes correctly, else what it said."""
    cmd = [sys.executable, "-m", "bicodec_shm.tools.soak", "probe", name, pool, str(timeout)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        return "hung"
    if done.returncode == 0:
        return "ok"
    return (done.stdout + done.stderr).strip()[-500:] or f"exit {done.returncode}"


def small_max_tokens(args: argparse.Namespace) -> int:
    """A small server's --max-tokens: half the longest request of the pool."""
    return max(1, args.max_len // 2)


def _client_options(args: argparse.Namespace) -> dict:
    return {"handle_slots": args.handle_slots, "oversize_share": args.oversize_share,
            "small_max_tokens": small_max_tokens(args) if args.small_server_share else args.max_len,
            "interrupt_share": args.interrupt_share, "garbage_share": args.garbage_share,
            "stop_grace": args.stop_grace, "inject_share": args.inject_share,
            "cancel_share": args.cancel_share, "threads": args.threads,
            "async_calls": args.async_calls, "churn": args.churn,
            "bare_fork_every": args.bare_fork_every, "call_timeout": args.call_timeout,
            "think_ms": args.think_ms}  # fmt: skip


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


def _start(cmd: list[str], work: str) -> subprocess.Popen:
    """Start a server whose output goes to ``server-K.log`` in ``work`` (K counts the servers
    of the run), so that one that fails to start can say why (``_wait_serving``)."""
    k = sum(1 for f in os.listdir(work) if f.startswith("server-"))
    with open(os.path.join(work, f"server-{k}.log"), "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name  # type: ignore[attr-defined]
    return proc


def _wait_serving(name: str, server: subprocess.Popen) -> None:
    """``wait_until_serving``; a server that exits or hangs while starting fails the soak with
    the end of its output, which says why."""
    try:
        wait_until_serving(name, server)
    except BiCodecShmError as exc:
        with open(server.log_path, errors="replace") as f:  # type: ignore[attr-defined]
            tail = "".join(f.readlines()[-20:])
        raise BiCodecShmError(f"{exc}; its output ({server.log_path}):\n{tail}") from None


def _leaked_slots(name: str, wait: float) -> int:
    """Slots still owned, plus bells still locked, once every client has exited and the reaper
    had ``wait`` seconds."""
    from ...protocol.segment import Segment

    deadline = time.monotonic() + wait
    with Segment.attach(name) as seg:
        while True:
            busy = int((seg.slots["state"] != SlotState.FREE).sum())
            if busy == 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        held_bells = [b for b in range(seg.layout.n_slots) if not seg.try_lock_bell(b)]
    return busy + len(held_bells)
