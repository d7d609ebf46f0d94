"""Orpheus TTS's audio tokens <-> the three code levels of SNAC 24 kHz. Torch-free (numpy only).

Orpheus (canopyai/Orpheus-TTS, a Llama-3 language model) emits 7 audio tokens per SNAC frame.
Position ``p`` of a frame carries one code ``c`` in ``[0, 4096)`` as the language-model id
``128266 + 4096·p + c``: 128256 is the Llama-3 vocabulary, the next 10 ids are Orpheus's
special tokens (start/end of speech, ...), and each position has its own 4096 ids. In text
form the id is ``<custom_token_N>`` with ``N = id - 128256``, which is why Orpheus's own decoder
computes ``N - 10 - 4096·(index % 7)``. The positions map to the levels as::

    position  0    1    2    3    4    5    6
    level     0    1    2    2    1    2    2
    code      a0   b0   c0   c1   b1   c2   c3        (frame f: a_f, b_2f.., c_4f..)

Pass ``base=CUSTOM_TOKEN_OFFSET`` (10) to convert ``<custom_token_N>`` numbers instead of ids.
Orpheus's special tokens (the 10 ids just below ``base``: start and end of speech, ...), which
its language model emits around the audio, are skipped wherever they are, as Orpheus's own
decoder skips them.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .validation import as_utterance

LLAMA3_VOCAB = 128256
CUSTOM_TOKEN_OFFSET = 10  # <custom_token_0..9> are Orpheus's special tokens
AUDIO_TOKEN_BASE = LLAMA3_VOCAB + CUSTOM_TOKEN_OFFSET  # 128266: position 0, code 0
CODEBOOK_SIZE = 4096
TOKENS_PER_FRAME = 7
# For each position in a frame: its level, and its index among that level's codes in the frame.
POSITION_LEVEL = (0, 1, 2, 2, 1, 2, 2)
POSITION_SLOT = (0, 0, 0, 1, 1, 2, 3)
LEVEL_RATES = (1, 2, 4)

ORPHEUS_BATCH_HINT = (
    "send each row as its own request (client.decode_orpheus(row) per row, concurrently if "
    "wanted); the server batches concurrent requests itself"
)

_CUSTOM_TOKEN = re.compile(r"<custom_token_(\d+)>")


def orpheus_to_codes(
    token_ids: Any, *, base: int = AUDIO_TOKEN_BASE
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Orpheus audio token ids -> SNAC 24 kHz codes (n,), (2n,), (4n,) int32, for n frames.

    Args:
        token_ids: 1-D ids (list, numpy array or tensor), 7 per frame, whole frames only.
        base: the id of position 0's code 0: 128266 for language-model ids (default), 10 for
            the numbers N of ``<custom_token_N>``. The 10 ids below it are Orpheus's special
            tokens (``<custom_token_2>`` ends its speech): they are skipped.

    Raises:
        ValueError: a count that is not a multiple of 7, an id outside Orpheus's audio ids, or
            an id with another position's offset; the message names the token's index, frame
            and position.
    """
    ids = as_utterance(token_ids, what="token_ids", batch_hint=ORPHEUS_BATCH_HINT)
    special = (ids >= base - CUSTOM_TOKEN_OFFSET) & (ids < base)
    kept = np.flatnonzero(~special)  # (7n,): each audio token's index in what was passed
    skipped = f" (after skipping {int(special.sum())} special token(s))" if special.any() else ""
    ids = ids[kept]
    n = len(ids)
    if n == 0:
        raise ValueError(f"token_ids holds no audio token{skipped}: at least one frame of 7 is needed")
    if n % TOKENS_PER_FRAME:
        raise ValueError(
            f"got {n} Orpheus audio tokens{skipped}, not a multiple of {TOKENS_PER_FRAME}: {n // 7} "
            f"whole frame(s) and {n % 7} token(s) left over (tokens {int(kept[n - n % 7])}.."
            f"{int(kept[n - 1])})"
        )
    rel = ids.astype(np.int64) - base  # (7n,): 4096·position + code when valid
    end = TOKENS_PER_FRAME * CODEBOOK_SIZE
    frames = rel.reshape(-1, TOKENS_PER_FRAME)  # (n, 7)
    offsets = np.arange(TOKENS_PER_FRAME) * CODEBOOK_SIZE
    codes = frames - offsets  # (n, 7): the code each token carries if its offset is right
    bad = np.flatnonzero(((codes < 0) | (codes >= CODEBOOK_SIZE)).ravel())
    if len(bad):
        first = int(bad[0])
        _raise_bad_token(first, int(kept[first]), int(ids[first]), int(rel[first]), base, end, len(bad))
    codes = codes.astype(np.int32)
    level0 = np.ascontiguousarray(codes[:, 0])
    level1 = np.ascontiguousarray(codes[:, [1, 4]].reshape(-1))
    level2 = np.ascontiguousarray(codes[:, [2, 3, 5, 6]].reshape(-1))
    return level0, level1, level2


def codes_to_orpheus(levels: Any, *, base: int = AUDIO_TOKEN_BASE) -> np.ndarray:
    """SNAC 24 kHz codes (n,), (2n,), (4n,) -> Orpheus's 7n token ids (int64), the inverse of
    :func:`orpheus_to_codes`.

    Raises:
        ValueError: not 3 levels, lengths that break 1:2:4, or a code outside ``[0, 4096)``.
    """
    from .layout import SNAC_24KHZ, check_request

    (l0, l1, l2), _, n = check_request(SNAC_24KHZ, levels)
    frames = np.empty((n, TOKENS_PER_FRAME), dtype=np.int64)
    frames[:, 0] = l0
    frames[:, [1, 4]] = l1.reshape(n, 2)
    frames[:, [2, 3, 5, 6]] = l2.reshape(n, 4)
    return (frames + np.arange(TOKENS_PER_FRAME) * CODEBOOK_SIZE + base).reshape(-1)


def custom_token_numbers(text: str) -> list[int]:
    """The numbers N of every ``<custom_token_N>`` in ``text``, in order (for ``base=10``)."""
    return [int(m) for m in _CUSTOM_TOKEN.findall(text)]


def _raise_bad_token(index: int, given: int, value: int, rel: int, base: int, end: int,
                     count: int) -> None:  # fmt: skip
    """``index``: among the audio tokens (it fixes the frame and position); ``given``: in what the
    caller passed, special tokens included."""
    frame, position = divmod(index, TOKENS_PER_FRAME)
    where = f"token {given} (frame {frame}, position {position}, level {POSITION_LEVEL[position]})"
    lo = base + position * CODEBOOK_SIZE
    expected = f"position {position} takes ids {lo}..{lo + CODEBOOK_SIZE - 1}"
    more = f" ({count - 1} more bad token(s))" if count > 1 else ""
    if not 0 <= rel < end:
        raise ValueError(
            f"{where} = {value} is not an Orpheus audio token: audio ids are "
            f"{base}..{base + end - 1} (base {base}); {expected}{more}"
        )
    other = rel // CODEBOOK_SIZE
    raise ValueError(
        f"{where} = {value} carries position {other}'s offset (code {rel % CODEBOOK_SIZE}), "
        f"but {expected}{more}"
    )
