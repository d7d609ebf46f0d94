"""The dispatcher's bookkeeping of confirmed requests (server.py, ``_scan``).

A confirmed request's header is copied and checked once, and the validated rows are kept
between calls. A slot that was batched and sends its next request before the dispatcher looks
again must then be in the next batch once, with its new request, never with its old row too.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support import reference_model, single_decode, wait_for

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.protocol.layout import SlotState


class RecordingDecoder:
    """The tiny model; records the slots' row count of every batch."""

    def __init__(self) -> None:
        self.model = reference_model()
        self.device, self.config = self.model.device, self.model.config
        self.rows: list[int] = []
        self._lock = threading.Lock()

    def detokenize(self, semantic_ids, global_ids, lengths):
        with self._lock:
            self.rows.append(int(semantic_ids.shape[0]))
        return self.model.detokenize(semantic_ids, global_ids, lengths)


def test_a_slot_sent_again_right_after_its_answer_is_batched_once_with_its_new_request(
        thread_server, shm_name):
    decoder = RecordingDecoder()
    server = thread_server(decoder, lanes=1, rejoin_ms=0.0)
    rng = np.random.default_rng(3)
    with DecoderClient(shm_name, slots=1) as client:  # one slot: every request reuses it
        for n in (7, 30, 3, 18, 11, 25):
            sem, glb = rng.integers(0, 8192, n), rng.integers(0, 4096, 32)
            np.testing.assert_allclose(client.decode(sem, glb, dtype="float32"), single_decode(sem, glb),
                                       atol=1e-5, rtol=0)  # fmt: skip
    assert decoder.rows == [1] * 6  # one client, one request at a time: never a stale second row
    assert sum(map(len, server._checked)) == 0


def test_a_slot_confirmed_again_before_the_dispatcher_looked_in_between_keeps_one_row(shm_name):
    """Driven by hand, without lanes, to make the rare order certain: the dispatcher plans a
    batch, publishes it, and its next look finds the same slot READY with its next request."""
    import torch

    from bicodec_shm.server.lanes import Runner
    from bicodec_shm.server.server import DecoderServer

    model = reference_model()
    server = DecoderServer(model, shm_name, lanes=1, rejoin_ms=0.0)
    runner = Runner(model, torch.device("cpu"))
    rng = np.random.default_rng(5)
    requests = [(rng.integers(0, 8192, n), rng.integers(0, 4096, 32)) for n in (9, 21)]
    got = []
    try:
        with DecoderClient(shm_name, slots=1) as client:
            sender = threading.Thread(target=lambda: got.extend(
                client.decode(s, g, dtype="float32") for s, g in requests))  # fmt: skip
            sender.start()
            for k, (sem, _) in enumerate(requests):
                batch = server._next_batch(block=True)  # waits for the request, confirms it
                assert batch is not None and batch.lengths.tolist() == [len(sem)]
                slot = int(batch.slots[0])
                server._publish(batch, runner.launch(batch, retry=True).wait(), 0)
                if k + 1 < len(requests):  # no look at the slots until the next request is READY
                    wait_for(lambda slot=slot: server.segment.slots["state"][slot] == SlotState.READY,
                             what="the client's next request on the same slot")  # fmt: skip
            sender.join(30)
        assert not sender.is_alive()
        for (sem, glb), pcm in zip(requests, got):
            np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)
    finally:
        server.close()


def _requests(slots, start_frames=True):
    from bicodec_shm.protocol.slot_io import Requests

    n = len(slots)
    u32 = np.arange(n, dtype=np.uint32)
    return Requests(np.asarray(slots, np.int64), np.arange(1, n + 1, dtype=np.int64),
                    np.arange(3 * n, dtype=np.uint64).reshape(n, 3), u32, u32 + 1,
                    np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64) + 10,
                    np.arange(n, dtype=np.uint64), u32 + 2, u32 + 3 if start_frames else None,
                    np.arange(n, dtype=np.int64) + 20, u32 + 4)  # fmt: skip


def test_confirmed_chunks_concatenate_every_column_in_order():
    from dataclasses import fields

    from bicodec_shm.protocol.slot_io import Requests

    parts = [_requests([4]), _requests([]), _requests([1, 7])]
    merged = Requests.concat(parts)
    for f in fields(Requests):  # every column, SNAC's included: none may be left out
        want = np.concatenate([getattr(p, f.name) for p in parts])
        np.testing.assert_array_equal(getattr(merged, f.name), want, err_msg=f.name)
    assert Requests.concat([parts[0]]) is parts[0]
    with pytest.raises(ValueError, match="column"):
        Requests.concat([_requests([1]), _requests([2], start_frames=False)])
