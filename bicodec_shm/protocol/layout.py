"""The segment's byte layout: its header and slot records, the states a slot moves through, and the
offset of every region. Pure data: no system calls here.

Segment layout (all offsets are multiples of 64 bytes)::

    0                     HEADER_SIZE            slots_off            tokens_off
    +---------------------+----------------------+--------------------+-----------------+
    | header (HEADER_DT)  | padding to 4 KiB     | slot table         | codes           |
    | magic, version,     |                      | n_slots x SLOT_DT  | n_slots x       |
    | sizes, codec layout,|                      | (state, epoch,     | max_tokens x    |
    | counters, histos    |                      |  identities, lens, | codes_per_frame |
    |                     |                      |  status)           | int32           |
    +---------------------+----------------------+--------------------+-----------------+
    globals_off           pcm_off                                  sems_off         total_size
    +---------------------+----------------------------------------+----------------+
    | global tokens       | PCM areas: n_slots x (max_tokens*spf*4)| semaphores     |
    | n_slots x n_global  | bytes, int16 or float32, in place      | (2+3n) x sem_t |
    |                     | (an encode's audio in: float32)        |                |
    +---------------------+----------------------------------------+----------------+

The codec seam. A server serves one codec, named in the header with its token layout
(``codecs.CodecLayout``: levels, codes per frame at each level, vocabularies, samples per frame
``spf``, sample rate, global ids). ``max_tokens`` counts *frames* (BiCodec: semantic tokens).
A slot's codes row holds level ``i`` at columns ``[max_tokens·P_i, max_tokens·P_(i+1))``, with
``P_i`` the sum of the rates of the levels before ``i``; a request of ``n`` frames fills the
first ``n·rate_i`` of them. BiCodec (one level, rate 1, 32 globals, spf 320) has exactly the
areas of layout version 3; SNAC (no global ids) has an empty global area. A slot's
``noise_seed`` (and ``flags`` bit ``FLAG_NO_NOISE``, and ``start_frame`` for a streaming window)
make a SNAC decode a pure function of its request; BiCodec ignores them.

Identity (an answer names its request). A request carries ``(handle_id, req_generation,
request_seq)``: the attachment's random 64-bit id, the claim epoch of the slot, and the
attachment's sequence number. The server copies the three into ``(result_handle,
result_generation, result_seq)`` with the answer, from its private copy of the request header.
A client takes an answer only if all three match the request it waits for, whatever the
semaphore counts say: so a stale post, a slot handed on to another client, a restarted
sequence counter or a new server incarnation can never deliver another request's audio. The
server refuses a request whose ``req_generation`` is not the slot's ``generation`` (the slot was
reclaimed under it).

Encode (audio -> codes) is a decode run backwards through the same slot, with the same identity,
states, posts and clean-up: ``flags`` bit ``FLAG_ENCODE`` says so. The client writes the audio
(float32) into the slot's PCM area, its length into ``audio_samples`` and the frames that audio
spans (``ceil(audio_samples / spf)``, what the batch planner counts) into ``n_tokens``; the
server writes every level's codes into the codes row (BiCodec: the semantic ids), the global ids
into the global area and the frames it produced into ``result_frames``. The header's
``encodes`` says whether the server loaded an encoder (``serve --encode``), and
``encode_min_samples`` the shortest audio it takes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..codecs.layout import BICODEC, CodecLayout

MAGIC = 0x4D48535F43444342  # b"BCDC_SHM" little-endian
# The magic of a server group's small object under the group's name (group.py). Defined here
# so that the takeover of a dead owner's leftovers (``_check_takeover``) knows it as ours.
GROUP_MAGIC = 0x5052475F43444342  # b"BCDC_GRP" little-endian
# The first 8 bytes of a name's object from its sizing until its real magic is written: a
# server that dies in between leaves something ``_check_takeover`` still knows as ours. (An
# object of zeros is not: it may be anybody's.)
CREATING_MAGIC = 0x5745_4E5F_4344_4342  # b"BCDC_NEW" little-endian
# 3: answers carry their request's identity; 4: the codec seam; 5: a SNAC request's start frame;
# 6: a header describes up to 64 code levels (DAC 24 kHz has 32 codebooks); 7: idle handles'
# warm slots freed by the reaper are counted apart from reclaimed ones (``expired``); 8: the
# codec's ``end_trim`` (an answer has the decoder's own length: DAC 24/16 kHz 8 samples short);
# 9: answers dropped because their slot was freed under the batch are counted (``dropped``),
# and a digest of the segment's description (``digest``); 10: a lane's deliberate waits for its
# clients are counted apart from the host gap (``waited_ns``); 11: a request says when its audio
# is due (``due_in_us``), and the server decodes what is due soonest first; 12: a segment ends in
# a region of process-shared semaphores (``sems_off``), which a segment handed over a socket uses
# (``transport``: handoff.py, shared_sems.py); 13: encode requests (``FLAG_ENCODE``: audio in
# the PCM area, ``audio_samples``; codes back, ``result_frames``) and the header's ``encodes``
# and ``encode_min_samples``
LAYOUT_VERSION = 13
HEADER_SIZE = 4096
HOP = 320  # samples per semantic token at 16 kHz
N_GLOBAL = 32
SEM_BYTES = 32  # sizeof(sem_t), x86-64 and aarch64 glibc
PCM_BYTES_PER_SAMPLE = 4  # sized for float32, the widest output dtype
ERROR_TEXT_BYTES = 200
HIST_BINS = 65  # batch-size histogram: bin b counts batches of b rows (bin 64 = 64 or more)
DEFAULT_MAX_TOKENS = 1500  # 30 s of audio
DEFAULT_SLOTS = 64
MAX_SLOTS = 4096
DEFAULT_MODE = 0o600
DEFAULT_START_WAIT = 30.0  # seconds a new server waits for one stopping under its name
# Code levels a header can describe. An RVQ codec's codebooks are levels of rate 1, and published
# ones have up to 32 (DAC 24 kHz; EnCodec and Mimi at their highest bitrates): 64 leaves room,
# for 512 bytes of header.
MAX_LEVELS = 64
CODEC_NAME_BYTES = 32
FLAG_NO_NOISE = 1  # slot ``flags``: decode without the codec's noise (SNAC's noise=False)
FLAG_ENCODE = 2  # slot ``flags``: an encode request (audio in the PCM area, codes back)
NO_BELL = 0xFFFFFFFF  # ``notify`` of a synchronous request: ring no bell
# The ``free`` doorbell is posted on every give-back but taken only by claimers that wait:
# without a bound its count would grow until sem_post fails with EOVERFLOW. A few posts are
# enough to wake every claimer that waits (each re-scans the table after waking).
FREE_BELL_CAP = 64

# Lock bytes of the segment's inode (see the module docstring).
OWNER_BYTE = 0
SERVING_BYTE = 1
SLOT_BYTE0 = 64
BELL_BYTE0 = SLOT_BYTE0 + MAX_SLOTS

# Upper bounds (seconds) of the latency histograms, Prometheus style (+Inf is the last bin).
# From 1 ms (a GPU batch of short rows) to 60 s (a long utterance on a loaded CPU server).
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)  # fmt: skip
N_TIME_BINS = len(TIME_BUCKETS) + 1


class SlotState(enum.IntEnum):
    FREE = 0
    CLAIMED = 1
    READY = 2
    BUSY = 3
    DONE = 4


# Plain ints for the hot paths: comparing numpy arrays with IntEnum members costs several
# microseconds each (measured 8-16 us vs 2-4 us), which matters at ~100 us per round trip.
FREE, CLAIMED, READY, BUSY, DONE = (int(s) for s in SlotState)


class Phase(enum.IntEnum):
    """The server's life, in the header (informational: liveness is the SERVING lock)."""

    CREATING = 0
    SERVING = 1
    STOPPING = 2
    STOPPED = 3


class OutputDtype(enum.IntEnum):
    INT16 = 0
    FLOAT32 = 1


class Status(enum.IntEnum):
    """Result codes the server writes into a slot; the client turns non-zero into an error."""

    OK = 0
    BAD_LENGTH = 1
    BAD_SEMANTIC_ID = 2
    BAD_GLOBAL = 3
    BAD_DTYPE = 4
    BAD_STATE = 5
    STALE_GENERATION = 6
    BAD_NOTIFY = 7
    DECODE_FAILED = 8
    BAD_AUDIO = 9  # an encode request's audio: a length that does not fit, or a sample not finite
    NO_ENCODER = 10  # an encode request to a server started without ``--encode``


N_STATUS = 16  # room in the header's failed-by-status counters


HEADER_DT = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<u4"),
        ("header_size", "<u4"),
        ("n_slots", "<u4"),
        ("max_tokens", "<u4"),
        ("n_global", "<u4"),
        ("slot_size", "<u4"),
        ("total_size", "<u8"),
        ("semantic_vocab", "<u4"),
        ("global_vocab", "<u4"),
        ("server_pid", "<u8"),  # informational only: in the server's own PID namespace
        ("server_epoch", "<u8"),  # random per server start
        ("server_uid", "<u4"),
        ("phase", "<u4"),  # Phase
        ("max_batch", "<u4"),
        ("lanes", "<u4"),  # decode lanes of the server
        ("busy_lanes", "<u4"),
        ("started_ns", "<u8"),  # CLOCK_MONOTONIC when serving began
        # Live counters, written by the server only (contiguous: viewed as one uint64 array).
        ("requests", "<u8"),
        ("batches", "<u8"),
        ("failed", "<u8"),
        ("reclaimed", "<u8"),
        ("tokens", "<u8"),
        ("padded_tokens", "<u8"),
        ("queue_wait_ns", "<u8"),
        ("decode_ns", "<u8"),
        ("latency_ns", "<u8"),  # submit -> result published, summed over requests
        ("host_gap_ns", "<u8"),  # a lane idle while decodable work waited for the host
        ("lane_busy_ns", "<u8"),  # lanes' time inside the decoder, summed over lanes
        ("expired", "<u8"),  # idle handles' warm slots the reaper freed (``reclaimed``: the rest)
        ("dropped", "<u8"),  # decoded rows not answered: their client freed the slot under the batch
        ("waited_ns", "<u8"),  # a lane holding ready work back on purpose (not in host_gap_ns)
        ("batch_hist", "<u8", (HIST_BINS,)),
        ("failed_by_status", "<u8", (N_STATUS,)),
        ("queue_hist", "<u8", (N_TIME_BINS,)),  # per request, TIME_BUCKETS
        ("latency_hist", "<u8", (N_TIME_BINS,)),  # per request
        ("decode_hist", "<u8", (N_TIME_BINS,)),  # per batch
        # The codec's token layout (codecs.CodecLayout); fixed before the magic is written.
        ("codec", f"S{CODEC_NAME_BYTES}"),
        ("n_levels", "<u4"),
        ("level_rates", "<u4", (MAX_LEVELS,)),
        ("level_vocab", "<u4", (MAX_LEVELS,)),
        ("samples_per_frame", "<u4"),
        ("sample_rate", "<u4"),
        # The one header field clients write: a claimer that found no FREE slot stores a fresh
        # random value here and posts ``ready``; the server reaps at once when it changed
        # (server/server.py, ``_reap_if_due``). A hint, never computed with.
        ("slot_wanted", "<u8"),
        # The codec layout's end_trim (after the rest of the header: every other field keeps
        # its offset).
        ("end_trim", "<u4"),
        # A digest of the fields that describe the segment (``header.DESCRIPTION``), written by
        # the server before the magic: a client attaching refuses a header someone overwrote.
        ("digest", "<u8"),
        # How clients reach the segment (``Transport``): its named object, or the memfd handed
        # over NAME.sock; a named object that says SOCKET is only the server's mirror of it.
        ("transport", "<u4"),
        # Whether the server encodes (1: started with ``--encode``; 0: it answers an encode
        # request with NO_ENCODER), and the fewest samples its encoder takes (0 without one).
        ("encodes", "<u4"),
        ("encode_min_samples", "<u4"),
    ],
    align=True,
)


def shared_mode(mode: int) -> bool:
    """True if ``mode`` lets users other than the server's attach (``--mode 0o660``): its
    segment is then handed over a socket (``Transport.SOCKET``), never a named object."""
    return bool(mode & 0o077)


def name_mode(mode: int) -> int:
    """The mode of the name's own object: its user's bits only, whatever ``mode`` shares."""
    return mode & 0o700


class Transport(enum.IntEnum):
    NAMED = 0  # /dev/shm/NAME is the segment, its semaphores are named (this user only)
    SOCKET = 1  # a sealed memfd handed over /dev/shm/NAME.sock, semaphores inside (--mode 0o660)

COUNTERS = ("requests", "batches", "failed", "reclaimed", "tokens", "padded_tokens",
            "queue_wait_ns", "decode_ns", "latency_ns", "host_gap_ns", "lane_busy_ns", "expired",
            "dropped", "waited_ns")  # fmt: skip
(C_REQUESTS, C_BATCHES, C_FAILED, C_RECLAIMED, C_TOKENS, C_PADDED, C_QUEUE_WAIT, C_DECODE,
 C_LATENCY, C_HOST_GAP, C_LANE_BUSY, C_EXPIRED, C_DROPPED, C_WAITED) = range(len(COUNTERS))  # fmt: skip
assert [HEADER_DT.fields[c][1] for c in COUNTERS] == [
    HEADER_DT.fields[COUNTERS[0]][1] + 8 * i for i in range(len(COUNTERS))
], "counters must be contiguous"
# The per-request and per-batch time histograms, contiguous too: one (3, N_TIME_BINS) view.
TIME_HISTOGRAMS = ("queue_hist", "latency_hist", "decode_hist")
assert [HEADER_DT.fields[h][1] for h in TIME_HISTOGRAMS] == [
    HEADER_DT.fields[TIME_HISTOGRAMS[0]][1] + 8 * N_TIME_BINS * i for i in range(3)
], "time histograms must be contiguous"


SLOT_DT = np.dtype(
    [
        ("state", "<u4"),
        ("dtype", "<u4"),  # OutputDtype
        # The claim epoch: bumped by every claimer (under the slot's lock) and by the reaper.
        ("generation", "<u8"),
        # The request's identity, written by its client (contiguous: viewed as (n_slots, 3)):
        ("handle_id", "<u8"),  # random per client attachment
        ("req_generation", "<u8"),  # the claim epoch the client owns
        ("request_seq", "<u8"),  # per attachment, from 1
        # The answer's identity: the server copies the request's identity here with the result.
        ("result_handle", "<u8"),
        ("result_generation", "<u8"),
        ("result_seq", "<u8"),
        # Informational only (in the owner's own PID namespace); 0 on a slot an idle handle
        # let go of warm, which the reaper counts as expired rather than reclaimed.
        ("owner_pid", "<u8"),
        ("n_tokens", "<u4"),
        ("n_global", "<u4"),
        ("notify", "<u4"),  # bell to ring besides done.I, or NO_BELL
        ("status", "<i4"),  # Status
        ("n_samples", "<u8"),
        ("t_submit_ns", "<u8"),  # CLOCK_MONOTONIC, client-written: clamped before any use
        ("t_start_ns", "<u8"),
        ("t_done_ns", "<u8"),
        ("noise_seed", "<u8"),  # SNAC: the request's noise (codecs.DEFAULT_NOISE_SEED if unnamed)
        ("flags", "<u4"),  # FLAG_NO_NOISE
        ("error", f"S{ERROR_TEXT_BYTES}"),
        # SNAC: the frame at which a streaming window starts in its utterance, so that it draws
        # the full decode's noise there (0 for a whole utterance). Last, in what was the
        # record's tail padding: every other field keeps its offset and the record its size.
        ("start_frame", "<u4"),
        # Microseconds after its submit at which the request's audio is due: a stream's audio
        # still buffered at its listener (0: due now, as a whole utterance is). Client-written:
        # the server caps it at MAX_DUE_IN_US and orders its plans by it (slot_io.py).
        ("due_in_us", "<u4"),
        # An encode request (``FLAG_ENCODE``): the samples of its audio in the PCM area, written
        # by the client; and the frames of codes the server wrote back, with the answer.
        ("audio_samples", "<u4"),
        ("result_frames", "<u4"),
    ],
    align=True,
)
# The latest a request may say its audio is due, after its submit (``due_in_us``): a stream
# rarely holds more than a few seconds of audio ahead of its listener, and the cap keeps a
# client-written value from postponing any request longer than this.
MAX_DUE_IN_US = 30 * 10**6
REQUEST_ID = ("handle_id", "req_generation", "request_seq")
RESULT_ID = ("result_handle", "result_generation", "result_seq")
for _id in (REQUEST_ID, RESULT_ID):
    assert [SLOT_DT.fields[f][1] for f in _id] == [SLOT_DT.fields[_id[0]][1] + 8 * i for i in range(3)], (
        "identity fields must be contiguous"
    )


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Byte offsets of each region, derived from (n_slots, max_tokens, codec) alone.

    ``max_tokens`` counts frames; ``codec`` (BiCodec by default) sizes the areas per frame.
    ``encode_min_samples``: the fewest samples of audio the server's encoder takes, 0 if it
    serves no encoder (no region depends on it: it travels with the sizes clients check)."""

    n_slots: int
    max_tokens: int
    codec: CodecLayout = BICODEC
    encode_min_samples: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.encode_min_samples <= self.max_audio_samples:
            raise ValueError(f"encode_min_samples must be in 0..{self.max_audio_samples} (a slot's "
                             f"audio), got {self.encode_min_samples}")  # fmt: skip

    @property
    def encodes(self) -> bool:
        """Whether the server answers encode requests (``serve --encode``)."""
        return self.encode_min_samples > 0

    @property
    def max_audio_samples(self) -> int:
        """The most samples of audio an encode request's slot holds (its PCM area, float32)."""
        return self.max_tokens * self.codec.samples_per_frame

    @property
    def codes_per_slot(self) -> int:
        """int32 columns of a slot's codes row: every level's codes of the longest request."""
        return self.max_tokens * self.codec.codes_per_frame

    def level_offset(self, level: int) -> int:
        """First column of ``level`` in a slot's codes row (levels laid out one after another)."""
        return self.max_tokens * sum(self.codec.level_rates[:level])

    @property
    def slots_off(self) -> int:
        return HEADER_SIZE

    @property
    def tokens_off(self) -> int:
        return _align(self.slots_off + self.n_slots * SLOT_DT.itemsize)

    @property
    def globals_off(self) -> int:
        return _align(self.tokens_off + self.n_slots * self.codes_per_slot * 4)

    @property
    def pcm_off(self) -> int:
        return _align(self.globals_off + self.n_slots * self.codec.n_global * 4, 4096)

    @property
    def pcm_stride(self) -> int:
        return _align(self.max_tokens * self.codec.samples_per_frame * PCM_BYTES_PER_SAMPLE, 4096)

    @property
    def n_sems(self) -> int:
        """Semaphores of the segment: ready, free, and req, done and bell per slot."""
        return 2 + 3 * self.n_slots

    @property
    def sems_off(self) -> int:
        """The process-shared semaphores (shared_sems.py), page aligned: used by a segment
        handed over a socket; a named segment's semaphores are named objects instead."""
        return self.pcm_off + self.n_slots * self.pcm_stride

    @property
    def total_size(self) -> int:
        return self.sems_off + _align(self.n_sems * SEM_BYTES, 4096)
