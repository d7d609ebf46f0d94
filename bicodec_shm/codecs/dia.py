"""Dia's audio tokens <-> the codes of DAC 44 kHz. Torch-free (numpy only).

Dia (nari-labs/dia) generates DAC 44 kHz's 9 codebooks with a *delay pattern*: codebook ``c``
runs ``DELAY_PATTERN[c]`` steps late, so step (row) ``r`` of its output carries codebook ``c``'s
code of frame ``r - DELAY_PATTERN[c]``. Codes are 0..1023; Dia's vocabulary adds three
special tokens: ``EOS`` 1024, ``PAD`` 1025, ``BOS`` 1026. An utterance of ``T`` frames, as
``Dia.generate`` holds it after its BOS step (and after the audio prompt, if any)::

    row        0    1  ...  7    8    9  ...  T-1  T    T+1  ... T+8  ... T+14  (T+15)
    book 0     a0   a1      a7   a8   a9      .    EOS  PAD      PAD      PAD    (PAD)
    book 1     BOS  BOS     BOS  b0   b1      .    .    .        EOS      PAD    (PAD)
    ...                                            (book c: frame t at row t + delay[c])
    book 8     BOS  BOS ... BOS  BOS  BOS ... .    .    .        .        i_T-1  (EOS)

Dia decodes rows ``[0, T + 15)`` (its ``generated_codes``); the language model's own last step,
row ``T + 15``, only closes book 8. :func:`dia_to_codes` takes either (rows past ``T + 15`` are
ignored): the utterance ends at book 0's first EOS, or, with no EOS, ``15`` rows before the last
row. The cells before a book's first frame are not read (BOS, or the prompt's delayed codes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

DELAY_PATTERN = (0, 8, 9, 10, 11, 12, 13, 14, 15)
CODEBOOK_SIZE = 1024
EOS, PAD, BOS = 1024, 1025, 1026
SPECIAL = {EOS: "Dia's EOS (1024)", PAD: "Dia's PAD (1025)", BOS: "Dia's BOS (1026)"}

DIA_BATCH_HINT = (
    "send each utterance as its own request (client.decode_dia(rows) per utterance, concurrently "
    "if wanted); the server batches concurrent requests itself"
)


def dia_to_codes(tokens: Any, *, delay_pattern: tuple[int, ...] = DELAY_PATTERN) -> np.ndarray:
    """Dia's delayed audio tokens ``(rows, 9)`` -> DAC 44 kHz codes ``(9, T)`` int32.

    Args:
        tokens: one utterance's rows, time first and one column per codebook (Dia's
            ``generated_codes[i]``; a leading dimension of size 1 is dropped), a numpy array,
            nested lists or a tensor.
        delay_pattern: each codebook's delay in rows (Dia's ``delay_pattern``).

    Raises:
        ValueError: not 2-D with one column per codebook, too few rows to hold the delay, an
            EOS with too few rows after it, or a special token or id out of range where a code
            must be (naming its row, codebook, frame and what it is).
    """
    delays = _check_pattern(delay_pattern)
    arr = _as_rows(tokens, len(delays))
    rows, most = arr.shape[0], max(delays)
    ends = np.flatnonzero(arr[:, 0] == EOS)
    if len(ends):
        frames = int(ends[0])
        if frames == 0:
            raise ValueError("row 0 of codebook 0 is Dia's EOS (1024): the utterance has no frames")
        if rows < frames + most:
            raise ValueError(
                f"codebook 0 ends at row {frames} (Dia's EOS), so the utterance has {frames} frame(s), "
                f"but its last frame of codebook {delays.index(most)} lies {most} rows later: pass "
                f"rows 0..{frames + most - 1} (got {rows} rows)"
            )
    else:
        frames = rows - most
        if frames < 1:
            raise ValueError(
                f"got {rows} row(s): with Dia's delay pattern (up to {most} rows) an utterance needs "
                f"at least {most + 1} rows, {most} more than its frames"
            )
    index = np.arange(frames)[None, :] + np.asarray(delays)[:, None]  # (9, T): the row of each code
    codes = np.take_along_axis(arr.T, index, axis=1)  # (rows, 9) -> (9, rows) -> (9, T)
    bad = np.argwhere((codes < 0) | (codes >= CODEBOOK_SIZE))
    if len(bad):
        book, frame = (int(v) for v in bad[0])
        value = int(codes[book, frame])
        what = SPECIAL.get(value, f"outside the codes 0..{CODEBOOK_SIZE - 1}")
        hint = " (pass the rows after Dia's BOS step)" if value == BOS else ""
        more = f"; {len(bad) - 1} more such cell(s)" if len(bad) > 1 else ""
        raise ValueError(
            f"row {frame + delays[book]}, codebook {book} = {value} is {what}, where frame {frame}'s "
            f"code of codebook {book} must be{hint}{more}"
        )
    return np.ascontiguousarray(codes, dtype=np.int32)


def codes_to_dia(codes: Any, *, delay_pattern: tuple[int, ...] = DELAY_PATTERN) -> np.ndarray:
    """DAC codes ``(9, T)`` -> Dia's delayed rows ``(T + 15, 9)`` int64 with BOS before each
    codebook's first frame, EOS after its last and PAD after that (as ``Dia.generate`` leaves
    them); the inverse of :func:`dia_to_codes`.

    Raises:
        ValueError: codes of the wrong shape or outside ``[0, 1024)``.
    """
    delays = _check_pattern(delay_pattern)
    arr = np.asarray(codes)
    if arr.ndim != 2 or arr.shape[0] != len(delays) or arr.shape[1] < 1 or arr.dtype.kind not in "iu":
        raise ValueError(
            f"codes must be an integer ({len(delays)}, T) array, T >= 1, got {arr.dtype} {arr.shape}"
        )
    if arr.min() < 0 or arr.max() >= CODEBOOK_SIZE:
        raise ValueError(f"codes must lie in 0..{CODEBOOK_SIZE - 1}")
    frames = arr.shape[1]
    out = np.full((frames + max(delays), len(delays)), PAD, dtype=np.int64)
    for book, delay in enumerate(delays):
        out[:delay, book] = BOS
        out[delay : delay + frames, book] = arr[book]
        if delay + frames < len(out):
            out[delay + frames, book] = EOS
    return out


def _check_pattern(delay_pattern: Any) -> tuple[int, ...]:
    delays = tuple(delay_pattern)
    ints = all(not isinstance(d, bool) and isinstance(d, (int, np.integer)) and d >= 0 for d in delays)
    if not delays or not ints:
        raise ValueError(f"delay_pattern must be non-negative ints, one per codebook, got {delay_pattern!r}")
    return tuple(int(d) for d in delays)


def _as_rows(tokens: Any, books: int) -> np.ndarray:
    """``tokens`` as a (rows, books) int64 array; a leading dimension of size 1 is dropped."""
    arr = tokens.detach().cpu().numpy() if hasattr(tokens, "detach") else tokens
    try:
        arr = np.asarray(arr)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tokens: cannot read a {type(tokens).__name__} as an array ({exc})") from None
    while arr.ndim > 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim == 3:
        raise ValueError(f"tokens holds a batch of {arr.shape[0]} utterances {arr.shape}: {DIA_BATCH_HINT}")
    if arr.ndim != 2 or arr.shape[1] != books:
        flipped = arr.ndim == 2 and arr.shape[0] == books
        raise ValueError(
            f"tokens must be Dia's (rows, {books}) array, one column per codebook, got shape "
            f"{arr.shape}" + (" (transposed? Dia's rows are time steps)" if flipped else "")
        )
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)
