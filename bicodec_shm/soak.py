"""``bicodec-shm soak``: a server and N client processes for a while, with random kills.

Clients send random requests drawn from a pool whose reference audio (each request decoded alone,
unpadded, in this process) is written to a file they load with numpy; every result is compared
with it (float32 within 1e-4, int16 within 1 LSB). Meanwhile clients are SIGKILLed at random and
replaced, and optionally the server too, restarted after a random pause.

Each client appends one line per event to its own log, line-buffered, so that a killed client
loses nothing already said: ``S i`` sent, ``O i`` correct, ``W i`` wrong audio, ``E i Kind``
failed with a clear error. At the end:

- *lost*: sent by a client that was not killed, and never answered (hang or silent loss);
- *killed in flight*: sent by a client that was then SIGKILLed (not an error of ours);
- *leaked slots*: slots not FREE once every client is gone and the reaper has run;
- *left in /dev/shm*: objects of the name after the server's clean stop.

Lost, wrong, leaked and left-over must all be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from .processes import serve_command, stop_server, wait_until_serving
from .transport import SlotState, leftover_objects, random_name, unlink_all


@dataclass
class SoakResult:
    seconds: float
    clients: int
    client_kills: int
    server_kills: int
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
        return self.lost == self.wrong_audio == self.leaked_slots == self.left_in_dev_shm == 0


# -- the client process ------------------------------------------------------------------


def client_main(argv: list[str]) -> int:
    """``python -m bicodec_shm.soak client NAME POOL LOG SEED STOPFILE``"""
    from .client import DecoderClient
    from .errors import BiCodecShmError

    name, pool_path, log_path, seed, stop_file = argv
    pool = np.load(pool_path)
    count = len([k for k in pool.files if k.startswith("sem_")])
    rng = random.Random(int(seed))
    with open(log_path, "a", buffering=1) as log, DecoderClient(
        name, slots=2, timeout=30, connect_timeout=60
    ) as client:
        while not os.path.exists(stop_file):
            i = rng.randrange(count)
            dtype = rng.choice(["int16", "float32"])
            log.write(f"S {i}\n")
            try:
                pcm = client.decode(pool[f"sem_{i}"], pool[f"glb_{i}"], dtype=dtype)
            except BiCodecShmError as exc:
                log.write(f"E {i} {type(exc).__name__}\n")
                continue
            ref = pool[f"ref_{i}"]
            if dtype == "int16":
                expected = (np.clip(ref, -1, 1) * 32767).astype(np.int16).astype(np.int32)
                good = pcm.shape == ref.shape and np.abs(pcm.astype(np.int32) - expected).max() <= 1
            else:
                good = pcm.shape == ref.shape and float(np.abs(pcm - ref).max()) <= 1e-4
            log.write(f"{'O' if good else 'W'} {i}\n")
    return 0


# -- the orchestrator --------------------------------------------------------------------


def make_pool(path: str, *, preset: str, seed: int, size: int, max_len: int) -> None:
    """Random requests and their lone, unpadded decodes (the ground truth)."""
    import torch

    from .model import BiCodecDecoder

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
    make_pool(pool, preset=args.preset, seed=args.seed, size=args.pool, max_len=args.max_len)
    rng = random.Random(args.seed)
    server_cmd = serve_command(name, "--preset", args.preset, "--seed", str(args.seed),
                               "--slots", str(args.slots), "--threads", "1",
                               "--max-tokens", str(args.max_len))  # fmt: skip
    logs: list[tuple[str, bool]] = []  # (log path, was killed)
    clients: dict[int, tuple[subprocess.Popen, str]] = {}
    kills = server_kills = 0
    server = _start(server_cmd)
    wait_until_serving(name, server)

    def spawn(k: int) -> None:
        log = os.path.join(work, f"client-{len(logs)}.log")
        cmd = [sys.executable, "-m", "bicodec_shm.soak", "client", name, pool, log,
               str(rng.randrange(2**31)), stop_file]  # fmt: skip
        clients[k] = (subprocess.Popen(cmd), log)

    try:
        for k in range(args.clients):
            spawn(k)
            logs.append((clients[k][1], False))
        t0 = time.monotonic()
        never = float("inf")
        next_client_kill = t0 + rng.uniform(0.2, 2 * args.kill_every) if args.kill_every else never
        server_every = args.kill_server_every
        next_server_kill = t0 + rng.uniform(0.5, 1.5) * server_every if server_every else never
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
                if now >= next_server_kill:
                    server.kill()
                    server.wait()
                    server_kills += 1
                    time.sleep(rng.uniform(0.0, 2.0))  # clients must wait, then resubmit
                    server = _start(server_cmd)
                    wait_until_serving(name, server)
                    next_server_kill = time.monotonic() + rng.uniform(0.5, 1.5) * args.kill_server_every
                time.sleep(0.05)
                elapsed = min(int(time.monotonic() - t0), int(args.duration))
                if elapsed > bar.n:
                    bar.update(elapsed - bar.n)
        open(stop_file, "w").close()
        hung = 0
        for proc, _ in clients.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                hung += 1
                proc.kill()
                proc.wait()
        leaked = _leaked_slots(name, wait=2.0)
    finally:
        for proc, _ in clients.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stop_server(server)
    left = len(leftover_objects(name))
    unlink_all(name)
    result = _tally(logs, args, kills, server_kills, leaked, left, time.monotonic() - t0)
    shutil.rmtree(work, ignore_errors=True)
    return result


def _tally(logs, args, kills, server_kills, leaked, left, seconds) -> SoakResult:
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
        server_kills=server_kills, sent=sent, correct=correct, failed_clearly=failed,
        killed_in_flight=killed_in_flight, lost=lost, wrong_audio=wrong, leaked_slots=leaked,
        left_in_dev_shm=left, errors_by_kind=kinds,
    )  # fmt: skip


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


def _leaked_slots(name: str, wait: float) -> int:
    """Slots still owned once every client has exited and the reaper had ``wait`` seconds."""
    from .transport import Segment

    deadline = time.monotonic() + wait
    with Segment.attach(name) as seg:
        while True:
            busy = int((seg.slots["state"] != SlotState.FREE).sum())
            if busy == 0 or time.monotonic() >= deadline:
                return busy
            time.sleep(0.05)


def format_result(r: SoakResult) -> str:
    rows = [
        ("duration", f"{r.seconds:.0f} s"),
        ("client processes", r.clients),
        ("client kills (SIGKILL)", r.client_kills),
        ("server kills (SIGKILL)", r.server_kills),
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kill-every", type=float, default=1.0,
                   help="mean seconds between client kills (0: none)")  # fmt: skip
    p.add_argument("--kill-server-every", type=float, default=0.0,
                   help="mean seconds between server kills (0: none)")  # fmt: skip
    p.add_argument("--preset", default="tiny", choices=("tiny", "spark-tts-0.5b"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--pool", type=int, default=48, help="distinct requests with references")
    p.add_argument("--max-len", type=int, default=150, help="longest request in tokens")
    p.add_argument("--json", default=None, metavar="PATH")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    p = argparse.ArgumentParser(prog="bicodec-shm soak", description=__doc__.splitlines()[0])
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
