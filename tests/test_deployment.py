"""The ways it is deployed: containers that share IPC but not PIDs, dozens of worker processes,
workers respawned at once after a crash, workers that fork with threads running.

Real processes, real shared memory, the tiny model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, serve_command, wait_until_serving
from support import TESTS, seed_int16, single_decode, worker_command

from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import FREE
from bicodec_shm.protocol.names import ServerState, leftover_objects, probe
from bicodec_shm.protocol.segment import Segment

# A new user namespace (mapped to root in there) lets an unprivileged user make the PID namespace.
UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"]
PID_LAUNCHER = os.path.join(TESTS, "pid_launcher.py")


def _unshare_works() -> str | None:
    try:
        done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare is not available: {exc}"
    if done.returncode != 0:
        return f"unshare --user --pid is not permitted here (user namespaces off?): {done.stderr.strip()}"
    return None


needs_unshare = pytest.mark.skipif(bool(_unshare_works()), reason=_unshare_works() or "")


def _check_worker_output(path: str, n: int) -> None:
    with np.load(path) as z:
        for i in range(n):
            expected = seed_int16(single_decode(z[f"sem_{i}"], z[f"glb_{i}"]))
            assert np.abs(z[f"pcm_{i}"].astype(np.int32) - expected).max() <= 1


def _pid_dead_in_host_view(low: int = 50, high: int = 5000) -> int:
    """A PID that no process has here (the host's view), for a server in another namespace."""
    for pid in range(low, high):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    pytest.skip(f"every PID in [{low}, {high}) is in use here")


@needs_unshare
def test_a_server_in_another_pid_namespace_is_seen_alive_and_served(shm_name, tmp_path):
    """Finding 7: liveness by locks, not /proc: a Kubernetes sidecar or docker --ipc=container.

    The server runs as a PID that is dead in our view, so a client that judged liveness by
    ``/proc/<server_pid>`` or ``kill(pid, 0)`` would give up on a live server."""
    ns_pid = _pid_dead_in_host_view()
    launcher = [sys.executable, PID_LAUNCHER, str(ns_pid)]
    server = subprocess.Popen([*UNSHARE, *launcher, *serve_command(shm_name)], cwd=ROOT,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until_serving(shm_name, proc=server)
        # Its pid, as it reports it, is its own namespace's: no live process has it here.
        reported = int(read_header(shm_name)["server_pid"])
        assert reported == ns_pid != server.pid
        assert not os.path.exists(f"/proc/{reported}")
        with pytest.raises(ProcessLookupError):
            os.kill(reported, 0)
        out = str(tmp_path / "w.npz")
        worker = worker_command(shm_name, "1", "4", out, "--timeout", "20")
        assert subprocess.run(worker, cwd=ROOT, timeout=120).returncode == 0
        _check_worker_output(out, 4)
        # And a second server here cannot take it over.
        second = subprocess.run(serve_command(shm_name), cwd=ROOT, capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        assert second.returncode != 0 and "already being served" in second.stderr
        assert probe(shm_name) is ServerState.SERVING
    finally:
        # unshare ignores SIGTERM while it waits: signal the launcher (PID 1 in there), which
        # passes it on to the server.
        for pid in _children(server.pid):
            os.kill(pid, signal.SIGTERM)
        assert server.wait(60) == 0
    assert leftover_objects(shm_name) == []


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


@needs_unshare
def test_a_client_in_another_pid_namespace_is_served_and_a_second_server_there_refused(
    start_server, shm_name, tmp_path
):
    """Finding 7, the other way round."""
    start_server()
    out = str(tmp_path / "w.npz")
    worker = subprocess.run([*UNSHARE, *worker_command(shm_name, "2", "4", out)], cwd=ROOT, timeout=120)
    assert worker.returncode == 0
    _check_worker_output(out, 4)
    second = subprocess.run([*UNSHARE, *serve_command(shm_name)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert second.returncode != 0 and "already being served" in second.stderr
    assert probe(shm_name) is ServerState.SERVING


def test_64_worker_processes_share_the_default_slots(start_server, shm_name, tmp_path):
    """Finding 13: slots on demand; 64 one-request-at-a-time workers against 64 default slots."""
    start_server()  # the default --slots
    n = 3
    outs = [str(tmp_path / f"w{k}.npz") for k in range(64)]
    workers = [subprocess.Popen(worker_command(shm_name, str(k), str(n), out, "--max-len", "20"), cwd=ROOT)
               for k, out in enumerate(outs)]  # fmt: skip
    try:
        codes = [w.wait(240) for w in workers]
    finally:
        for w in workers:
            w.kill()
            w.wait()
    assert codes == [0] * 64
    for out in outs:
        _check_worker_output(out, n)
    stats = stats_from_header(read_header(shm_name))
    assert stats["requests"] == 64 * n and stats["failed"] == 0


def test_a_worker_respawned_at_once_after_a_sigkill_attaches_and_decodes(start_server, shm_name, tmp_path):
    """Finding 13: the dead worker's slot is still owned when its replacement starts."""
    start_server("--slots", "1")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; "
         "from bicodec_shm.client.decoder_client import DecoderClient; "
         f"c = DecoderClient({shm_name!r}); c.decode([1, 2, 3], list(range(32))); "
         "print('holding', flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "holding"  # it owns the only slot
        holder.kill()
        holder.wait()
        out = str(tmp_path / "w.npz")
        respawned = subprocess.run(worker_command(shm_name, "3", "2", out), cwd=ROOT, timeout=60)
        assert respawned.returncode == 0
        _check_worker_output(out, 2)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_fork_whose_parent_dies_gives_the_parents_slots_back_while_the_child_lives(start_server, shm_name):
    """Finding 4: a parent with an asyncio handle (waiter thread and bell) forks, then is killed."""
    start_server()
    parent = subprocess.Popen([sys.executable, os.path.join(TESTS, "fork_and_hold.py"), shm_name],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
    child_pid = None
    try:
        owned, child_pid = (int(v) for v in parent.stdout.readline().split())
        assert owned >= 1
        with Segment.attach(shm_name) as seg:
            assert int((seg.slots["state"] != FREE).sum()) == owned
            parent.kill()
            parent.wait()
            deadline = time.monotonic() + 2.0
            while (seg.slots["state"] != FREE).any():
                assert time.monotonic() < deadline, "the child kept its dead parent's slots"
                time.sleep(0.02)
            # Its bell's lock went with it too.
            bells = [b for b in range(seg.layout.n_slots) if seg.try_lock_bell(b)]
            assert len(bells) == seg.layout.n_slots
        os.kill(child_pid, 0)  # the child still lives
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        if child_pid is not None:
            try:
                os.kill(child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
