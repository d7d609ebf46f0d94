"""Servers restarted, hung, killed and replaced, and handles closed, while calls wait.

Real server processes, real shared memory. Each test is named after what it proves; the issue's
findings they cover are in their docstrings.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import ROOT, wait_until_serving
from support import (
    TESTS,
    GatedDecoder,
    assert_lone_int16,
    join_within,
    reap,
    reference_model,
    seeded_request,
    wait_for,
    worker_command,
)

from bicodec_shm import BiCodecBatchDecoder
from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import (
    ClientClosedError,
    DecodeTimeoutError,
    ServerUnavailableError,
)
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import SlotState
from bicodec_shm.protocol.names import ServerState, leftover_objects, probe, random_name, unlink_all
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.server.server import DecoderServer

GLB = np.arange(32) * 7


def _run_calls(client: DecoderClient, n_sync: int, n_async: int, seed: int = 0):
    """Start sync threads and asyncio requests; returns (requests, outcomes, threads).

    Each outcome is (index, seconds, pcm or exception).
    """
    reqs = [seeded_request(seed + i, n=30) for i in range(n_sync + n_async)]
    outcomes: list = []

    def sync(i):
        t0 = time.monotonic()
        try:
            result = client.decode(*reqs[i])
        except BaseException as exc:
            result = exc
        outcomes.append((i, time.monotonic() - t0, result))  # seconds: the whole call

    def run_async():
        async def one(i):
            t0 = time.monotonic()
            try:
                result = await client.decode_async(*reqs[i])
            except BaseException as exc:
                result = exc
            outcomes.append((i, time.monotonic() - t0, result))

        async def main():
            await asyncio.gather(*(one(i) for i in range(n_sync, n_sync + n_async)))

        asyncio.run(main())

    threads = [threading.Thread(target=sync, args=(i,)) for i in range(n_sync)]
    threads.append(threading.Thread(target=run_async))
    for t in threads:
        t.start()
    return reqs, outcomes, threads


def test_a_client_recovers_after_a_restart_that_follows_an_abandoned_slot(start_server, shm_name):
    """Finding 1: a slot abandoned at a timeout is forgotten when the server is replaced."""
    server = start_server()
    sem, glb = seeded_request(1, n=30)
    with DecoderClient(shm_name, slots=1, timeout=1.0) as client:
        assert_lone_int16(client.decode(sem, glb), sem, glb)
        os.kill(server.pid, signal.SIGSTOP)  # hung: alive (it holds its lock) but silent
        with pytest.raises(DecodeTimeoutError):
            client.decode(sem, glb)  # its one slot is now abandoned
        server.kill()
        server.wait()
        start_server()
        for _ in range(3):
            assert_lone_int16(client.decode(sem, glb, timeout=30), sem, glb)


def test_a_hung_server_killed_and_replaced_answers_every_waiter(start_server, shm_name):
    """Findings 1 and 2: requests in flight and requests waiting for a slot (sync and asyncio)
    on a hung server are all resubmitted to its replacement."""
    server = start_server()
    client = DecoderClient(shm_name, slots=1, timeout=60)
    try:
        client.decode([1, 2, 3], GLB)
        os.kill(server.pid, signal.SIGSTOP)
        reqs, outcomes, threads = _run_calls(client, n_sync=2, n_async=2)
        time.sleep(0.5)  # one request sits in the hung server's slot, three wait for the slot
        server.kill()
        server.wait()
        start_server()
        join_within(threads, within=60)
    finally:
        client.close()
    assert len(outcomes) == 4
    for i, _, result in outcomes:
        assert_lone_int16(result, *reqs[i])


def test_waiters_on_a_server_that_dies_for_good_get_a_library_error_within_their_timeout(
    start_server, shm_name
):
    """Finding 2: no private exception reaches a caller, also one that waits for a slot."""
    server = start_server()
    client = DecoderClient(shm_name, slots=1, timeout=3.0)
    try:
        client.decode([1, 2, 3], GLB)
        os.kill(server.pid, signal.SIGSTOP)
        _, outcomes, threads = _run_calls(client, n_sync=2, n_async=2)
        time.sleep(0.5)
        server.kill()
        server.wait()
        join_within(threads, within=10)
    finally:
        client.close()
    assert len(outcomes) == 4
    for _, seconds, result in outcomes:
        assert isinstance(result, ServerUnavailableError), repr(result)
        assert seconds <= 3.0 + 1.0, seconds  # the timeout, and scheduling slack on a busy CI


def test_close_ends_every_call_in_flight_within_a_second(thread_server, shm_name):
    """Finding 3: sync and asyncio calls in flight or waiting for a slot, timeout None."""
    decoder = GatedDecoder()
    thread_server(decoder, lanes=1)
    client = DecoderClient(shm_name, slots=1, timeout=None)
    try:
        _, outcomes, threads = _run_calls(client, n_sync=2, n_async=2)
        time.sleep(0.5)
        t0 = time.monotonic()
        client.close()
        join_within(threads, within=1.5)
        assert time.monotonic() - t0 <= 1.0 + 0.5
    finally:
        decoder.gate.set()
    assert len(outcomes) == 4
    for _, _, result in outcomes:
        assert isinstance(result, ClientClosedError), repr(result)
    with pytest.raises(ClientClosedError):
        client.decode([1], GLB)


def test_the_drop_ins_stop_ends_its_pending_requests(thread_server, shm_name):
    """Finding 3, through the seed's API: stop() with decode_async calls pending."""
    decoder = GatedDecoder()
    thread_server(decoder, lanes=1)
    batch_decoder = BiCodecBatchDecoder(shm_name, request_timeout=None)
    batch_decoder.start()

    async def main():
        calls = [asyncio.ensure_future(batch_decoder.decode_async([1, 2, 3], GLB)) for _ in range(3)]
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, batch_decoder.stop)
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 1.5)
        return results, time.monotonic() - t0

    try:
        results, seconds = asyncio.run(main())
    finally:
        decoder.gate.set()
    assert all(isinstance(r, ClientClosedError) for r in results), results
    assert seconds <= 1.5


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mappings(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def test_the_clients_descriptors_and_mappings_stay_constant_over_20_server_restarts(shm_name):
    """Finding 5: each replaced server's attachment is closed, descriptors and pages with it."""
    model = reference_model()
    sem, glb = seeded_request(5, n=30)
    client = None
    baseline = None
    try:
        for restart in range(21):
            server = DecoderServer(model, shm_name, slots=4, lanes=1)
            server.start_thread()
            if client is None:
                client = DecoderClient(shm_name, timeout=30)
            assert_lone_int16(client.decode(sem, glb), sem, glb)
            assert_lone_int16(asyncio.run(client.decode_async(sem, glb)), sem, glb)
            # The previous attachment goes once its last user (its waiter thread) leaves.
            deadline = time.monotonic() + 2
            while baseline is not None and (_descriptors(), _mappings(shm_name)) != baseline:
                assert time.monotonic() < deadline, (restart, baseline, _descriptors(), _mappings(shm_name))
                time.sleep(0.02)
            if restart == 0:
                baseline = (_descriptors(), _mappings(shm_name))
            server.close()
    finally:
        if client is not None:
            client.close()


def test_two_servers_started_at_the_same_moment_exactly_one_serves(tmp_path):
    """Finding 6: 10 races of two `serve`s; the loser never unlinks the winner's objects."""
    names = [random_name("bcshm-race") for _ in range(10)]
    go = tmp_path / "go"
    procs = {name: [subprocess.Popen([sys.executable, os.path.join(TESTS, "race_server.py"), name, str(go)],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                    for _ in range(2)] for name in names}  # fmt: skip
    try:
        for pair in procs.values():
            for p in pair:
                assert p.stdout.readline().strip() == "armed"
        go.touch()  # all 20 construct their server now
        for name, pair in procs.items():
            lines = [p.stdout.readline().strip() for p in pair]
            winners = [p for p, line in zip(pair, lines) if line == "serving"]
            losers = [(p, line) for p, line in zip(pair, lines) if line.startswith("refused: ")]
            assert len(winners) == 1 and len(losers) == 1, lines
            assert "already serving" in losers[0][1]
            assert losers[0][0].wait(30) == 3
            with DecoderClient(name, timeout=30) as client:
                sem, glb = seeded_request(6, n=30)
                assert_lone_int16(client.decode(sem, glb), sem, glb)
    finally:
        for pair in procs.values():
            for p in pair:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        for name, pair in procs.items():
            for p in pair:
                reap(p)
            left = leftover_objects(name)
            unlink_all(name)
            assert left == [], left


def _in_flight(name: str) -> int:
    """Requests the server under ``name`` holds now: READY or BUSY slots."""
    with Segment.attach(name) as seg:
        states = seg.slots["state"]
        return int(((states == SlotState.READY) | (states == SlotState.BUSY)).sum())


def test_a_rolling_restart_under_load_loses_nothing(start_server, shm_name, tmp_path):
    """Finding 10: SIGTERM finishes the running batch and leaves queued requests to the next
    server; 8 client processes see 0 failures across two rolling restarts."""
    server = start_server()
    outs = [str(tmp_path / f"w{k}.npz") for k in range(8)]
    workers = [subprocess.Popen(worker_command(shm_name, str(100 + k), "25", out), cwd=ROOT)
               for k, out in enumerate(outs)]  # fmt: skip
    try:
        for _ in range(2):
            # SIGTERM only once requests are queued or decoding, with every worker still at it.
            wait_for(lambda: _in_flight(shm_name) > 0, what="requests in flight")
            server.send_signal(signal.SIGTERM)
            assert all(w.poll() is None for w in workers), "a worker finished before the SIGTERM"
            time.sleep(0.2)
            replacement = start_server(wait=False)  # within 2 s: it waits for the old one to go
            assert server.wait(30) == 0
            wait_until_serving(shm_name, proc=replacement)
            server = replacement
        for w in workers:
            assert w.wait(120) == 0
    finally:
        for w in workers:
            w.kill()
            w.wait()
    for out in outs:
        with np.load(out) as z:
            for i in range(25):
                assert_lone_int16(z[f"pcm_{i}"], z[f"sem_{i}"], z[f"glb_{i}"])
    assert stats_from_header(read_header(shm_name))["failed"] == 0


def test_sigterm_leaves_queued_requests_to_the_next_server(start_server, shm_name):
    """Finding 10, directly: requests queued behind a slow batch at SIGTERM are not failed."""
    sem, glb = seeded_request(7, n=60)
    server = start_server("--max-batch", "1")
    with DecoderClient(shm_name, slots=8, timeout=60) as client:
        reqs, outcomes, threads = _run_calls(client, n_sync=6, n_async=0, seed=20)
        time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        start_server()
        join_within(threads, within=60)
    for i, _, result in outcomes:
        assert_lone_int16(result, *reqs[i])


# Start `serve` with SIGINT ignored (as a shell starts `serve &` or a nohup'ed job) or at its
# default (a terminal's foreground job), whatever the test run itself inherited.
_SIGINT_IGNORED = ("import runpy, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "runpy.run_module('bicodec_shm', run_name='__main__', alter_sys=True)")
_SIGINT_DEFAULT = _SIGINT_IGNORED.replace("signal.SIG_IGN", "signal.default_int_handler")


@pytest.mark.parametrize("ignored", [True, False], ids=["sigint-ignored", "sigint-default"])
def test_ctrl_c_stops_a_server_unless_it_was_started_with_sigint_ignored(shm_name, ignored):
    """A server started with SIGINT ignored keeps serving through a Ctrl-C (the bench's server
    leaves Ctrl-C to its parent); at its default SIGINT stops it cleanly; SIGTERM always does."""
    launcher = _SIGINT_IGNORED if ignored else _SIGINT_DEFAULT
    server = subprocess.Popen([sys.executable, "-c", launcher, "serve", "--name", shm_name,
                               "--preset", "tiny"], cwd=ROOT, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until_serving(shm_name, proc=server)
        server.send_signal(signal.SIGINT)
        if ignored:
            time.sleep(1.0)
            assert server.poll() is None and probe(shm_name) is ServerState.SERVING
            with DecoderClient(shm_name, timeout=30) as client:
                assert client.decode([1, 2, 3], list(range(32))).shape == (960,)
            server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert leftover_objects(shm_name) == []


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": TESTS})  # fmt: skip


def test_a_context_managed_server_with_its_thread_running_exits_cleanly(shm_name):
    """Finding 8: close() stops and joins the serving thread before unmapping."""
    out = _python(f"""
import numpy as np
from support import reference_model
from bicodec_shm import DecoderClient, DecoderServer
with DecoderServer(reference_model(), {shm_name!r}) as server:
    server.start_thread()
    client = DecoderClient({shm_name!r})
    assert client.decode([1, 2, 3], list(range(32))).shape == (960,)
    # leave the block with the thread serving and the client attached
print("ok", flush=True)
""")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert leftover_objects(shm_name) == []


def test_the_drop_ins_private_server_is_cleaned_up_at_exit_without_stop():
    """Finding 9: a process that never calls stop() leaves nothing in /dev/shm."""
    out = _python("""
import asyncio
from support import reference_model
from bicodec_shm import BiCodecBatchDecoder
batch_decoder = BiCodecBatchDecoder(reference_model())
batch_decoder.start()
audio = asyncio.run(batch_decoder.decode_async([1, 2, 3], list(range(32))))
assert len(audio) == 960 * 2
print(batch_decoder.name, flush=True)
""")
    assert out.returncode == 0, out.stderr
    name = out.stdout.strip()
    left = leftover_objects(name)
    unlink_all(name)
    assert name and left == []
