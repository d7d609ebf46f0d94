"""What a codec's tokens look like, for the client: levels, rates, vocabularies, audio per frame.

Torch-free (numpy only), so that a client can check a request against the server's codec before
anything is written to shared memory. A *frame* is one code of the coarsest level; level ``i``
carries ``level_rates[i]`` codes per frame::

    BiCodec     level 0  |s|s|s|s|      1 semantic id per frame (20 ms), plus 32 global ids
    SNAC 24 kHz level 0  |   a   |      1 per frame  (85.3 ms, 2048 samples)
                level 1  | b | b |      2 per frame
                level 2  |c|c|c|c|      4 per frame
    SNAC 32/44  levels 0..3 at 1 : 2 : 4 : 8 codes per frame, no global ids
    DAC 44 kHz  levels 0..8  |d|d|d|d|      one level per codebook of the residual quantizer,
                             |d|d|d|d|      each 1 code per frame (11.6 ms, 512 samples);
                                ...         DAC 24 kHz: 32 codebooks, 16 kHz: 12 (320 samples)
    Qwen3-TTS   levels 0..15, one per codebook (1 semantic + 15 acoustic), each 1 code per
    12 Hz       frame (80 ms, 1920 samples at 24 kHz)

A request of ``n`` frames therefore holds ``n · level_rates[i]`` codes at level ``i`` and
decodes to ``n · samples_per_frame - end_trim`` samples (:meth:`CodecLayout.decoded_samples`):
``end_trim`` is 0 but for DAC 24 and 16 kHz, whose decoders end 8 samples short (an odd-stride
transposed convolution), as ``descript-audio-codec`` does. A codec whose levels share one rate (DAC) may be
sent as one 2-D array, ``(n_levels, n · rate)``: row ``i`` is level ``i``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .resample import LIBROSA, SOXR_HQ, SOXR_VHQ, Resampling
from .validation import SLOT_LIMIT, as_token_array


@dataclass(frozen=True)
class CodecLayout:
    """The token layout of one codec.

    Args:
        name: the codec's name (``"bicodec"``, ``"snac-24khz"``, ...).
        level_rates: codes per frame at each level, coarsest first; ``level_rates[0]`` is 1.
        level_vocab: ids at level ``i`` lie in ``[0, level_vocab[i])``.
        samples_per_frame: audio samples one frame decodes to.
        sample_rate: audio samples per second.
        n_global: global (speaker) ids per request; 0 for a codec that takes none.
        global_vocab: global ids lie in ``[0, global_vocab)``; 0 when ``n_global`` is 0.
        end_trim: samples the decode of ``n`` frames falls short of ``n · samples_per_frame``,
            the same for every ``n`` (DAC 24/16 kHz: 8); the answer has the decoder's length.
    """

    name: str
    level_rates: tuple[int, ...]
    level_vocab: tuple[int, ...]
    samples_per_frame: int
    sample_rate: int
    n_global: int = 0
    global_vocab: int = 0
    end_trim: int = 0

    def __post_init__(self) -> None:
        if not self.level_rates or len(self.level_rates) != len(self.level_vocab):
            raise ValueError(
                f"level_rates {self.level_rates} and level_vocab {self.level_vocab} must be "
                "non-empty and of equal length"
            )
        if self.level_rates[0] != 1 or min(self.level_rates) < 1 or min(self.level_vocab) < 1:
            raise ValueError(
                f"level_rates must start at 1 and be >= 1, vocabularies >= 1: {self.level_rates}, "
                f"{self.level_vocab}"
            )
        if self.samples_per_frame < 1 or self.sample_rate < 1:
            raise ValueError("samples_per_frame and sample_rate must be >= 1")
        if not 0 <= self.end_trim < self.samples_per_frame:
            raise ValueError(
                f"end_trim={self.end_trim} must be in [0, samples_per_frame={self.samples_per_frame})"
            )
        if (self.n_global > 0) != (self.global_vocab > 0) or min(self.n_global, self.global_vocab) < 0:
            raise ValueError(
                f"n_global={self.n_global} and global_vocab={self.global_vocab} must both be 0 "
                "or both be positive"
            )

    @property
    def n_levels(self) -> int:
        """Number of code levels."""
        return len(self.level_rates)

    @property
    def takes_global_ids(self) -> bool:
        """Whether a request carries global ids (BiCodec's 32 speaker ids)."""
        return self.n_global > 0

    @property
    def codes_per_frame(self) -> int:
        """Codes of all levels in one frame (SNAC 24 kHz: 7, Orpheus's tokens per frame)."""
        return sum(self.level_rates)

    def decoded_samples(self, frames: Any) -> Any:
        """Samples of the decode of ``frames`` frames (an int >= 1, or an integer array):
        ``frames · samples_per_frame - end_trim``, the length the server answers with."""
        return frames * self.samples_per_frame - self.end_trim

    @property
    def frame_rate(self) -> float:
        """Frames per second."""
        return self.sample_rate / self.samples_per_frame

    @property
    def resampling(self) -> Resampling:
        """How audio at another rate is brought to ``sample_rate`` before it is encoded: as the
        codec's upstream does it (``codecs/resample.py``; BiCodec: soxr "VHQ", as Spark-TTS;
        qwen3-tts-12hz: librosa's default, soxr "HQ", as qwen-tts), so that the codes are
        upstream's. Looked up by name: a layout read from a server's header says the same."""
        return RESAMPLING.get(self.name, SOXR_HQ)

    @property
    def uniform_rate(self) -> int | None:
        """The rate every level shares (DAC's codebooks: 1), or None when the rates differ."""
        return self.level_rates[0] if len(set(self.level_rates)) == 1 else None

    def describe(self) -> str:
        """One line for messages and ``stats``: ``snac-24khz: 3 levels at 1:2:4 ...``."""
        levels = f"{self.n_levels} level(s) at {':'.join(map(str, self.level_rates))} codes per frame"
        vocab = "/".join(map(str, self.level_vocab))
        if self.n_levels > 4 and len(set(self.level_rates)) == len(set(self.level_vocab)) == 1:
            # DAC 24 kHz's 32 codebooks would print 32 rates and 32 vocabularies: say it once.
            levels = f"{self.n_levels} level(s) of {self.level_rates[0]} code(s) per frame each"
            vocab = f"{self.level_vocab[0]} each"
        glob = f", {self.n_global} global ids" if self.takes_global_ids else ", no global ids"
        return (
            f"{self.name}: {levels}, vocab {vocab}, {self.samples_per_frame} samples per frame "
            f"at {self.sample_rate} Hz{glob}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values; :meth:`from_dict` reverses it."""
        out = asdict(self)
        out["level_rates"], out["level_vocab"] = list(self.level_rates), list(self.level_vocab)
        return out

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> CodecLayout:
        """A layout from :meth:`to_dict`'s mapping; raises ValueError on a bad or missing field."""
        try:
            return cls(
                name=str(mapping["name"]),
                level_rates=tuple(int(v) for v in mapping["level_rates"]),
                level_vocab=tuple(int(v) for v in mapping["level_vocab"]),
                samples_per_frame=int(mapping["samples_per_frame"]),
                sample_rate=int(mapping["sample_rate"]),
                n_global=int(mapping.get("n_global", 0)),
                global_vocab=int(mapping.get("global_vocab", 0)),
                end_trim=int(mapping.get("end_trim", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a codec layout: {dict(mapping)!r} ({exc!r})") from None


# A SNAC request's noise is a pure function of its seed (model/snac/noise.py); a request that
# names none gets this one, so that the same codes always decode to the same audio.
DEFAULT_NOISE_SEED = 0
MAX_NOISE_SEED = 2**63 - 1


def check_noise_seed(seed: Any) -> int:
    """``seed`` as an int in ``[0, 2**63)``; raises ValueError otherwise (bools refused too)."""
    return _bounded_int(seed, "noise_seed", MAX_NOISE_SEED, "[0, 2**63)")


MAX_START_FRAME = 2**32 - 1  # the slot's field is 32 bits: ~4 days of audio at 24 kHz


def check_start_frame(frame: Any) -> int:
    """``frame`` as an int in ``[0, 2**32)``; raises ValueError otherwise (bools refused too)."""
    return _bounded_int(frame, "start_frame", MAX_START_FRAME, "[0, 2**32)")


def _bounded_int(value: Any, what: str, most: int, span: str) -> int:
    """``value`` as an int in ``[0, most]``, else a ValueError naming ``what`` and ``span``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= most:
        raise ValueError(f"{what} must be an int in {span}, got {value!r}")
    return int(value)


BICODEC = CodecLayout("bicodec", (1,), (8192,), 320, 16000, n_global=32, global_vocab=4096)
SNAC_24KHZ = CodecLayout("snac-24khz", (1, 2, 4), (4096,) * 3, 2048, 24000)
SNAC_32KHZ = CodecLayout("snac-32khz", (1, 2, 4, 8), (4096,) * 4, 3072, 32000)
SNAC_44KHZ = CodecLayout("snac-44khz", (1, 2, 4, 8), (4096,) * 4, 3072, 44100)
# descript-audio-codec's published models (8 kbps at 44.1 kHz, as Dia and Parler-TTS use it; 24 and
# 16 kHz): one level per codebook, each at the frame rate, 1024 codes each.
DAC_44KHZ = CodecLayout("dac-44khz", (1,) * 9, (1024,) * 9, 512, 44100)
# The 24 and 16 kHz decoders' stride-5 block makes n frames 320·n - 8 samples (DACConfig.stage_lengths).
DAC_24KHZ = CodecLayout("dac-24khz", (1,) * 32, (1024,) * 32, 320, 24000, end_trim=8)
DAC_16KHZ = CodecLayout("dac-16khz", (1,) * 12, (1024,) * 12, 320, 16000, end_trim=8)
# Qwen3-TTS's 12 Hz speech tokenizer: 16 codebooks (1 semantic + 15 acoustic) of 2048 codes, each
# one code per 80 ms frame of 1920 samples at 24 kHz.
QWEN3_TTS_12HZ = CodecLayout("qwen3-tts-12hz", (1,) * 16, (2048,) * 16, 1920, 24000)

LAYOUTS: dict[str, CodecLayout] = {
    c.name: c
    for c in (BICODEC, SNAC_24KHZ, SNAC_32KHZ, SNAC_44KHZ, DAC_44KHZ, DAC_24KHZ, DAC_16KHZ, QWEN3_TTS_12HZ)
}

# How each codec's upstream resamples what it encodes (CodecLayout.resampling); soxr's default for
# the others, whose upstreams encode nothing at another rate.
RESAMPLING: dict[str, Resampling] = {BICODEC.name: SOXR_VHQ, QWEN3_TTS_12HZ.name: LIBROSA}


DEFAULT_MAX_SECONDS = 30  # the longest request a server takes by default (serve --max-tokens)
# The most frames any server's slot holds: protocol.segment.Segment.create refuses a larger
# --max-tokens. A longer request is refused by the client before it looks for a server; any
# shorter one is checked against the slots of the server that will decode it.
MAX_FRAMES = 100_000
ANY_SLOT_LIMIT = f"any server's slot can hold (--max-tokens is at most {MAX_FRAMES}); split the request"


def default_max_frames(codec: str) -> int:
    """Frames of ``DEFAULT_MAX_SECONDS`` of ``codec``'s audio: the server's default --max-tokens
    (BiCodec: 1500, SNAC 24 kHz: 352)."""
    layout = get_layout(codec)
    return -(-DEFAULT_MAX_SECONDS * layout.sample_rate // layout.samples_per_frame)


def get_layout(name: str) -> CodecLayout:
    """The layout of a known codec; raises ValueError naming the known ones."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; expected one of {sorted(LAYOUTS)}") from None


def _array_rows(layout: CodecLayout, codes: Any) -> tuple[list[Any], bool]:
    """A 2-D array (n_levels, frames · rate) as its rows, for a codec whose levels share one rate;
    and whether they are checked already.

    An integer numpy array in range is checked and converted once, whole (DAC 24 kHz has 32
    levels: one check instead of 32). Anything else is split into rows for the per-level checks
    and their messages.
    """
    rate = layout.uniform_rate
    if rate is None:
        raise ValueError(
            f"{layout.name} has levels of different rates ({':'.join(map(str, layout.level_rates))}): "
            f"send one 1-D sequence per level, not a 2-D array of shape {tuple(codes.shape)}"
        )
    if len(codes) != layout.n_levels:
        flipped = codes.shape[1] == layout.n_levels
        raise ValueError(
            f"{layout.name} takes a ({layout.n_levels}, frames) array of codes, one row per level, "
            f"got shape {tuple(codes.shape)}" + (" (transposed? rows are levels)" if flipped else "")
        )
    vocab = min(layout.level_vocab)
    if (isinstance(codes, np.ndarray) and codes.dtype.kind in "iu" and codes.shape[1]
            and codes.shape[1] % rate == 0 and codes.min() >= 0 and codes.max() < vocab):  # fmt: skip
        return list(np.ascontiguousarray(codes, dtype=np.int32)), True  # rows of one copy
    return list(codes), False


def check_request(
    layout: CodecLayout,
    levels: Sequence[Any],
    global_ids: Any = None,
    *,
    max_frames: int | None = None,
    slot_limit: str = SLOT_LIMIT,
) -> tuple[list[np.ndarray], np.ndarray | None, int]:
    """Validate one request against ``layout``; return its levels as int32 arrays and its frames.

    Args:
        levels: one 1-D sequence of ids per level (lists, numpy arrays or tensors), coarsest
            first; level ``i`` must hold ``frames · level_rates[i]`` ids. For a codec whose
            levels share one rate (DAC) also a 2-D array or tensor ``(n_levels, frames · rate)``.
        global_ids: the global ids for a codec that takes them, else None.
        max_frames: the most frames a request may carry (the server's slot size), or None.
        slot_limit: what ``max_frames`` is, for the message of a request that is too long
            (default: a slot of the server, whose --max-tokens sets it).

    Returns:
        ``(levels, global_ids, frames)``: contiguous int32 arrays (``global_ids`` None for a codec
        without them) and the request's frame count.

    Raises:
        ValueError: a wrong number of levels, level lengths that break the rates, an id out of
            range for its level (naming the level and position), global ids missing or sent to a
            codec that has none.
    """
    name = layout.name
    checked = False
    if getattr(levels, "ndim", None) == 2:
        levels, checked = _array_rows(layout, levels)
    if isinstance(levels, (str, bytes)) or not isinstance(levels, Sequence):
        raise ValueError(
            f"{name} takes a sequence of {layout.n_levels} code level(s), got {type(levels).__name__}"
        )
    if len(levels) != layout.n_levels:
        rates = ":".join(map(str, layout.level_rates))
        raise ValueError(
            f"{name} takes {layout.n_levels} code level(s) at rates {rates}, got {len(levels)}"
        )
    limit = max_frames if max_frames is not None else np.iinfo(np.int32).max
    if checked and len(levels[0]) > limit * layout.level_rates[0]:
        checked = False  # too long: as_token_array says so, in its words
    arrays = levels if checked else [
        as_token_array(level, what=f"levels[{i}]", vocab=vocab, max_len=limit * rate, limit=slot_limit)
        for i, (level, rate, vocab) in enumerate(
            zip(levels, layout.level_rates, layout.level_vocab, strict=True)
        )
    ]  # fmt: skip
    frames = len(arrays[0])
    for i, (arr, rate) in enumerate(zip(arrays, layout.level_rates, strict=True)):
        if len(arr) != frames * rate:
            raise ValueError(
                f"levels[{i}] has {len(arr)} codes, but {name} needs {rate} per frame: "
                f"{frames * rate} for the {frames} frame(s) of levels[0] "
                f"(rates {':'.join(map(str, layout.level_rates))})"
            )
    if not layout.takes_global_ids:
        if global_ids is not None:
            raise ValueError(f"{name} takes no global ids, but global_ids were given")
        return arrays, None, frames
    if global_ids is None:
        raise ValueError(f"{name} needs {layout.n_global} global ids, got none")
    glob = as_token_array(
        global_ids, what="global_ids", vocab=layout.global_vocab, max_len=layout.n_global,
        exact_len=layout.n_global,
    )  # fmt: skip
    return arrays, glob, frames
