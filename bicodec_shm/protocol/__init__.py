"""The shared-memory protocol between a decoder server and its clients. Torch-free: numpy and
posix_ipc only.

    layout.py       the segment's byte layout: header and slot records, slot states, offsets
    objects.py      opening a name's object: only a regular file of the expected owner, no link
    locks.py        ownership without pids: OFD byte-range locks, and what a forked child drops
    names.py        named objects: validate, probe, take over a dead server's, unlink
    header.py       reading a header: its codec, its layout, its live counters
    segment.py      ``Segment``: the mapped views, the semaphores, the slot state machine
    semwait.py      timed semaphore waits that let a signal handler's exception through
    attachment.py   one client's attachment to one server incarnation: slots, requests, answers
    async_answers.py  an attachment's asyncio requests: one bell and one waiter thread
    slot_waits.py   a request waiting for a slot: in line (first come, first served), or for the segment
    waiting.py      what a waiting request uses: the slice, the wake-up list, the line, ``Gone``
    slot_io.py      the server's side of a slot: confirm and copy requests, publish answers
    group.py        a server group's record under the group's name, and its live counters
    served.py       what is served under which name in /dev/shm (for error messages)

May import: ``codecs`` and ``errors``. Never torch, and never the client, model, server, deploy
or tools layers (tests/test_layers.py checks both).
"""
