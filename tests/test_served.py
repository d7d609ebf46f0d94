"""The names being served, listed for a user who typed a wrong one."""

from __future__ import annotations

from bicodec_shm.protocol import served
from bicodec_shm.protocol.names import random_name, unlink_all
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.protocol.served import describe_served, served_names


def test_a_live_server_is_listed_and_a_segment_not_yet_served_is_not(thread_server, shm_name):
    unserved = random_name("bcshm-test")
    seg = Segment.create(unserved, n_slots=1, max_tokens=10)  # created, never served
    try:
        thread_server()
        names = served_names()
        assert names.get(shm_name) == "server" and unserved not in names
        assert repr(shm_name) in describe_served() and repr(shm_name) not in describe_served(exclude=shm_name)
    finally:
        seg.unlink()
        seg.close()
        unlink_all(unserved)


def test_a_groups_members_are_folded_into_the_group(monkeypatch):
    monkeypatch.setattr(served, "served_names", lambda: {"a": "server", "tts": "group", "tts.0": "server",
                                                         "tts.1": "server", "x.0": "server"})  # fmt: skip
    assert describe_served() == "served now: 'a', 'tts' (a group of 2 members up), 'x.0'"
    monkeypatch.setattr(served, "served_names", dict)
    assert describe_served() == "no bicodec-shm server of this user is serving on this host now"
