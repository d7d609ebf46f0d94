"""One BiCodec utterance of any length through a server whose slots hold fewer tokens.

A request longer than the server's ``--max-tokens`` is decoded as overlapping windows, each
with the model's whole receptive field (``RECEPTIVE_FIELD`` tokens, streaming.py) of context on
each side of the region it keeps, or the sequence's own end::

    tokens  0 ............................................................................ n
    window  [ region 0 ........... | context ]
                          [ context | region 1 ............ | context ]
                                                 [ context | region 2 .................. ]

A region's audio then depends on no token outside its window, so the stitched regions equal the
whole decode up to float rounding (window lengths change the order of a conv's sums). The
windows of one utterance go to the server at once, so they are decoded in one batch. The limit
is the attached server's, read for each utterance; a window a restarted server refuses as too
long is planned again for the new limit. Torch-free: numpy and the client.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..codecs.layout import ANY_SLOT_LIMIT, BICODEC, MAX_FRAMES
from ..codecs.validation import as_token_array, output_dtype_code
from ..protocol.layout import N_GLOBAL
from .streaming import HOP, RECEPTIVE_FIELD


def exact_windows(n: int, limit: int, context: int = RECEPTIVE_FIELD) -> list[tuple[int, int, int, int]]:
    """Windows ``(w0, r0, r1, w1)`` covering tokens ``[0, n)``: each decodes ``[w0, w1)``, at
    most ``limit`` tokens, and keeps the audio of its region ``[r0, r1)``, which has ``context``
    tokens (or the sequence's end) on each side. One window when ``n <= limit``.

    Raises:
        ValueError: ``limit <= 2·context`` for a longer sequence: no window has room for both
            contexts and a token of region.
    """
    if n <= limit:
        return [(0, 0, n, n)]
    if limit <= 2 * context:
        raise ValueError(
            f"{n} tokens are more than the {limit} a slot holds, and a slot that short has no room "
            f"for a window with {context} tokens of context on each side: start the server with "
            f"--max-tokens {2 * context + 1} or more"
        )
    windows, r0 = [], 0
    while True:
        w0 = max(0, r0 - context)
        if n - w0 <= limit:
            windows.append((w0, r0, n, n))
            return windows
        r1 = w0 + limit - context  # > r0, since limit - context > context >= r0 - w0
        windows.append((w0, r0, r1, r1 + context))
        r0 = r1


def decode_any_length(client: Any, semantic_ids: Any, global_ids: Any, *, dtype: str = "int16",
                      timeout: float | None = None) -> np.ndarray:  # fmt: skip
    """``client.decode`` for an utterance of any length up to the longest slot a server may
    have: (N,) semantic ids, (32,) global ids -> (320·N,) int16 or float32, as one decode of the
    whole sequence (float32 within float rounding, int16 within one step). The windows of a long
    one are sent from threads of this call, together."""
    semantic, globals_, as_float = _checked(semantic_ids, global_ids, dtype)
    while True:
        limit = client.max_tokens
        windows = exact_windows(len(semantic), limit)
        if len(windows) == 1:
            calls = [lambda: client.decode(semantic, globals_, dtype=dtype, timeout=timeout)]
        else:
            calls = [_window_call(client, semantic[w0:w1], globals_, timeout) for w0, _, _, w1 in windows]
        try:
            audio = all_in_threads(calls)
        except ValueError:
            if client.max_tokens != limit:
                continue  # the server was replaced by one with another limit: plan for it
            raise
        return audio[0] if len(windows) == 1 else _stitch(windows, audio, as_float)


async def decode_any_length_async(client: Any, semantic_ids: Any, global_ids: Any, *, dtype: str = "int16",
                                  timeout: float | None = None) -> np.ndarray:  # fmt: skip
    """``decode_any_length`` for asyncio: the windows are concurrent ``decode_async`` calls."""
    semantic, globals_, as_float = _checked(semantic_ids, global_ids, dtype)
    while True:
        limit = client.max_tokens
        windows = exact_windows(len(semantic), limit)
        if len(windows) == 1:
            requests = [client.decode_async(semantic, globals_, dtype=dtype, timeout=timeout)]
        else:
            requests = [client.decode_async(semantic[w0:w1], globals_, dtype="float32", timeout=timeout)
                        for w0, _, _, w1 in windows]  # fmt: skip
        results = await asyncio.gather(*requests, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            if isinstance(failures[0], ValueError) and client.max_tokens != limit:
                continue  # as in ``decode_any_length``
            raise failures[0]
        return results[0] if len(windows) == 1 else _stitch(windows, results, as_float)


def _checked(semantic_ids: Any, global_ids: Any, dtype: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """The whole utterance validated once, so that an error names its index in the utterance,
    not in a window."""
    semantic = as_token_array(semantic_ids, what="semantic_ids", vocab=BICODEC.level_vocab[0],
                              max_len=MAX_FRAMES, limit=ANY_SLOT_LIMIT)  # fmt: skip
    globals_ = as_token_array(global_ids, what="global_ids", vocab=BICODEC.global_vocab,
                              max_len=N_GLOBAL, exact_len=N_GLOBAL)  # fmt: skip
    return semantic, globals_, output_dtype_code(dtype) == 1


def _window_call(client: Any, ids: np.ndarray, globals_: np.ndarray, timeout: float | None) -> Callable:
    return lambda: client.decode(ids, globals_, dtype="float32", timeout=timeout)


def all_in_threads(calls: list[Callable]) -> list:
    """Run the first call here and each other in a thread of its own; once all have returned,
    raise the first failure (none is left in flight), else return their results in order."""
    results: list[Any] = [None] * len(calls)
    failed: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # handed to the caller below
            failed[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, len(calls))]
    for thread in threads:
        thread.start()
    try:
        if calls:
            run(0)
    finally:
        for thread in threads:
            thread.join()
    for exc in failed:
        if exc is not None:
            raise exc
    return results


def _stitch(windows: list[tuple[int, int, int, int]], audio: list, as_float: bool) -> np.ndarray:
    """Each window's region cut out and joined: (320·n,) float32, or int16 as the server makes
    it (clipped, scaled by 32767 in float32, truncated toward zero)."""
    out = np.concatenate([np.asarray(a, np.float32)[HOP * (r0 - w0) : HOP * (r1 - w0)]
                          for (w0, r0, r1, _), a in zip(windows, audio, strict=True)])  # fmt: skip
    if as_float:
        return out
    return (np.clip(out, -1.0, 1.0) * np.float32(32767)).astype(np.int16)
