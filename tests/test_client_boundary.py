"""What a caller of the client sees at its boundary: a request checked against the server that
will decode it (not the one the handle saw first), and only documented exceptions.

Real servers on real shared memory: in-process servers (and an in-process group: a group object
plus one server per member, as the supervisor makes them) where a test restarts them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from support import reference_model, seeded_request, single_decode

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import ServerUnavailableError
from bicodec_shm.protocol.attachment import Attachment
from bicodec_shm.protocol.group import GroupObject, member_names
from bicodec_shm.protocol.names import leftover_objects, random_name, unlink_all
from bicodec_shm.server.server import DecoderServer


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


def test_a_group_handle_s_max_tokens_is_its_least_members_and_a_stream_over_it_fits_every_member(group_name):
    """Members restarted one at a time may differ: a window must fit whichever is picked."""
    from bicodec_shm.client.streaming import DecodeStream

    group = _Group(group_name, slots=2, max_tokens=200)
    semantic, glb = seeded_request(25, 400)
    try:
        with DecoderClient(group_name, slots=2, timeout=30) as client:
            assert client.max_tokens == 200
            _stop(group.servers[1])
            group.servers[1] = _serve(member_names(group_name, 2)[1], slots=2, max_tokens=150)
            assert client.max_tokens == 150
            stream = DecodeStream(client, glb, preset="exact", dtype="float32")
            audio = np.frombuffer(stream.push(semantic) + stream.finish(), "<f4")
    finally:
        group.stop()
    np.testing.assert_allclose(audio, _lone((semantic, glb)), atol=1e-5, rtol=0)


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
    from bicodec_shm.protocol.segment import Segment

    with pytest.raises(ValueError, match="max_tokens must be in 1..100000"):
        Segment.create(shm_name, n_slots=1, max_tokens=MAX_FRAMES + 1)
    assert leftover_objects(shm_name) == []


# -- nothing internal reaches a caller -----------------------------------------------------------
#
# ``Gone`` (attachment.py) means "this attachment's server went away: re-attach and resubmit".
# It is raised by ``Attachment.use`` (a semaphore or the mapping gone), by a retired attachment's
# ``take_slot``/``register``/``submit``/``wait_result`` and by its asyncio futures, by
# ``check_alive``, and by a group router another thread retired. Each site below is made to
# fail once the way the server going away makes it fail (the attachment retires, then the
# call raises), under every public entry point that reaches it: the call must resubmit and
# return the same audio as without the failure.


def _gone_once(monkeypatch, cls, method: str, *, after: bool = False) -> list[str]:
    """Make ``cls.method`` fail the first time as it does when the server goes away: retire
    the attachment and raise ``Gone`` (``after``: run it, then retire, as when the server goes
    away right after a submit). Returns a list that records the firing."""
    import inspect

    from bicodec_shm.errors import ServerUnavailableError
    from bicodec_shm.protocol.waiting import Gone

    original = getattr(cls, method)
    fired: list[str] = []

    def fail(self) -> None:
        fired.append(method)
        self.retire(Gone())
        if not after:
            raise Gone() from ServerUnavailableError("the server went away (injected)")

    if inspect.iscoroutinefunction(original):

        async def wrapper(self, *args, **kwargs):
            if not fired and not after:
                fail(self)
            out = await original(self, *args, **kwargs)
            if not fired and after:
                fail(self)
            return out
    else:

        def wrapper(self, *args, **kwargs):
            if not fired and not after:
                fail(self)
            out = original(self, *args, **kwargs)
            if not fired and after:
                fail(self)
            return out

    monkeypatch.setattr(cls, method, wrapper)
    return fired


def _regroup_once(monkeypatch, client) -> list[str]:
    """Another thread's view of the name changing between this call's read of the handle's
    group router and its pick: the router is retired (``_regroup``) under the call."""
    from bicodec_shm.client.router import GroupRouter

    original = GroupRouter.pick
    fired: list[str] = []

    def pick(self):
        if not fired:
            fired.append("pick")
            client._regroup(self)
        return original(self)

    monkeypatch.setattr(GroupRouter, "pick", pick)
    return fired


_SYNC_SITES = ("take_slot", "submit", "wait_result", "answered-then-gone", "group-replaced")
_ASYNC_SITES = ("take_slot_async", "register", "submit", "answered-then-gone", "group-replaced")
_ENTRIES = {  # entry point -> whether it is asyncio
    "decode": False, "decode_codes": False, "DecodeStream.push": False,
    "decode_async": True, "decode_codes_async": True, "DecodeStream.push_async": True,
    "BiCodecBatchDecoder.decode_async": True,
}  # fmt: skip


def _dropin_over(client):
    """A started ``BiCodecBatchDecoder`` of ``client``'s server that sends through ``client``."""
    from bicodec_shm.integrations.batch_decoder import BiCodecBatchDecoder

    dropin = BiCodecBatchDecoder(client.name, request_timeout=30)
    dropin.start()
    dropin._client.close()
    dropin._client = client  # the handle under test, with its injected failure
    return dropin


def _call(entry: str, client, dropin, req) -> np.ndarray:
    """``req``'s float32 audio through ``entry`` (int16 ones scaled back for comparison)."""
    import asyncio

    from bicodec_shm.client.streaming import DecodeStream

    semantic, globals_ = req
    if entry == "decode":
        return client.decode(semantic, globals_, dtype="float32")
    if entry == "decode_codes":
        return client.decode_codes([semantic], global_ids=globals_, dtype="float32")
    if entry == "decode_async":
        return asyncio.run(client.decode_async(semantic, globals_, dtype="float32"))
    if entry == "decode_codes_async":
        return asyncio.run(client.decode_codes_async([semantic], global_ids=globals_, dtype="float32"))
    if entry == "DecodeStream.push":
        stream = DecodeStream(client, globals_, preset="exact", dtype="float32")
        return np.frombuffer(stream.push(semantic) + stream.finish(), "<f4")
    if entry == "DecodeStream.push_async":

        async def run():
            stream = DecodeStream(client, globals_, preset="exact", dtype="float32")
            return await stream.push_async(semantic) + await stream.finish_async()

        return np.frombuffer(asyncio.run(run()), "<f4")
    assert entry == "BiCodecBatchDecoder.decode_async"
    pcm = np.frombuffer(asyncio.run(dropin.decode_async(semantic, globals_)), "<i2")
    return pcm.astype(np.float32) / 32767


def _cases():
    for entry, is_async in _ENTRIES.items():
        for site in _ASYNC_SITES if is_async else _SYNC_SITES:
            for handle in ("server", "group"):
                if site == "group-replaced" and handle == "server":
                    continue
                yield pytest.param(entry, site, handle, id=f"{entry}-{site}-{handle}")


@pytest.mark.parametrize("entry, site, handle", list(_cases()))
def test_a_server_lost_at_any_gone_site_is_resubmitted_through_every_public_entry(
    entry, site, handle, shm_name, group_name, monkeypatch
):
    from bicodec_shm.protocol.attachment import Attachment

    name = group_name if handle == "group" else shm_name
    running = _Group(name, slots=2) if handle == "group" else None
    single = _serve(name, slots=2) if handle == "server" else None
    req = seeded_request(31, 12)
    try:
        with DecoderClient(name, slots=2, timeout=30) as client:
            dropin = _dropin_over(client)
            expected = _call(entry, client, dropin, req)  # the same call, nothing failing
            if entry == "BiCodecBatchDecoder.decode_async":
                np.testing.assert_allclose(expected, _lone(req), atol=2 / 32767, rtol=0)
            elif not entry.startswith("DecodeStream"):
                np.testing.assert_allclose(expected, _lone(req), atol=1e-5, rtol=0)
            if site == "group-replaced":
                fired = _regroup_once(monkeypatch, client)
            elif site == "answered-then-gone":
                fired = _gone_once(monkeypatch, Attachment, "submit", after=True)
            else:
                fired = _gone_once(monkeypatch, Attachment, site)
            got = _call(entry, client, dropin, req)
            assert fired, f"{site} was never reached through {entry}"
            # The retry may share a batch with the abandoned copy: exact up to masking's 1e-5.
            lsb = entry == "BiCodecBatchDecoder.decode_async"
            np.testing.assert_allclose(got, expected, atol=1.5 / 32767 if lsb else 1e-5, rtol=0)
    finally:
        if running is not None:
            running.stop()
        if single is not None:
            _stop(single)


def test_a_live_server_whose_semaphores_were_removed_fails_the_call_at_its_deadline(shm_name):
    """An operator's clean-up (or systemd's RemoveIPC) removed the names of a live server's
    semaphores: every attachment fails at once. The call must end at its timeout with a
    documented error saying why, not re-attach for ever."""
    import os
    import time

    import posix_ipc

    from bicodec_shm.errors import ServerUnavailableError

    running = _serve(shm_name, slots=2)
    try:
        for entry in os.listdir("/dev/shm"):
            if entry.startswith(f"sem.{shm_name}.done."):
                posix_ipc.unlink_semaphore("/" + entry[len("sem."):])
        client = DecoderClient(shm_name, slots=1, timeout=1.0)
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                client.decode(*seeded_request(32, 5))
                outcome.append(None)
            except BaseException as exc:  # noqa: B036 - judged below
                outcome.append(exc)

        t0 = time.monotonic()
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(10)
        took = time.monotonic() - t0
        assert not thread.is_alive(), "a call with a 1 s timeout still runs after 10 s"
        (exc,) = outcome
        assert isinstance(exc, ServerUnavailableError), repr(exc)
        assert "semaphores" in str(exc), str(exc)
        assert took < 5, took
        client.close()
    finally:
        _stop(running)


def test_a_client_that_looked_before_a_group_took_the_name_looks_again(group_name):
    """A handle reads the name (no group there yet), then a group takes it before the handle
    opens it as a server's segment: that open says "look again" (ServerUnavailableError,
    which the handle retries), never that the group's object is a foreign one (SegmentError)."""
    group = GroupObject.create(group_name, ["cpu"])
    try:
        group.start_serving()
        with pytest.raises(ServerUnavailableError, match="server group"):
            Attachment(group_name, max_slots=2, owner_uid=None)
    finally:
        group.stop_serving()
        group.unlink()
        group.close()


def test_calls_on_one_group_handle_while_the_group_is_replaced_all_get_their_audio(group_name):
    """The deployment's case: a group's supervisor and members replaced (a new epoch) while
    threads share one handle. Every call resubmits to the new group and gets its own audio;
    none sees an internal exception."""
    group = _Group(group_name, slots=4)
    reqs = [seeded_request(40 + i, 4 + i % 7) for i in range(12)]
    failures: list[BaseException] = []
    done = [0]
    stop = threading.Event()
    try:
        with DecoderClient(group_name, slots=2, timeout=60) as client:

            def work(k: int) -> None:
                i = k
                while not stop.is_set():
                    req = reqs[i % len(reqs)]
                    try:
                        pcm = client.decode(*req, dtype="float32")
                        np.testing.assert_allclose(pcm, _lone(req), atol=1e-5, rtol=0)
                        done[0] += 1
                    except BaseException as exc:  # noqa: B036 - judged below
                        failures.append(exc)
                        return
                    i += 3

            threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
            for t in threads:
                t.start()
            for _ in range(4):
                before = done[0]
                deadline = time.monotonic() + 30
                while done[0] < before + 6 and time.monotonic() < deadline and not failures:
                    time.sleep(0.01)
                group.stop()
                group = _Group(group_name, slots=4)
            stop.set()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a call hung"
    finally:
        stop.set()
        group.stop()
    assert not failures, failures
    assert done[0] >= 24

