"""What a caller of the client sees at its boundary: a request checked against the server that
will decode it (not the one the handle saw first), and only documented exceptions.

Real servers on real shared memory: in-process servers (and an in-process group: a group object
plus one server per member, as the supervisor makes them) where a test restarts them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from support import reference_model, seeded_request, single_decode

from bicodec_shm.client import DecoderClient
from bicodec_shm.group import GroupObject, member_names
from bicodec_shm.server import DecoderServer
from bicodec_shm.transport import leftover_objects, random_name, unlink_all


def _lone(req) -> np.ndarray:
    return single_decode(*req)


def _serve(name: str, **kwargs) -> tuple[DecoderServer, threading.Thread]:
    server = DecoderServer(reference_model(), name, **kwargs)
    return server, server.start_thread()


def _stop(*running: tuple[DecoderServer, threading.Thread]) -> None:
    for server, _ in running:
        server.stop()
    for _, thread in running:
        thread.join(30)
        assert not thread.is_alive()


class _Group:
    """A live server group under ``name``: the group object and a thread server per member."""

    def __init__(self, name: str, n: int = 2, **kwargs) -> None:
        self.name = name
        self.servers = [_serve(member, **kwargs) for member in member_names(name, n)]
        self.obj = GroupObject.create(name, ["cpu"] * n)
        self.obj.start_serving()

    def stop(self) -> None:
        self.obj.stop_serving()
        _stop(*self.servers)
        self.obj.unlink()
        self.obj.close()


@pytest.fixture
def group_name() -> Iterator[str]:
    name = random_name("bcshm-test")
    yield name
    for n in (name, *member_names(name, 2)):
        unlink_all(n)
        assert leftover_objects(n) == []


# -- a request is checked against the limits of the server that decodes it ---------------------


def test_a_handle_sends_a_server_restarted_with_a_larger_max_tokens_what_it_now_accepts(shm_name):
    running = _serve(shm_name, slots=2, max_tokens=100)
    long_req = seeded_request(21, 150)
    try:
        with DecoderClient(shm_name, slots=1, timeout=30) as client:
            client.decode(*seeded_request(20, 80))  # the handle has seen the 100-frame server
            _stop(running)
            running = _serve(shm_name, slots=2, max_tokens=200)
            pcm = client.decode(*long_req, dtype="float32")
            np.testing.assert_allclose(pcm, _lone(long_req), atol=1e-5, rtol=0)
            codes = client.decode_codes([long_req[0]], global_ids=long_req[1], dtype="float32")
            np.testing.assert_allclose(codes, _lone(long_req), atol=1e-5, rtol=0)
            with pytest.raises(ValueError, match="250 ids, more than the 200"):  # the new limit
                client.decode(*seeded_request(22, 250))
            assert client._att.using == {}
    finally:
        _stop(running)


def test_a_group_handle_sends_a_group_restarted_with_a_larger_max_tokens_what_it_now_accepts(group_name):
    group = _Group(group_name, slots=2, max_tokens=100)
    long_req = seeded_request(23, 150)
    try:
        with DecoderClient(group_name, slots=1, timeout=30) as client:
            client.decode(*seeded_request(24, 80))
            assert client._group is not None
            group.stop()
            group = _Group(group_name, slots=2, max_tokens=200)
            for _ in range(4):  # each member in turn, whichever the router picks
                pcm = client.decode(*long_req, dtype="float32")
                np.testing.assert_allclose(pcm, _lone(long_req), atol=1e-5, rtol=0)
    finally:
        group.stop()


def test_a_request_no_server_could_take_is_refused_before_anything_is_written(shm_name):
    running = _serve(shm_name, slots=2, max_tokens=100)
    try:
        with DecoderClient(shm_name, slots=1, timeout=30) as client:
            with pytest.raises(ValueError, match=r"semantic_ids\[1\] = 8192 is out of range"):
                client.decode([1, 8192], [0] * 32)
            with pytest.raises(ValueError, match="100001 ids, more than the 100000 any server"):
                client.decode(np.zeros(100_001, np.int64), [0] * 32)
            assert client._att.owned == set() and client._att.using == {}
    finally:
        _stop(running)


def test_the_client_s_longest_request_is_the_longest_slot_a_server_may_have(shm_name):
    from bicodec_shm.codecs.layout import MAX_FRAMES
    from bicodec_shm.transport import Segment

    with pytest.raises(ValueError, match="max_tokens must be in 1..100000"):
        Segment.create(shm_name, n_slots=1, max_tokens=MAX_FRAMES + 1)
    assert leftover_objects(shm_name) == []
