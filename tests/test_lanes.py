"""The CUDA lane's buffer discipline, run on the CPU: the pipelined lane and its retries with
the real ``Runner`` buffer logic, where only what needs a GPU (page-locked allocation, the CUDA
event, the current device) is replaced by stand-ins. A batch's audio sits in a reused pinned
buffer from its launch until it is published, so nothing launched meanwhile may write there.
On a GPU, tests/test_graphs.py and tests/test_precision.py run the real thing (marker gpu)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from support import seed_int16, worker_command

from bicodec_shm.protocol.slot_io import Batch, Requests
from bicodec_shm.server.lanes import STOP, Lane, Runner

HOP = 320
N_GLOBAL = 32


def make_batch(slots: list[int], frames: int = 4) -> Batch:
    """Rows whose decode is the constant ``slot / 100`` (see FakeDecoder)."""
    n = len(slots)
    requests = Requests(slots=np.array(slots, np.int64), lengths=np.full(n, frames, np.int64),
                        ids=np.zeros((n, 3), np.uint64), dtypes=np.zeros(n, np.uint32),
                        notify=np.zeros(n, np.uint32), submitted_ns=np.zeros(n, np.int64),
                        seen_ns=np.zeros(n, np.int64))  # fmt: skip
    semantic = np.array([[s] * frames for s in slots], np.int64)
    return Batch(requests, semantic, np.zeros((n, N_GLOBAL), np.int64), 0)


def expected_pcm(slot: int) -> int:
    return int(np.float32(slot / 100) * np.float32(32767))


class FakeDecoder:
    """Row i decodes to the constant ``semantic[i, 0] / 100``; the calls listed in ``fail_calls``
    (counted from 0) raise, as a CUDA OOM would."""

    def __init__(self, fail_calls: set[int]) -> None:
        self.fail_calls, self.calls = fail_calls, 0

    def detokenize(self, semantic, global_ids, lengths):
        call, self.calls = self.calls, self.calls + 1
        if call in self.fail_calls:
            raise RuntimeError(f"simulated CUDA out of memory (call {call})")
        value = semantic[:, :1].float() / 100  # (B, 1)
        return value.expand(-1, HOP * semantic.shape[1]).contiguous()


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: the events numbered in ``failing`` raise on
    ``synchronize``, as a device error found at the host copy would. Each launch makes two, in
    this order: the timing event before its first kernel (2k), then the one after its host copy
    (2k + 1), which the lane waits on."""

    failing: set[int] = set()
    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.fail = FakeEvent.made in FakeEvent.failing
        FakeEvent.made += 1
        self.stream = None

    def record(self, stream=None) -> None:
        self.stream = stream

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.5  # ms

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("simulated device error at the host copy")


@pytest.fixture
def cuda_lane(monkeypatch):
    """A pipelined lane whose runner takes the CUDA path with ordinary host memory."""
    FakeEvent.failing, FakeEvent.made = set(), 0
    streams = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.append(device) or "stream")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: streams.append(("set", device)))
    monkeypatch.setattr(Runner, "_alloc_pinned", staticmethod(lambda n, dtype: torch.empty(n, dtype=dtype)))

    def build(batches: list[Batch], fail_calls: set[int]):
        runner = Runner(FakeDecoder(fail_calls), torch.device("cpu"))
        runner.cuda = True  # the pinned, event-guarded path
        queue = list(batches)
        published: dict[int, np.ndarray] = {}
        failed: list[int] = []

        def take(block: bool, running=None):
            return queue.pop(0) if queue else STOP

        def publish(batch, decoded, ns):
            assert decoded.pcm32 is None
            for row, pcm in zip(decoded.rows16, decoded.pcm16):
                published[int(batch.slots[row])] = pcm.copy()  # what the client would read now

        lane = Lane(0, runner, take=take, publish=publish,
                    fail=lambda batch, row, msg: failed.append(int(batch.slots[row])),
                    started=lambda b, i: None, finished=lambda b, i: None, threads=None,
                    pipeline=True)  # fmt: skip
        return lane, published, failed, streams

    return build


def assert_published(published: dict[int, np.ndarray], slots: list[int]) -> None:
    assert sorted(published) == sorted(slots)
    for slot in slots:
        assert (published[slot] == expected_pcm(slot)).all(), (slot, published[slot][:4])


def test_a_failed_launch_publishes_the_batch_in_flight_before_its_retries(cuda_lane):
    """Batch k fails at launch while k-1 is in flight (call 1, and call 2, its retry whole):
    its halves must not be copied over k-1's unpublished audio."""
    lane, published, failed, _ = cuda_lane([make_batch([11, 12]), make_batch([21, 22, 23])], {1, 2})
    lane.run()
    assert failed == []
    assert_published(published, [11, 12, 21, 22, 23])


def test_a_batch_that_fails_at_its_host_copy_is_retried_without_touching_the_next(cuda_lane):
    """Batch k-1's device work fails (found at its event) while k is in flight; k-1's retry
    fails whole (call 2) and its halves run: none may land in k's pinned buffer."""
    lane, published, failed, _ = cuda_lane([make_batch([11, 12, 13]), make_batch([21, 22])], {2})
    FakeEvent.failing = {1}  # the first launch's host-copy event
    lane.run()
    assert failed == []
    assert_published(published, [11, 12, 13, 21, 22])


def test_the_lane_sets_the_models_device_and_records_on_its_stream(cuda_lane):
    lane, published, _, streams = cuda_lane([make_batch([11])], set())
    lane.run()
    assert_published(published, [11])
    assert streams[0] == ("set", torch.device("cpu"))  # before any launch, in the lane's thread
    # Both of the launch's events (its start and its end) on the model device's stream.
    assert streams[1:] == [torch.device("cpu")] * 2


def test_runner_keeps_two_pipelined_buffers_and_one_for_retries(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(Runner, "_alloc_pinned", staticmethod(lambda n, dtype: torch.empty(n, dtype=dtype)))
    runner = Runner(FakeDecoder(set()), torch.device("cpu"))
    runner.cuda = True
    data = [runner.launch(make_batch([s])).decoded.pcm16 for s in (1, 2)]
    retry = runner.launch(make_batch([3]), retry=True).decoded.pcm16
    assert len({a.__array_interface__["data"][0] for a in (*data, retry)}) == 3
    assert [int(a[0, 0]) for a in (*data, retry)] == [expected_pcm(s) for s in (1, 2, 3)]


# -- a host-output asynchronous decoder (the launch() interface of adapters.py) ------------------


def host_audio(semantic: np.ndarray, global_ids: np.ndarray) -> np.ndarray:
    """What ``HostDeviceDecoder`` decodes one request to: (T,), (32,) ids -> (320·T,) float32 in
    [-1, 1.001], a function of every id of the request, so that two requests' audio differ."""
    j = np.arange(HOP * len(semantic))
    sem, glb = np.asarray(semantic, np.int64), np.asarray(global_ids, np.int64)
    code = sem[j // HOP] * 131 + glb[j % N_GLOBAL] * 7 + j
    return ((code % 2002) / 1000.0 - 1.0).astype(np.float32)


class _HostEvent:
    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        if not self.done.wait(30):
            raise RuntimeError("the host device never finished a batch")


class HostDeviceDecoder:
    """An asynchronous decoder whose output lives on the host, written to the ``launch()``
    interface (adapters.py): ``launch`` returns at once with a fresh (B, 320·T) output tensor
    and an event; a "device" thread runs the launched batches in order, ``ms`` each, and the
    event is set when its batch is done. ``ready_at_launch``: the rows' audio is in the output
    when ``launch`` returns (the event only keeps time, as the bench's stand-in does); else the
    device thread writes it just before it sets the event, and only then may it be read.
    Counts ``overlapped``: launches made while an earlier one was still unsynchronized.
    ``hold_until``: the device starts its first batch only once that many launches were made (or
    after 10 s), so the launches overlap however busy the machine is, not only when the host
    outruns a ``ms`` sleep."""

    device = "cpu"
    config = None
    device_shaped = True  # one lane, as a GPU is served
    asynchronous = True

    def __init__(self, ms: float, ready_at_launch: bool, hold_until: int = 0) -> None:
        self.ms, self.ready_at_launch = ms, ready_at_launch
        self._launched = threading.Semaphore(0)
        self._hold_until = hold_until
        self.overlapped = self.launches = 0
        self._pending: list[_HostEvent] = []
        self._work: queue.Queue = queue.Queue()
        threading.Thread(target=self._device, daemon=True, name="host-device").start()

    def launch(self, semantic_ids, global_ids, lengths=None):
        sem, glb = semantic_ids.numpy(), global_ids.numpy()
        lens = np.full(len(sem), sem.shape[1]) if lengths is None else lengths.numpy()
        out = torch.zeros(sem.shape[0], HOP * sem.shape[1])
        rows = [(i, host_audio(sem[i, : lens[i]], glb[i])) for i in range(len(sem))]
        event = _HostEvent()
        self._pending = [e for e in self._pending if not e.done.is_set()]
        self.overlapped += bool(self._pending)
        self.launches += 1
        self._pending.append(event)
        if self.ready_at_launch:
            self._write(out, rows)
        self._work.put((out, [] if self.ready_at_launch else rows, event))
        self._launched.release()
        return out, event

    def detokenize(self, semantic_ids, global_ids, lengths=None):
        out, event = self.launch(semantic_ids, global_ids, lengths)
        event.synchronize()
        return out

    def close(self) -> None:
        self._work.put(None)

    @staticmethod
    def _write(out: torch.Tensor, rows: list[tuple[int, np.ndarray]]) -> None:
        for i, audio in rows:
            out[i, : len(audio)] = torch.from_numpy(audio)

    def _device(self) -> None:
        deadline = time.monotonic() + 10.0
        for _ in range(self._hold_until):
            self._launched.acquire(timeout=max(0.0, deadline - time.monotonic()))
        with torch.inference_mode():  # the lane made the outputs in inference mode
            while (item := self._work.get()) is not None:
                out, rows, event = item
                time.sleep(self.ms / 1000)
                self._write(out, rows)
                event.done.set()


def host_batch(rng: np.random.Generator, rows: int, dtypes: list[int]) -> tuple[Batch, list[np.ndarray]]:
    """A batch of ``rows`` random requests (one length) with output dtypes ``dtypes`` (0 int16,
    1 float32), and each row's own decode in its dtype."""
    frames = 3
    requests = Requests(slots=np.arange(rows, dtype=np.int64), lengths=np.full(rows, frames, np.int64),
                        ids=np.zeros((rows, 3), np.uint64), dtypes=np.array(dtypes, np.uint32),
                        notify=np.zeros(rows, np.uint32), submitted_ns=np.zeros(rows, np.int64),
                        seen_ns=np.zeros(rows, np.int64))  # fmt: skip
    semantic, glb = rng.integers(0, 8192, (rows, frames)), rng.integers(0, 4096, (rows, N_GLOBAL))
    own = [host_audio(s, g) for s, g in zip(semantic, glb)]
    own = [seed_int16(a) if d == 0 else a for a, d in zip(own, dtypes)]
    return Batch(requests, semantic, glb, 0), own


def decoded_rows(decoded) -> dict[int, np.ndarray]:
    """Row index -> the published audio of that row (a copy, as a client would read it now)."""
    rows = {}
    for index, pcm in ((decoded.rows16, decoded.pcm16), (decoded.rows32, decoded.pcm32)):
        rows.update({int(r): pcm[j].copy() for j, r in enumerate(index)})
    return rows


@pytest.mark.parametrize("ready_at_launch", [True, False], ids=["ready-at-launch", "ready-at-its-event"])
def test_two_host_launches_in_flight_and_a_retry_each_publish_their_own_rows(ready_at_launch):
    """On a host-output asynchronous decoder, batch k is launched before batch k-1 is read (and
    a retry may run while both are in flight): none may convert into, or read from, a buffer
    that another holds."""
    decoder = HostDeviceDecoder(ms=5.0, ready_at_launch=ready_at_launch, hold_until=3)
    try:
        runner = Runner(decoder, torch.device("cpu"))
        assert runner.asynchronous and not runner.cuda
        rng = np.random.default_rng(3)
        dtypes = [[0, 0, 0], [0, 1, 0], [1, 1], [0, 0, 1, 0]]
        batches = [host_batch(rng, len(d), d) for d in dtypes]
        inflight = [runner.launch(b) for b, _ in batches[:2]]  # k-1 and k, neither read yet
        retry = runner.launch(batches[2][0], retry=True)
        decoded = [f.wait() for f in (inflight[1], retry, inflight[0])]  # all three, then read
        got = [decoded_rows(d) for d in decoded]
        nxt = runner.launch(batches[3][0])  # may reuse k-1's buffers: k-1 is published
        got.append(decoded_rows(nxt.wait()))
        for rows, (_, own) in zip(got, [batches[1], batches[2], batches[0], batches[3]]):
            assert sorted(rows) == list(range(len(own)))
            for i, audio in enumerate(own):
                np.testing.assert_array_equal(rows[i], audio)
        assert decoder.overlapped >= 2  # the launches really were in flight together
    finally:
        decoder.close()


@pytest.mark.parametrize("ready_at_launch", [True, False], ids=["ready-at-launch", "ready-at-its-event"])
def test_every_answer_from_a_pipelined_host_output_decoder_is_its_own_requests_decode(
        ready_at_launch, thread_server, shm_name, tmp_path):  # fmt: skip
    """A real server pipelining a host-output asynchronous decoder (the launch() interface) for
    client processes: each answer, int16 and float32, equals its own request's decode exactly.
    (The lane launches batch k before it publishes batch k-1: sharing one output or conversion
    buffer between them hands k-1's clients k's audio under their own request's identity.)"""
    decoder = HostDeviceDecoder(ms=3.0, ready_at_launch=ready_at_launch)
    try:
        thread_server(decoder, slots=16, max_batch=3, rejoin_ms=0.0)
        workers = [(seed, dtype, tmp_path / f"w{seed}.npz")
                   for seed, dtype in ((1, "int16"), (2, "int16"), (3, "float32"))]  # fmt: skip
        procs = [subprocess.Popen(worker_command(shm_name, str(seed), "40", str(out), "--dtype", dtype,
                                                 "--concurrent", "3", "--max-len", "30"))
                 for seed, dtype, out in workers]  # fmt: skip
        for p in procs:
            assert p.wait(120) == 0
        wrong = total = 0
        for _, dtype, out in workers:
            with np.load(out) as z:
                for i in range(40):
                    own = host_audio(z[f"sem_{i}"], z[f"glb_{i}"])
                    own = seed_int16(own) if dtype == "int16" else own
                    pcm = z[f"pcm_{i}"]
                    total += 1
                    wrong += pcm.shape != own.shape or not np.array_equal(pcm, own)
        assert (wrong, total) == (0, 120)
        assert decoder.overlapped >= 10, (decoder.overlapped, decoder.launches)  # it did pipeline
    finally:
        decoder.close()
