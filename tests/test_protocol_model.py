"""The slot protocol, proved by exhaustive exploration of a model (tests/protocol_model.py).

Every interleaving of claim, submit, wait in line, take, give back, let go (timeouts, Ctrl-C), close,
die, the server's take/gather/publish/ring, its lanes finishing their batches, its
replacement, and the reaper, for two clients, or two threads sharing one handle, and small
bounds; and an exception (a signal handler's) between any two steps of a thread in a call.
The bounds here keep the suite fast (~30 s); ``BICODEC_SHM_MODEL_FULL=1`` adds the larger ones
(several minutes each).
"""

from __future__ import annotations

import os

import pytest
from protocol_model import Bounds, Rules, Violation, explore

BOUNDS = [
    Bounds(closes=True, deaths=True, timeouts=True),  # 1 slot, every client fault
    Bounds(slots=2, closes=True, deaths=True),  # 2 slots: claims race over the table
    Bounds(server_replacements=1, closes=True),  # a server dies, another takes the name over
    Bounds(server_replacements=1, requests=1, closes=True, deaths=True, timeouts=True),
    Bounds(clients=1, threads=2, slots=2, requests=1),  # two threads of one handle race over 2 slots
    Bounds(clients=1, threads=2, requests=1, closes=True, deaths=True, interrupts=True),
    Bounds(requests=1, timeouts=True, interrupts=True),  # an exception between any two steps
    Bounds(clients=1, slots=2, requests=2, timeouts=True, lanes=2),  # two lanes, a slot held by each in turn
    Bounds(frees_under_batch=True, timeouts=True),  # a buggy client frees its slot while it is decoded
    Bounds(frees_under_batch=True, lanes=2),
    # More threads than the handle's slots: they wait in line, and are served in turn.
    Bounds(clients=1, threads=3, handle_slots=1, requests=1),
    Bounds(clients=1, threads=2, handle_slots=1, requests=1, timeouts=True, interrupts=True),
]
FULL = [
    Bounds(slots=2, closes=True, deaths=True, timeouts=True),
    Bounds(server_replacements=1, closes=True, deaths=True, timeouts=True),
    Bounds(threads=2, requests=1),
    Bounds(clients=1, threads=2, requests=2, timeouts=True, interrupts=True),
    Bounds(requests=2, timeouts=True, interrupts=True),
    Bounds(requests=1, closes=True, deaths=True, interrupts=True),
    Bounds(slots=2, requests=2, timeouts=True, lanes=2),
    Bounds(clients=1, threads=3, handle_slots=1, requests=2, timeouts=True),
]


@pytest.mark.parametrize("bounds", BOUNDS, ids=repr)
def test_every_interleaving_keeps_the_invariants(bounds):
    assert explore(bounds) > 1000  # the invariants held in every one of these states


@pytest.mark.skipif(not os.environ.get("BICODEC_SHM_MODEL_FULL"),
                    reason="minutes: set BICODEC_SHM_MODEL_FULL=1")  # fmt: skip
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("bounds", FULL, ids=repr)
def test_every_interleaving_keeps_the_invariants_at_larger_bounds(bounds):
    assert explore(bounds, limit=20_000_000) > 1000


def test_the_checker_finds_the_cross_delivery_that_freeing_a_done_slot_on_close_caused():
    """Review finding 1, planted back: a closing client freed slots reading DONE, and a client
    took an answer whose sequence number matched (seq restarts at 1 per attachment)."""
    with pytest.raises(Violation) as found:
        explore(Bounds(closes=True), Rules(close_frees_done=True, seq_only_identity=True))
    assert found.value.what.startswith("cross-delivery")
    trace = "\n".join(found.value.trace)
    # The trace is the reported one: A's answer is written, A closes and frees the DONE slot,
    # B claims it and takes the post that was A's.
    assert "c0 closes its handle" in trace and "c1 claims slot 0" in trace
    assert trace.index("server publishes slot 0") < trace.index("c0 closes its handle")
    assert trace.index("c0 closes its handle") < trace.index("c1 claims slot 0")


def test_the_identity_check_alone_stops_that_cross_delivery():
    """With the old close rule but answers that name their request, nobody gets another's audio:
    the identity is what makes a stale post harmless."""
    assert explore(Bounds(closes=True), Rules(close_frees_done=True)) > 1000


def test_the_checker_finds_a_reaper_that_frees_a_slot_before_its_post():
    """Letting go of the held set before the post (the order that also lost wake-ups, review
    finding 14) lets the reaper free a DONE slot whose post is still to come."""
    with pytest.raises(Violation) as found:
        explore(Bounds(closes=True, timeouts=True), Rules(release_before_post=True, seq_only_identity=True))
    assert found.value.what.startswith("cross-delivery")
    assert any("(late)" in step for step in found.value.trace)


def test_the_checker_reports_a_request_that_can_never_be_answered():
    """The liveness check can fail too: a server that never answers leaves a request waiting
    with nothing but its timeout left to move it."""
    import protocol_model

    original = protocol_model._Step.publish_or_ring

    def never_rings(self, inc, i, slot, srv, entry):
        if entry[2]:  # published: the post is never made
            return
        original(self, inc, i, slot, srv, entry)

    protocol_model._Step.publish_or_ring = never_rings
    try:
        with pytest.raises(Violation, match="waits forever"):
            explore(Bounds(requests=1))
    finally:
        protocol_model._Step.publish_or_ring = original


def test_the_checker_finds_a_thread_owning_a_slot_whose_lock_another_thread_dropped():
    """The old release, planted back: it let go of the warm slot without the claim lock, so a
    claim in another thread of the same handle re-took its lock (the same open file
    description holds it), and the release's unlock then dropped it under the new owner."""
    with pytest.raises(Violation) as found:
        explore(Bounds(clients=1, threads=2, requests=1), Rules(release_outside_claim_lock=True))
    assert found.value.what.startswith("two owners")
    trace = found.value.trace
    warm = trace.index("c0.0 keeps slot 0 warm")
    retaken = next(i for i, step in enumerate(trace) if step.startswith("c0.1 re-takes the lock"))
    dropped = trace.index("c0.0 drops the lock of its warm slot 0")
    assert warm < retaken < dropped


def test_the_checker_finds_a_slot_wedged_by_an_exception_between_its_lock_and_the_books():
    """The old order of locks and books, planted back: a claim locked the slot before booking
    it, so an exception in between left it locked and owned by no request; the reaper can
    never free it, and the handle and every other client do without it for good."""
    with pytest.raises(Violation) as found:
        explore(Bounds(requests=1, interrupts=True), Rules(books_after_locks=True))
    assert found.value.what.startswith(("wedged", "lost"))
    trace = "\n".join(found.value.trace)
    assert "locks slot 0" in trace and "is interrupted" in trace


def test_the_checker_finds_a_write_after_free_when_a_lane_unholds_a_slot_another_lane_holds():
    """The old lane finish, planted back: it took the batch's slots out of the held set by
    number, after their rows were answered, when another lane already held one of them for its
    client's next request; the reaper freed it under that batch (which, publishing only into a
    slot still at its request's epoch, then drops that answer)."""
    with pytest.raises(Violation) as found:
        explore(Bounds(clients=1, requests=2, timeouts=True, lanes=2), Rules(finish_unholds_slots=True))
    assert found.value.what.startswith("free under a batch")
    trace = found.value.trace
    assert trace.index("lane 1 gathers slot 0") < trace.index("lane 0 finishes its batch")
    assert trace.index("lane 0 finishes its batch") < trace.index("reaper frees slot 0")


def test_the_checker_finds_the_lost_request_of_publishing_into_a_slot_freed_under_its_batch():
    """The publish that did not check the slot's epoch, planted back: a buggy client frees its
    slot while the server decodes it, another client claims it, and the late DONE with the old
    identity overwrites the slot of that client, whose READY request is then never answered."""
    with pytest.raises(Violation) as found:
        explore(Bounds(frees_under_batch=True), Rules(publish_ignores_epoch=True))
    assert found.value.what.startswith("write after free")
    trace = "\n".join(found.value.trace)
    # c0's slot is freed under the batch, c1 claims it (a new epoch), then the late publish.
    assert trace.index("c0 frees slot 0 under its batch") < trace.index("c1 claims slot 0")
    assert trace.index("c1 claims slot 0") < trace.index("server publishes slot 0")
def test_the_checker_finds_a_newcomer_served_ahead_of_a_request_waiting_in_line():
    """The old waiting for a slot of the handle, planted back: a give left the slot idle, and
    the thread that gave it back took it (or claimed) again for its next request while another
    thread of the handle waited in line: first come is not first served."""
    with pytest.raises(Violation) as found:
        explore(Bounds(clients=1, threads=2, handle_slots=1, requests=2), Rules(unfair_waiting=True))
    assert found.value.what.startswith("overtaken")
    trace = found.value.trace
    joined = next(i for i, step in enumerate(trace) if step.endswith("joins the line"))
    assert any(step.startswith("c0.0 next request") for step in trace[joined:]), trace
