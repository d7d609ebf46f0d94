"""The CUDA lane's buffer discipline, run on the CPU: the pipelined lane and its retries with
the real ``Runner`` buffer logic, where only what needs a GPU (page-locked allocation, the CUDA
event, the current device) is replaced by stand-ins. A batch's audio sits in a reused pinned
buffer from its launch until it is published, so nothing launched meanwhile may write there.
On a GPU, tests/test_graphs.py and tests/test_precision.py run the real thing (marker gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
    ``synchronize``, as a device error found at the host copy would."""

    failing: set[int] = set()
    made = 0

    def __init__(self) -> None:
        self.fail = FakeEvent.made in FakeEvent.failing
        FakeEvent.made += 1
        self.stream = None

    def record(self, stream=None) -> None:
        self.stream = stream

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

        def take(block: bool):
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
    FakeEvent.failing = {0}
    lane.run()
    assert failed == []
    assert_published(published, [11, 12, 13, 21, 22])


def test_the_lane_sets_the_models_device_and_records_on_its_stream(cuda_lane):
    lane, published, _, streams = cuda_lane([make_batch([11])], set())
    lane.run()
    assert_published(published, [11])
    assert streams[0] == ("set", torch.device("cpu"))  # before any launch, in the lane's thread
    assert streams[1:] == [torch.device("cpu")]  # the event's stream: the model device's


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
