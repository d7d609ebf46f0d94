"""The server's side of the slot table, vectorised over a batch: read requests in, write results out.

Every function here takes whole arrays of slots: one numpy operation per field for the batch,
not one per row. Only the semaphore posts remain per row. Nothing read from shared memory is
trusted: ``check_headers`` validates a private copy of each slot header, ``gather`` validates
the private copy of the ids that the model will see (a client cannot change them after the
check), and every length is clamped to what the slot holds.

Shapes: ``B`` rows in the batch, ``T`` the longest row's tokens, ``N = 320·T`` samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .transport import (
    BUSY,
    DONE,
    ERROR_TEXT_BYTES,
    HOP,
    N_GLOBAL,
    NO_BELL,
    READY,
    Segment,
    Status,
)

_OUTPUT_DTYPES = np.array([0, 1], np.uint32)  # OutputDtype values


@dataclass
class Requests:
    """Validated headers of confirmed READY slots (private copies), all arrays (B,)."""

    slots: np.ndarray  # int64
    lengths: np.ndarray  # int64, each in 1..max_tokens
    seqs: np.ndarray  # uint64, echoed into result_seq
    dtypes: np.ndarray  # uint32, OutputDtype
    notify: np.ndarray  # uint32, a bell or NO_BELL
    submitted_ns: np.ndarray  # uint64

    def take(self, index: np.ndarray | list[int]) -> Requests:
        """The rows ``index`` as a new ``Requests``."""
        return Requests(*(a[index] for a in (self.slots, self.lengths, self.seqs, self.dtypes,
                                               self.notify, self.submitted_ns)))  # fmt: skip

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class Batch:
    """Requests gathered for one forward pass, sorted longest first.

    ``semantic`` (B, T) int64, right-padded with 0; ``global_ids`` (B, 32) int64.
    """

    requests: Requests
    semantic: np.ndarray
    global_ids: np.ndarray
    started_ns: int

    @property
    def slots(self) -> np.ndarray:
        return self.requests.slots

    @property
    def lengths(self) -> np.ndarray:
        return self.requests.lengths

    def split(self) -> tuple[Batch, Batch]:
        """Halves for split-and-retry, each trimmed to its own longest row."""
        mid = len(self.requests) // 2
        halves = []
        for rows in (slice(0, mid), slice(mid, None)):
            req = self.requests.take(rows)
            t = int(req.lengths.max())
            halves.append(Batch(req, self.semantic[rows, :t], self.global_ids[rows], self.started_ns))
        return halves[0], halves[1]


Failure = tuple[int, int, str]  # (slot, Status, message)


def check_headers(seg: Segment, slots: np.ndarray, *, n_bells: int) -> tuple[Requests, list[Failure]]:
    """Copy the headers of ``slots`` (confirmed: their req.I was taken) and validate them.

    Returns the valid rows and a failure for each invalid one; rows not READY are dropped.
    """
    rows = seg.slots[slots]  # a private copy of each header: later client writes cannot reach it
    n = rows["n_tokens"].astype(np.int64)
    max_tokens = seg.layout.max_tokens
    problems: dict[int, tuple[int, str]] = {}
    # req.I was posted but the slot is not READY: no request of a well-behaved client (they
    # post only after READY, and claims and reaps drain stale posts). Ignore it rather than
    # write a result into a slot its owner may be filling right now.
    stray = rows["state"] != READY

    def fail(mask: np.ndarray, status: Status, message) -> None:
        for j in np.flatnonzero(mask).tolist():
            problems.setdefault(j, (status, message(j)))

    fail((n < 1) | (n > max_tokens), Status.BAD_LENGTH,
         lambda j: f"semantic length {int(n[j])} is outside 1..{max_tokens}")
    fail(rows["n_global"] != N_GLOBAL, Status.BAD_GLOBAL,
         lambda j: f"{int(rows['n_global'][j])} global ids, expected {N_GLOBAL}")
    fail(~np.isin(rows["dtype"], _OUTPUT_DTYPES), Status.BAD_DTYPE,
         lambda j: f"unknown output dtype code {int(rows['dtype'][j])}")
    fail(rows["req_generation"] != rows["generation"], Status.STALE_GENERATION,
         lambda j: (f"request names slot generation {int(rows['req_generation'][j])} but the "
                    f"slot is at {int(rows['generation'][j])} (it was reclaimed)"))
    fail((rows["notify"] != NO_BELL) & (rows["notify"] >= n_bells), Status.BAD_NOTIFY,
         lambda j: f"bell index {int(rows['notify'][j])} out of range")  # fmt: skip
    for j in np.flatnonzero(stray).tolist():
        problems.pop(j, None)
    failures = [(int(slots[j]), status, msg) for j, (status, msg) in sorted(problems.items())]
    ok = ~stray
    ok[list(problems)] = False
    requests = Requests(
        slots=np.asarray(slots, np.int64)[ok],
        lengths=n[ok],
        seqs=rows["request_seq"][ok],
        dtypes=rows["dtype"][ok],
        notify=rows["notify"][ok],
        submitted_ns=rows["t_submit_ns"][ok],
    )
    return requests, failures


def gather(seg: Segment, req: Requests, *, semantic_vocab: int, global_vocab: int,
           ) -> tuple[Batch | None, list[Failure]]:  # fmt: skip
    """Copy the ids of ``req`` (sorted longest first by the caller) and validate the copy.

    Rows with an id out of range fail alone; the others form the batch (None if none is left).
    """
    t = int(req.lengths.max())
    semantic = seg.tokens[req.slots, :t].astype(np.int64)  # (B, T): a private copy
    valid = np.arange(t) < req.lengths[:, None]  # (B, T)
    semantic[~valid] = 0  # the padding: whatever the slot held there is not ours to decode
    global_ids = seg.globals[req.slots].astype(np.int64)  # (B, 32)
    bad_sem = ((semantic < 0) | (semantic >= semantic_vocab)).any(axis=1)
    bad_glb = ((global_ids < 0) | (global_ids >= global_vocab)).any(axis=1)
    failures: list[Failure] = []
    for j in np.flatnonzero(bad_sem | bad_glb).tolist():
        if bad_sem[j]:
            pos = int(np.flatnonzero((semantic[j] < 0) | (semantic[j] >= semantic_vocab))[0])
            failures.append((int(req.slots[j]), Status.BAD_SEMANTIC_ID,
                             f"semantic id {int(semantic[j, pos])} at position {pos} is outside "
                             f"0..{semantic_vocab - 1}"))  # fmt: skip
        else:
            pos = int(np.flatnonzero((global_ids[j] < 0) | (global_ids[j] >= global_vocab))[0])
            failures.append((int(req.slots[j]), Status.BAD_GLOBAL,
                             f"global id {int(global_ids[j, pos])} at position {pos} is outside "
                             f"0..{global_vocab - 1}"))  # fmt: skip
    if failures:
        keep = ~(bad_sem | bad_glb)
        if not keep.any():
            return None, failures
        req = req.take(keep)
        t = int(req.lengths.max())
        semantic, global_ids = semantic[keep, :t], global_ids[keep]
    now = time.monotonic_ns()
    f = seg.field
    f["t_start_ns"][req.slots] = now
    f["state"][req.slots] = BUSY
    return Batch(req, semantic, global_ids, now), failures


def publish(seg: Segment, req: Requests, pcm16: np.ndarray | None, rows16: np.ndarray,
            pcm32: np.ndarray | None, rows32: np.ndarray) -> int:  # fmt: skip
    """Write a decoded batch's audio and results into its slots (then ``ring`` them).

    ``pcm16`` (B16, N) int16 holds the rows ``rows16`` of ``req``; ``pcm32`` (B32, N) float32
    the rows ``rows32``. N covers the longest row; each row's samples past its own length are
    written too (zeros) but never read. Returns the time of publishing (monotonic ns).
    """
    slots = req.slots
    if len(rows16):
        seg.pcm16[slots[rows16], : pcm16.shape[1]] = pcm16
    if len(rows32):
        seg.pcm32[slots[rows32], : pcm32.shape[1]] = pcm32
    now = time.monotonic_ns()
    f = seg.field
    f["status"][slots] = Status.OK
    f["n_samples"][slots] = req.lengths * HOP
    f["result_seq"][slots] = req.seqs
    f["t_done_ns"][slots] = now
    # Order matters: audio and result fields above, then the state word; the posts (``ring``)
    # come after the caller has counted the batch, so that an owner who reads the counters
    # right after its answer sees its request in them.
    f["state"][slots] = DONE
    return now


def publish_failure(seg: Segment, slot: int, status: int, message: str, *, seq: int | None = None,
                    notify: int | None = None) -> int:  # fmt: skip
    """Write an error as one request's answer (then ``ring`` it with the returned bell).

    ``seq``/``notify`` come from a validated copy of the header when known.
    """
    f = seg.field
    if seq is None:
        seq = int(f["request_seq"][slot])
    if notify is None:
        notify = int(f["notify"][slot])
        if notify != NO_BELL and notify >= seg.layout.n_slots:
            notify = NO_BELL
    f["status"][slot] = status
    f["n_samples"][slot] = 0
    f["error"][slot] = message.encode("utf-8")[:ERROR_TEXT_BYTES]
    f["result_seq"][slot] = seq
    f["t_done_ns"][slot] = time.monotonic_ns()
    f["state"][slot] = DONE  # order matters: after the result fields, before the post
    return notify


def ring(seg: Segment, slots: list[int], bells: list[int]) -> None:
    """Post each answered slot's ``done`` (and its bell): its owner may read the result now."""
    for slot, bell in zip(slots, bells):
        seg.done(slot).release()  # the pairing post: the owner reads the result after taking it
        if bell != NO_BELL:
            seg.bell(bell).release()  # a wake-up only, after done.I
