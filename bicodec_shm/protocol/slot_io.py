"""The server's side of the slot table, vectorised over a batch: read requests in, write results out.

Every function here takes whole arrays of slots: one numpy operation per field for the batch,
not one per row. Only the semaphore posts remain per row. Nothing read from shared memory is
trusted: ``check_headers`` validates a private copy of each slot header, ``gather`` validates
the private copy of the ids that the model will see (a client cannot change them after the
check), and every length is clamped to what the slot holds.

Shapes: ``B`` rows in the batch, ``T`` the longest row's frames (BiCodec: semantic tokens),
``N = spf·T`` samples (``spf`` the codec's samples per frame, 320 for BiCodec; ``end_trim``
fewer for a codec whose decoder ends short, ``CodecLayout.decoded_samples``). The codes of
level ``i`` are (B, r_i·T), ``r_i`` its codes per frame (``seg.codec``).

Encode requests (``FLAG_ENCODE``, layout.py) take the same steps the other way round:
``check_headers`` checks their audio's length (and that this server encodes), ``gather`` copies
their audio (B, A) float32, A the longest row's ``audio_samples``, into a batch of encode rows
alone (the server never plans the two kinds together), and ``publish_codes`` writes their codes
back where a decode's codes come from. Identity, states and posts are the decode's own.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, fields

import numpy as np

from ..codecs.layout import DEFAULT_NOISE_SEED, CodecLayout
from .layout import (
    BUSY,
    DONE,
    ERROR_TEXT_BYTES,
    FLAG_ENCODE,
    MAX_DUE_IN_US,
    NO_BELL,
    READY,
    REQUEST_ID,
    SLOT_DT,
    Layout,
    Status,
)
from .posts import post
from .segment import Segment

log = logging.getLogger("bicodec_shm.server")


# A client-written submit time is trusted only within this much before the server first saw
# the request (and never after it): garbage there must not overflow the server's accounting,
# nor, being the batch order's key otherwise, let one client jump every queue.
TRUSTED_QUEUE_NS = 3600 * 10**9

# The ufuncs themselves: ndarray.max() and np.clip() go through Python wrappers that cost as much
# again as the reduction or the clipping of a few rows.
_MAX = np.maximum.reduce
_clip = getattr(np, "_core", getattr(np, "core", None)).umath.clip

# A slot header as whole 64-bit words (SLOT_DT's itemsize is a multiple of 8): copying rows of
# a plain array is about twice as fast as a fancy index over the structured dtype, which copies
# field by field.
_WORDS = SLOT_DT.itemsize // 8
assert SLOT_DT.itemsize % 8 == 0, "slot headers are copied as 64-bit words"
_ID_OFFSET = SLOT_DT.fields[REQUEST_ID[0]][1]  # the request identity: 3 contiguous u8 words


def _copy_headers(seg: Segment, slots: np.ndarray) -> np.ndarray:
    """A private (B,) SLOT_DT copy of the headers of ``slots``."""
    table = seg.slots.view(np.uint64).reshape(len(seg.slots), _WORDS)
    return table[slots].view(SLOT_DT).reshape(len(slots))


_ROWS = np.arange(256)  # row indices, made once


@dataclass
class Requests:
    """Validated headers of confirmed READY slots (private copies); arrays of B rows."""

    slots: np.ndarray  # (B,) int64
    lengths: np.ndarray  # (B,) int64, each in 1..max_tokens
    ids: np.ndarray  # (B, 3) uint64: the request's identity, copied into the answer
    dtypes: np.ndarray  # (B,) uint32, OutputDtype
    notify: np.ndarray  # (B,) uint32, a bell or NO_BELL
    submitted_ns: np.ndarray  # (B,) int64: the client's submit time, clamped to seen_ns
    seen_ns: np.ndarray  # (B,) int64: when the server took the request's req.I (batch order)
    # (B,) uint64 noise seeds, (B,) uint32 flags (FLAG_NO_NOISE) and (B,) uint32 start frames:
    # SNAC's; None means codecs.DEFAULT_NOISE_SEED, noise on and frame 0 for every row.
    noise_seeds: np.ndarray | None = None
    flags: np.ndarray | None = None
    start_frames: np.ndarray | None = None
    # (B,) int64: when the request's audio is due, seen_ns plus its capped ``due_in_us``; the
    # plans take what is due soonest first. None: due when seen (``due``).
    due_ns: np.ndarray | None = None
    # (B,) uint32: an encode request's audio samples (``FLAG_ENCODE`` in ``flags``; else unused).
    audio_samples: np.ndarray | None = None

    def encodes(self) -> np.ndarray:
        """(B,) bool: the rows that are encode requests (audio in, codes back)."""
        if self.flags is None:
            return np.zeros(len(self.slots), bool)
        return (self.flags & FLAG_ENCODE) != 0

    def due(self) -> np.ndarray:
        """(B,) int64: when each request's audio is due (its seen time where it says nothing)."""
        return self.seen_ns if self.due_ns is None else self.due_ns

    def take(self, index: np.ndarray | list[int] | slice) -> Requests:
        """The rows ``index`` as a new ``Requests`` (``self`` if that is every row in order:
        nothing here is ever written in place)."""
        n = len(self.slots)
        if n == 1 and len(index) == 1:  # (split passes slices, and only for 2 rows or more)
            return self
        if (isinstance(index, np.ndarray) and index.dtype.kind == "i" and len(index) == n
                and n <= len(_ROWS) and not (index - _ROWS[:n]).any()):  # fmt: skip
            return self  # e.g. plan_batch's order of rows of one length: no 9 copies
        return Requests(*(None if a is None else a[index] for a in self._columns()))

    def __len__(self) -> int:
        return len(self.slots)

    @classmethod
    def concat(cls, parts: list[Requests]) -> Requests:
        """The rows of ``parts`` (at least one), in order, as one ``Requests``: one
        concatenation per column, however many parts."""
        parts = [p for p in parts if len(p)] or parts[:1]
        if len(parts) == 1:
            return parts[0]
        columns = list(zip(*(p._columns() for p in parts)))
        if any(len({c is None for c in column}) > 1 for column in columns):
            raise ValueError("Requests.concat: some parts have a column that others lack")
        return cls(*(None if column[0] is None else np.concatenate(column) for column in columns))

    def _columns(self) -> list[np.ndarray | None]:
        """Every field, in declaration order (a new field is then never left out)."""
        return [getattr(self, name) for name in _REQUEST_FIELDS]


_REQUEST_FIELDS = tuple(f.name for f in fields(Requests))


@dataclass
class Batch:
    """Requests gathered for one forward pass, sorted longest first.

    ``semantic`` (B, T) int64: level 0's codes (BiCodec's semantic ids), right-padded with 0;
    ``global_ids`` (B, n_global) int64; ``levels`` the codes of levels 1.. (B, r_i·T) int64,
    padded likewise (empty for a one-level codec). ``queued``: the requests that waited when it
    was planned, its own included (0: not counted; the server's reading of its load).
    ``warmup_ns``: what its decode spent preparing the decoder (tracing a graph: a one-off)
    rather than decoding; the server measures no cost on a batch where it is not 0.

    An encode batch (``audio`` not None) holds ``audio`` (B, A) float32, right-padded with 0
    (A: its longest row's samples, ``requests.audio_samples``), and empty (B, 0) ``semantic``
    and ``global_ids``: it has no codes until the encoder makes them.
    """

    requests: Requests
    semantic: np.ndarray
    global_ids: np.ndarray
    started_ns: int
    levels: tuple[np.ndarray, ...] = ()
    queued: int = 0
    warmup_ns: int = 0
    audio: np.ndarray | None = None

    @property
    def frames(self) -> int:
        """T: the frames of its longest row, what its padded cost is counted in."""
        return int(self.semantic.shape[1]) if self.audio is None else int(self.lengths.max())

    @property
    def audio_lengths(self) -> np.ndarray:
        """(B,) int64 samples of each encode row's audio."""
        return self.requests.audio_samples.astype(np.int64)

    @property
    def codes(self) -> list[np.ndarray]:
        """Every level's codes, coarsest first: ``[(B, r_0·T), (B, r_1·T), ...]``."""
        return [self.semantic, *self.levels]

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
            if self.audio is not None:
                a = int(req.audio_samples.max())
                halves.append(Batch(req, self.semantic[rows], self.global_ids[rows], self.started_ns,
                                    audio=self.audio[rows, :a]))  # fmt: skip
                continue
            t = int(req.lengths.max())
            rates = [level.shape[1] // self.semantic.shape[1] for level in self.levels]
            halves.append(Batch(req, self.semantic[rows, :t], self.global_ids[rows], self.started_ns,
                                tuple(lv[rows, : r * t] for lv, r in zip(self.levels, rates))))
        return halves[0], halves[1]


Failure = tuple[int, int, str]  # (slot, Status, message)


def check_headers(seg: Segment, slots: np.ndarray, seen_ns: np.ndarray, *, n_bells: int,
                  ) -> tuple[Requests, list[Failure]]:  # fmt: skip
    """Copy the headers of ``slots`` (confirmed: their req.I was taken at ``seen_ns``, (B,)
    int64) and validate them.

    Returns the valid rows and a failure for each invalid one; rows not READY are dropped.
    """
    if len(slots) == 1:
        return _check_one(seg, int(slots[0]), int(seen_ns[0]), n_bells=n_bells)
    rows = _copy_headers(seg, slots)  # private: later client writes cannot reach it
    n_tokens, notify = rows["n_tokens"], rows["notify"]
    # req.I was posted but the slot is not READY: no request of a well-behaved client (they
    # post only after READY, and claims and reaps drain stale posts). Ignore it rather than
    # write a result into a slot its owner may be filling right now.
    stray = rows["state"] != READY
    bad = (
        # n_tokens outside 1..max_tokens: n - 1 wraps to 2**32 - 1 for 0 (uint32)
        ((n_tokens - np.uint32(1)) >= seg.layout.max_tokens)
        | (rows["n_global"] != seg.codec.n_global)
        | (rows["dtype"] > 1)  # OutputDtype: 0 int16, 1 float32
        | (rows["req_generation"] != rows["generation"])
        # a bell out of range; NO_BELL (2**32 - 1) + 1 wraps to 0 (uint32)
        | ((notify + np.uint32(1)) > n_bells)
    )  # fmt: skip
    encode = (rows["flags"] & FLAG_ENCODE) != 0
    if encode.any():
        bad |= encode & ~_audio_fits(seg.layout, rows["audio_samples"], n_tokens)
    seen = np.asarray(seen_ns, np.int64)
    slots = np.asarray(slots, np.int64)
    failures: list[Failure] = []
    if (stray | bad).any():  # the rare path: drop strays, name the first problem of each bad row
        bad &= ~stray
        failures = [(int(slots[j]), *_problem(rows[j], seg.layout, n_bells))
                    for j in np.flatnonzero(bad).tolist()]  # fmt: skip
        ok = ~(stray | bad)
        if not ok.any():
            return _empty_requests(), failures
        rows, slots, seen = rows[ok], slots[ok], seen[ok]
        n_tokens, notify = rows["n_tokens"], rows["notify"]
    # Every array below is a private copy, or a view of one (``rows``).
    # Clamped in uint64 first: a garbage submit time must not wrap when made signed.
    submitted = _clip(rows["t_submit_ns"], np.uint64(0), np.uint64(2**62)).astype(np.int64)
    requests = Requests(
        slots=slots,
        lengths=n_tokens.astype(np.int64),
        ids=np.ndarray((len(rows), 3), np.uint64, rows, _ID_OFFSET, (SLOT_DT.itemsize, 8)),  # (B, 3)
        dtypes=rows["dtype"],
        notify=notify,
        submitted_ns=_clip(submitted, seen - TRUSTED_QUEUE_NS, seen),
        seen_ns=seen,
        noise_seeds=rows["noise_seed"],
        flags=rows["flags"],
        start_frames=rows["start_frame"],
        due_ns=seen + 1000 * np.minimum(rows["due_in_us"], MAX_DUE_IN_US).astype(np.int64),
        audio_samples=rows["audio_samples"],
    )
    return requests, failures


_FIELD = {name: i for i, name in enumerate(SLOT_DT.names)}
# The fields _check_one reads, out of a header's tuple in one call.
_PICK = operator.itemgetter(*(_FIELD[f] for f in (
    "state", "n_tokens", "n_global", "dtype", "req_generation", "generation", "notify",
    "t_submit_ns", *REQUEST_ID, "noise_seed", "flags", "start_frame", "due_in_us",
    "audio_samples")))  # fmt: skip


def _check_one(seg: Segment, slot: int, seen: int, *, n_bells: int) -> tuple[Requests, list[Failure]]:
    """``check_headers`` for a single slot, with Python scalars: the common case at low load
    costs a few microseconds instead of a dozen numpy calls."""
    # A private copy, as above, as one tuple of Python scalars: np.void.copy() costs ~9 us.
    v = seg.slots[slot].item()
    (state, n, n_global, dtype, req_generation, generation, notify, t_submit,
     *ids, seed, flags, start, due_in, audio) = _PICK(v)
    if state != READY:
        return _empty_requests(), []
    if (
        not 1 <= n <= seg.layout.max_tokens
        or n_global != seg.codec.n_global
        or dtype > 1
        or req_generation != generation
        or (notify != NO_BELL and notify >= n_bells)
        or (flags & FLAG_ENCODE and not _audio_fits(seg.layout, audio, n))
    ):
        row = dict(zip(SLOT_DT.names, v))
        return _empty_requests(), [(slot, *_problem(row, seg.layout, n_bells))]
    submitted = min(max(t_submit, seen - TRUSTED_QUEUE_NS), seen)
    # Three arrays, one per dtype, and the fields as views of them: a numpy array from a list
    # costs ~1 us, a slice a fifth of that.
    i64 = np.array((slot, n, submitted, seen, seen + 1000 * min(due_in, MAX_DUE_IN_US)), np.int64)
    u64 = np.array((*ids, seed), np.uint64)
    u32 = np.array((dtype, notify, flags, start, audio), np.uint32)
    requests = Requests(
        slots=i64[0:1],
        lengths=i64[1:2],
        ids=u64[None, 0:3],  # (1, 3)
        dtypes=u32[0:1],
        notify=u32[1:2],
        submitted_ns=i64[2:3],
        seen_ns=i64[3:4],
        noise_seeds=u64[3:4],
        flags=u32[2:3],
        start_frames=u32[3:4],
        due_ns=i64[4:5],
        audio_samples=u32[4:5],
    )
    return requests, []


def _empty_requests() -> Requests:
    empty = [np.zeros(0, dt) for dt in (np.int64, np.int64, np.uint64, np.uint32, np.uint32,
                                        np.int64, np.int64)]  # fmt: skip
    empty[2] = np.zeros((0, 3), np.uint64)
    return Requests(*empty, np.zeros(0, np.uint64), np.zeros(0, np.uint32), np.zeros(0, np.uint32),
                    np.zeros(0, np.int64), np.zeros(0, np.uint32))  # fmt: skip


def local_requests(lengths: np.ndarray) -> Requests:
    """Headers of rows that come from no slot (a benchmark's batch, the server's warm-up):
    slots ``0..B-1``, the (B,) int64 ``lengths``, no bell, the default noise seed, noise on,
    start frame 0."""
    b = len(lengths)
    zeros = np.zeros(b, np.int64)
    return Requests(slots=np.arange(b, dtype=np.int64), lengths=np.asarray(lengths, np.int64),
                    ids=np.zeros((b, 3), np.uint64), dtypes=np.zeros(b, np.uint32),
                    notify=np.full(b, NO_BELL, np.uint32), submitted_ns=zeros, seen_ns=zeros,
                    noise_seeds=np.full(b, DEFAULT_NOISE_SEED, np.uint64), flags=np.zeros(b, np.uint32),
                    start_frames=np.zeros(b, np.uint32))  # fmt: skip


def zero_batch(codec: CodecLayout, rows: int, frames: int) -> Batch:
    """``rows`` rows of ``frames`` frames of ``codec``, every code and global id 0 (a valid id
    of every codec): a decode with a real batch's shapes (the server's warm-up)."""
    levels = [np.zeros((rows, rate * frames), np.int64) for rate in codec.level_rates]
    return Batch(local_requests(np.full(rows, frames, np.int64)), levels[0],
                 np.zeros((rows, codec.n_global), np.int64), 0, tuple(levels[1:]))  # fmt: skip


def _audio_fits(layout: Layout, samples: np.ndarray | int, n_tokens: np.ndarray | int) -> np.ndarray | bool:
    """Whether an encode request's audio length is one this server takes: it encodes, the
    audio is between its encoder's shortest and the slot's PCM area, and ``n_tokens`` is the
    frames the audio spans (what the planner counts). Works on arrays (int64 arithmetic: a
    garbage uint32 must not wrap) and on Python ints."""
    if not layout.encodes:
        return np.zeros(np.shape(samples), bool) if np.ndim(samples) else False
    spf = layout.codec.samples_per_frame
    a = np.asarray(samples).astype(np.int64) if np.ndim(samples) else int(samples)
    n = np.asarray(n_tokens).astype(np.int64) if np.ndim(n_tokens) else int(n_tokens)
    fits = (a >= layout.encode_min_samples) & (a <= layout.max_audio_samples) & (n == (a + spf - 1) // spf)
    return fits if np.ndim(fits) else bool(fits)


def _problem(row: np.void | dict, layout: Layout, n_bells: int) -> tuple[int, str]:
    """(Status, message) of the first thing wrong with one slot header (a copied record, or
    its fields by name)."""
    max_tokens, n_global = layout.max_tokens, layout.codec.n_global
    if int(row["flags"]) & FLAG_ENCODE and not layout.encodes:
        return Status.NO_ENCODER, ("this server does not encode: it was started without "
                                   "--encode (`bicodec-shm serve --encode`)")  # fmt: skip
    n = int(row["n_tokens"])
    if not 1 <= n <= max_tokens:
        return Status.BAD_LENGTH, f"semantic length {n} is outside 1..{max_tokens}"
    if int(row["n_global"]) != n_global:
        return Status.BAD_GLOBAL, f"{int(row['n_global'])} global ids, expected {n_global}"
    if int(row["dtype"]) > 1:
        return Status.BAD_DTYPE, f"unknown output dtype code {int(row['dtype'])}"
    if int(row["req_generation"]) != int(row["generation"]):
        return Status.STALE_GENERATION, (
            f"request names slot generation {int(row['req_generation'])} but the slot is at "
            f"{int(row['generation'])} (it was reclaimed)"
        )
    if int(row["flags"]) & FLAG_ENCODE and not _audio_fits(layout, int(row["audio_samples"]), n):
        spf = layout.codec.samples_per_frame
        return Status.BAD_AUDIO, (
            f"audio of {int(row['audio_samples'])} samples spanning {n} frame(s) of {spf}: the "
            f"encoder takes {layout.encode_min_samples}..{layout.max_audio_samples} samples"
        )
    return Status.BAD_NOTIFY, f"bell index {int(row['notify'])} out of range"


def gather(seg: Segment, req: Requests, *, semantic_vocab: int | None = None,
           global_vocab: int | None = None) -> tuple[Batch | None, list[Failure]]:  # fmt: skip
    """Copy the codes of ``req`` (sorted longest first by the caller) and validate the copy.

    Rows with an id out of range fail alone; the others form the batch (None if none is left).
    ``semantic_vocab`` and ``global_vocab`` override the vocabularies of level 0 and of the
    global ids (default: the segment's codec).
    """
    if req.flags is not None and int(req.flags[0]) & FLAG_ENCODE:  # a batch is of one kind
        return _gather_audio(seg, req)
    codec = seg.codec
    vocabs = codec.level_vocab
    if semantic_vocab is not None:
        vocabs = (semantic_vocab, *vocabs[1:])
    global_vocab = codec.global_vocab if global_vocab is None else global_vocab
    if len(req) == 1:  # slices, not fancy indexing: the common case at low load
        s = int(req.slots[0])
        t = int(req.lengths[0])
        semantic = seg.tokens[s : s + 1, :t].astype(np.int64)  # (1, T): a private copy
        global_ids = seg.globals[s : s + 1].astype(np.int64)  # (1, n_global)
    else:
        t = int(req.lengths.max())
        semantic = seg.tokens[req.slots, :t].astype(np.int64)  # (B, T): a private copy
        if int(req.lengths.min()) < t:
            # The padding: whatever the slot holds there is not ours to decode.
            semantic[np.arange(t) >= req.lengths[:, None]] = 0
        global_ids = seg.globals[req.slots].astype(np.int64)  # (B, n_global)
    codes = [semantic]
    if codec.n_levels > 1:
        codes += [_gather_level(seg, req, i, t) for i in range(1, codec.n_levels)]
    failures: list[Failure] = []
    bad = None  # (B,) bool of the rows left out, once there are any
    # One reduction per array: seen as uint64, a negative id is >= 2**63, so "0 <= id < vocab"
    # is "id < vocab" (the copies are fresh C-contiguous int64 arrays, never empty: t >= 1).
    in_range = all(_MAX(c.view(np.uint64), axis=None) < v for c, v in zip(codes, vocabs))
    if in_range and global_ids.size:
        in_range = _MAX(global_ids.view(np.uint64), axis=None) < global_vocab
    if not in_range:  # the rare path: find the rows out of range, and why
        bad_codes = [((c < 0) | (c >= v)).any(axis=1) for c, v in zip(codes, vocabs)]
        bad_glb = ((global_ids < 0) | (global_ids >= global_vocab)).any(axis=1)
        bad = np.logical_or.reduce([*bad_codes, bad_glb])
        for j in np.flatnonzero(bad).tolist():
            level = next((i for i, b in enumerate(bad_codes) if b[j]), None)
            if level is not None:
                row, vocab = codes[level][j], vocabs[level]
                pos = int(np.flatnonzero((row < 0) | (row >= vocab))[0])
                what = "semantic id" if codec.n_levels == 1 else f"levels[{level}] code"
                failures.append((int(req.slots[j]), Status.BAD_SEMANTIC_ID,
                                 f"{what} {int(row[pos])} at position {pos} is outside "
                                 f"0..{vocab - 1}"))  # fmt: skip
            else:
                pos = int(np.flatnonzero((global_ids[j] < 0) | (global_ids[j] >= global_vocab))[0])
                failures.append((int(req.slots[j]), Status.BAD_GLOBAL,
                                 f"global id {int(global_ids[j, pos])} at position {pos} is outside "
                                 f"0..{global_vocab - 1}"))  # fmt: skip
    bad = _leave_out_moved(seg, req, bad, failures)
    if failures:
        keep = ~bad
        if not keep.any():
            return None, failures
        req = req.take(keep)
        t = int(req.lengths.max())
        codes = [c[keep, : r * t] for c, r in zip(codes, codec.level_rates)]
        semantic, global_ids = codes[0], global_ids[keep]
    now = _mark_busy(seg, req)
    return Batch(req, semantic, global_ids, now, tuple(codes[1:])), failures


def _gather_audio(seg: Segment, req: Requests) -> tuple[Batch | None, list[Failure]]:
    """``gather`` for encode requests: a private (B, A) float32 copy of their audio, zero
    past each row's ``audio_samples`` (checked against the slot's PCM area by check_headers);
    a row with a sample that is not finite fails alone (BAD_AUDIO)."""
    n = req.audio_samples.astype(np.int64)
    a = int(n.max())
    if len(req) == 1:
        s = int(req.slots[0])
        audio = seg.pcm32[s : s + 1, :a].copy()  # (1, A): a private copy
    else:
        audio = seg.pcm32[req.slots, :a]  # (B, A): a private copy (fancy indexing copies)
        if int(n.min()) < a:
            audio[np.arange(a) >= n[:, None]] = 0.0  # the padding is not the request's
    failures: list[Failure] = []
    bad = None
    finite = np.isfinite(audio)
    if not finite.all():  # the rare path: name the first bad sample of each bad row
        bad = ~finite.all(axis=1)
        for j in np.flatnonzero(bad).tolist():
            pos = int(np.flatnonzero(~finite[j])[0])
            message = f"audio sample {float(audio[j, pos])} at position {pos} is not finite"
            failures.append((int(req.slots[j]), Status.BAD_AUDIO, message))
    bad = _leave_out_moved(seg, req, bad, failures)
    if failures:
        keep = ~bad
        if not keep.any():
            return None, failures
        req = req.take(keep)
        audio = audio[keep, : int(req.audio_samples.max())]
    now = _mark_busy(seg, req)
    empty = np.zeros((len(req), 0), np.int64)  # no codes until the encoder makes them
    return Batch(req, empty, empty, now, audio=audio), failures


def _leave_out_moved(seg: Segment, req: Requests, bad: np.ndarray | None,
                     failures: list[Failure]) -> np.ndarray | None:  # fmt: skip
    """Last, right before the state store: a slot its owner freed (and someone else may have
    claimed) since its request was confirmed is not that request's any more. Appends its
    failure; returns ``bad`` (B,) with those rows added (None if no row is bad)."""
    moved = _not_ready_at_epoch(seg, req)
    if moved is not None:
        failures += [(slot, Status.BAD_STATE, f"slot {slot} was freed by its client before it was batched")
                     for slot in req.slots[moved].tolist()]  # fmt: skip
        bad = moved if bad is None else bad | moved
    return bad


def _mark_busy(seg: Segment, req: Requests) -> int:
    """Mark the gathered requests BUSY, with their start time (returned, monotonic ns)."""
    now = time.monotonic_ns()
    f = seg.field
    where = int(req.slots[0]) if len(req) == 1 else req.slots
    f["t_start_ns"][where] = now
    f["state"][where] = BUSY
    return now


def _not_ready_at_epoch(seg: Segment, req: Requests) -> np.ndarray | None:
    """(B,) bool of the rows of ``req`` whose slot is no longer READY at the epoch its request
    named, or None if there is none (the common case: two scalar reads for one row)."""
    f = seg.field
    if len(req) == 1:
        s = int(req.slots[0])
        if f["state"][s] == READY and f["generation"][s] == req.ids[0, 1]:
            return None
        return np.ones(1, bool)
    moved = (f["state"][req.slots] != READY) | (f["generation"][req.slots] != req.ids[:, 1])
    return moved if moved.any() else None


def _gather_level(seg: Segment, req: Requests, level: int, t: int) -> np.ndarray:
    """A private (B, r·T) int64 copy of ``level``'s codes, right-padded with 0."""
    rate = seg.codec.level_rates[level]
    start = seg.layout.level_offset(level)
    cols = slice(start, start + rate * t)
    if len(req) == 1:
        s = int(req.slots[0])
        return seg.tokens[s : s + 1, cols].astype(np.int64)
    codes = seg.tokens[req.slots, cols].astype(np.int64)
    if int(req.lengths.min()) < t:
        codes[np.arange(rate * t) >= rate * req.lengths[:, None]] = 0
    return codes


def publish(seg: Segment, req: Requests, pcm16: np.ndarray | None, rows16: np.ndarray,
            pcm32: np.ndarray | None, rows32: np.ndarray) -> tuple[int, list[int]]:  # fmt: skip
    """Write a decoded batch's audio and results into its slots (then ``ring`` them).

    ``pcm16`` (B16, N) int16 holds the rows ``rows16`` of ``req``; ``pcm32`` (B32, N) float32
    the rows ``rows32``. N covers the longest row; each row's samples past its own length are
    written too (zeros) but never read. Returns the time of publishing (monotonic ns) and the
    rows left unanswered because their slot moved on under the batch (``moved_on``): ring
    only the others.
    """
    if len(req) == 1:  # scalar stores: the common case at low load
        s = int(req.slots[0])
        if len(rows16):
            seg.pcm16[s, : pcm16.shape[1]] = pcm16[0]
        else:
            seg.pcm32[s, : pcm32.shape[1]] = pcm32[0]
        now = time.monotonic_ns()
        f = seg.field
        f["status"][s] = Status.OK
        f["n_samples"][s] = seg.codec.decoded_samples(int(req.lengths[0]))
        seg.result_id[s] = req.ids[0]  # the answer names its request
        f["t_done_ns"][s] = now
        # Order matters, as below: the check right before the state word.
        if f["state"][s] != BUSY or f["generation"][s] != req.ids[0, 1]:
            return now, [0]
        f["state"][s] = DONE
        return now, []
    slots = req.slots
    # rows16 and rows32 are ascending row indices: all of them (the common case) is every slot.
    if len(rows16):
        seg.pcm16[slots if len(rows16) == len(slots) else slots[rows16], : pcm16.shape[1]] = pcm16
    if len(rows32):
        seg.pcm32[slots if len(rows32) == len(slots) else slots[rows32], : pcm32.shape[1]] = pcm32
    return _answer_rows(seg, req, seg.codec.decoded_samples(req.lengths))


def publish_codes(seg: Segment, req: Requests, codes: list[np.ndarray], global_ids: np.ndarray,
                  frames: np.ndarray) -> tuple[int, list[int]]:  # fmt: skip
    """Write an encoded batch's codes and results into its slots (then ``ring`` them), as
    ``publish`` writes audio: ``codes`` is every level's (B, r_i·T) integer codes, coarsest
    first, ``global_ids`` (B, n_global) and ``frames`` (B,) each row's own frames (at most
    the frames its audio spans, ``req.lengths``: never past its slot's codes row). Returns as
    ``publish``."""
    slots = req.slots
    frames = np.minimum(np.asarray(frames, np.int64), req.lengths)
    t = int(frames.max())
    for level, (c, rate) in enumerate(zip(codes, seg.codec.level_rates)):
        start = seg.layout.level_offset(level)
        seg.tokens[slots, start : start + rate * t] = c[:, : rate * t]
    if seg.codec.n_global:
        seg.globals[slots] = global_ids
    seg.field["result_frames"][slots] = frames
    return _answer_rows(seg, req, 0)


def _answer_rows(seg: Segment, req: Requests, n_samples: np.ndarray | int) -> tuple[int, list[int]]:
    """The result fields of a batch whose payload is written, then DONE where each slot is
    still the request's (``moved_on``); returns the time and the rows left unanswered."""
    slots = req.slots
    now = time.monotonic_ns()
    f = seg.field
    f["status"][slots] = Status.OK
    f["n_samples"][slots] = n_samples
    seg.result_id[slots] = req.ids  # each answer names its request
    f["t_done_ns"][slots] = now
    # Order matters: payload and result fields above, then the check, then the state word; the
    # posts (``ring``) come after the caller has counted the batch, so that an owner who reads
    # the counters right after its answer sees its request in them.
    moved = moved_on(seg, req)
    if moved.any():
        f["state"][slots[~moved]] = DONE
        return now, np.flatnonzero(moved).tolist()
    f["state"][slots] = DONE
    return now, []


def moved_on(seg: Segment, req: Requests) -> np.ndarray:
    """(B,) bool: the rows of ``req`` whose slot is no longer BUSY at the claim epoch the
    request named, because its owner freed it under the batch (no well-behaved client does,
    but any client may write its slot's state word) and maybe someone claimed it since.

    Their answer must not be published: DONE and the old identity would overwrite the next
    owner's READY, which the dispatcher skipped while the slot was held, and that request
    would never be answered. The audio and result fields written before the check are
    harmless: a slot's owner reads them only after its own request's DONE and post. Only the
    moment between this check and the state store is left to a race (a free and a new
    claim and submit within it)."""
    f = seg.field
    slots = req.slots
    return (f["state"][slots] != BUSY) | (f["generation"][slots] != req.ids[:, 1])


def publish_failure(seg: Segment, slot: int, status: int, message: str, *,
                    ids: np.ndarray | None = None, notify: int | None = None) -> int | None:  # fmt: skip
    """Write an error as one request's answer (then ``ring`` it with the returned bell).

    ``ids`` (3,) (the request's identity) and ``notify`` come from a validated copy of the
    header when known; else they are read from the slot now. With ``ids``, a slot that is no
    longer READY or BUSY at the epoch they name is not answered (see ``moved_on``): None.
    """
    f = seg.field
    validated = ids is not None
    if ids is None:
        ids = seg.request_id[slot].copy()
    if notify is None:
        notify = int(f["notify"][slot])
        if notify != NO_BELL and notify >= seg.layout.n_slots:
            notify = NO_BELL
    f["status"][slot] = status
    f["n_samples"][slot] = 0
    f["error"][slot] = message.encode("utf-8")[:ERROR_TEXT_BYTES]
    seg.result_id[slot] = ids
    f["t_done_ns"][slot] = time.monotonic_ns()
    if validated and (f["state"][slot] not in (READY, BUSY) or f["generation"][slot] != ids[1]):
        return None
    f["state"][slot] = DONE  # order matters: after the result fields, before the post
    return notify


def ring(seg: Segment, slots: list[int], bells: list[int]) -> None:
    """Post each answered slot's ``done`` (and its bell): its owner may read the result now.

    Every row is rung whatever fails for another: one bad post must not leave its batchmates
    waiting for an answer that is already written."""
    for slot, bell in zip(slots, bells):
        try:
            post(seg.done(slot))  # the pairing post: the owner reads the result after taking it
            if bell != NO_BELL:
                post(seg.bell(bell))  # a wake-up only, after done.I
        except Exception:  # noqa: BLE001 - a semaphore error must not cost the other rows
            log.exception("could not ring slot %d", slot)
