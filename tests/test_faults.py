"""Crash safety with real processes, SIGKILL and real shared memory.

Nothing hangs, nothing is lost, and no one receives audio meant for someone else.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import ROOT, serve_command, wait_until_serving
from support import TESTS, reference_model, single_decode

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import ServerUnavailableError
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import SlotState
from bicodec_shm.protocol.names import leftover_objects
from bicodec_shm.protocol.segment import Segment


def _script(name: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(TESTS, name), *args]


def _wait_all_free(name: str, within: float) -> None:
    with Segment.attach(name) as seg:
        deadline = time.monotonic() + within
        while (seg.slots["state"] != SlotState.FREE).any():
            assert time.monotonic() < deadline, f"slots not reclaimed: {seg.slots['state']}"
            time.sleep(0.02)


class _SlowModel:
    def __init__(self, delay: float) -> None:
        self.model = reference_model()
        self.device, self.config, self.delay = self.model.device, self.model.config, delay

    def detokenize(self, *args):
        time.sleep(self.delay)
        return self.model.detokenize(*args)


@pytest.mark.parametrize("stage", ["claimed", "writing", "rung", "waiting", "done_unread"])
def test_client_killed_at_each_stage_is_reclaimed_and_its_late_result_dropped(
    thread_server, shm_name, stage
):
    # One slot only, so the next client must reuse the dead one's slot.
    server = thread_server(_SlowModel(0.4), slots=1, reap_interval=0.1)
    proc = subprocess.Popen(_script("kill_at_stage.py", shm_name, stage), stdout=subprocess.PIPE, text=True)
    try:
        slot = int(proc.stdout.readline().split()[1])
        gen_before = int(server.segment.slots["generation"][slot])
        if stage == "waiting":
            time.sleep(0.15)  # the server is now decoding the request
            proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    _wait_all_free(shm_name, within=2.0)
    assert int(server.segment.slots["generation"][slot]) == gen_before + 1
    # The next owner of that very slot gets its own audio, never the dead client's result.
    with DecoderClient(shm_name, slots=2) as client:
        sem, glb = np.arange(1, 51) * 3, np.arange(32) * 5
        for _ in range(2):
            np.testing.assert_allclose(client.decode(sem, glb, dtype="float32"),
                                       single_decode(sem, glb), atol=1e-5, rtol=0)  # fmt: skip
            assert int(server.segment.slots["generation"][slot]) > gen_before + 1  # reused


def test_clients_killed_at_random_moments_50_times_never_wedge_anyone(start_server, shm_name):
    start_server("--slots", "24")
    stop = threading.Event()
    healthy: list[str] = []

    def healthy_client():
        rng = np.random.default_rng(11)
        with DecoderClient(shm_name, slots=2, timeout=60) as client:
            while not stop.is_set():
                sem, glb = rng.integers(0, 8192, int(rng.integers(1, 60))), rng.integers(0, 4096, 32)
                got = client.decode(sem, glb, dtype="float32")
                healthy.append("ok" if np.abs(got - single_decode(sem, glb)).max() <= 1e-5 else "WRONG")

    t = threading.Thread(target=healthy_client)
    t.start()
    rnd = random.Random(3)
    try:
        for k in range(50):
            proc = subprocess.Popen(_script("hammer_client.py", shm_name, str(k)),
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rnd.uniform(0.0, 0.15))  # writing, rung, waiting or reading: by chance
            proc.kill()
            proc.wait()
            proc.stdout.close()
    finally:
        stop.set()
        t.join(120)
    assert healthy and set(healthy) == {"ok"}, healthy[-5:]
    _wait_all_free(shm_name, within=2.0)
    stats = stats_from_header(read_header(shm_name))
    # 50 clients killed mid-traffic x (1 or 2 slots they held); the healthy client's warm slot,
    # let go of between its requests, counts apart (idle_slots_expired) if the reaper takes it.
    assert stats["reclaimed"] >= 50
    assert stats["failed"] == 0


def _waiters(name, timeout, outcomes, n_threads=3, n_async=3):
    """Start sync and asyncio requests that record (kind, seconds, result or exception)."""
    rng = np.random.default_rng(21)
    reqs = [(rng.integers(0, 8192, 30), rng.integers(0, 4096, 32)) for _ in range(n_threads + n_async)]
    client = DecoderClient(name, slots=8, timeout=timeout, connect_timeout=10)

    def sync(i):
        t0 = time.monotonic()
        try:
            pcm = client.decode(*reqs[i], dtype="float32")  # before the elapsed time is read
            outcomes.append((i, time.monotonic() - t0, pcm))
        except Exception as exc:
            outcomes.append((i, time.monotonic() - t0, exc))

    def run_async():
        async def one(i):
            t0 = time.monotonic()
            try:
                pcm = await client.decode_async(*reqs[i], dtype="float32")
                outcomes.append((i, time.monotonic() - t0, pcm))
            except Exception as exc:
                outcomes.append((i, time.monotonic() - t0, exc))

        async def main():
            await asyncio.gather(*(one(i) for i in range(n_threads, n_threads + n_async)))

        asyncio.run(main())

    threads = [threading.Thread(target=sync, args=(i,)) for i in range(n_threads)]
    threads.append(threading.Thread(target=run_async))
    for th in threads:
        th.start()
    return client, reqs, threads


def _kill_server_mid_batch(server, name, timeout, outcomes):
    """Start waiters on a slow server, then SIGKILL it while their batch is being decoded."""
    wait_until_serving(name, proc=server)
    client, reqs, threads = _waiters(name, timeout, outcomes)
    time.sleep(0.5)  # inside the 1 s batch
    server.kill()
    server.wait()
    return client, reqs, threads


def test_server_killed_mid_batch_every_waiter_fails_within_its_timeout(shm_name):
    server = subprocess.Popen(_script("slow_server.py", shm_name, "1.0"), cwd=ROOT)
    try:
        outcomes: list = []
        client, _, threads = _kill_server_mid_batch(server, shm_name, 3.0, outcomes)
        for th in threads:
            th.join(10)
            assert not th.is_alive(), "a waiter hung"
        client.close()
    finally:
        server.kill()
        server.wait()
    assert len(outcomes) == 6
    for _, seconds, result in outcomes:
        assert isinstance(result, ServerUnavailableError), result
        assert "gone" in str(result)
        assert seconds <= 3.0 + 0.5
    leftover = leftover_objects(shm_name)
    assert leftover  # SIGKILL leaves the segment; the fixture unlinks it


def test_server_replaced_before_the_deadline_requests_are_resubmitted(shm_name):
    slow = subprocess.Popen(_script("slow_server.py", shm_name, "1.0"), cwd=ROOT)
    replacement = None
    try:
        outcomes: list = []
        client, reqs, threads = _kill_server_mid_batch(slow, shm_name, 60.0, outcomes)
        time.sleep(0.5)  # the clients notice and wait for a new server
        replacement = subprocess.Popen(serve_command(shm_name), cwd=ROOT, stderr=subprocess.DEVNULL)
        for th in threads:
            th.join(60)
            assert not th.is_alive()
        assert len(outcomes) == 6
        for i, _, result in outcomes:
            assert isinstance(result, np.ndarray), result
            np.testing.assert_allclose(result, single_decode(*reqs[i]), atol=1e-5, rtol=0)
        # The handle keeps working with the new server.
        assert client.decode([1, 2, 3], list(range(32))).shape == (960,)
        client.close()
    finally:
        slow.kill()
        slow.wait()
        if replacement is not None:
            replacement.send_signal(signal.SIGTERM)
            replacement.wait(30)
    assert leftover_objects(shm_name) == []


def test_group_mode_from_the_cli(start_server, shm_name):
    start_server("--mode", "0o660")
    modes = {e: os.stat(f"/dev/shm/{e}").st_mode & 0o777 for e in leftover_objects(shm_name)}
    assert modes == {shm_name: 0o600, f"{shm_name}.sock": 0o660}  # the group attaches over the socket
