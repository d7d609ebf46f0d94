"""Client-side checks of token arrays, done before anything is written to shared memory.

numpy only (no torch): a torch tensor is accepted by duck typing (``.detach().cpu().numpy()``),
and any other array-like through ``np.asarray``.

One shape rule for every entry point (``DecoderClient``, the ``BiCodecBatchDecoder`` drop-in,
``DecodeStream``, ``bicodec-shm decode`` and the HTTP example): a request is ONE utterance, so
its ids are 1-D after dropping leading dimensions of size 1. Spark-TTS hands its ids around as
``(1, T)`` semantic and ``(1, 1, 32)`` global tensors; those are accepted as they are. A real
batch (a leading dimension above 1) is refused with a message that says how to send it: one call
per row, concurrently if wanted; the server batches concurrent calls itself.

Every rejection is a ``ValueError`` whose message names the argument, and where it applies the
position and the offending value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# What to do with a batch, for callers of the Python API (the CLI passes its own).
BATCH_HINT = (
    "send each row as its own request, e.g. [client.decode(row, g) for row, g in zip(rows, globals_)], "
    "or concurrently with asyncio.gather(*(client.decode_async(row, g) for row, g in zip(rows, globals_))); "
    "the server batches concurrent requests itself"
)
SLOT_LIMIT = "a slot holds (the server's --max-tokens); split the request"


def as_token_array(
    values: Any,
    *,
    what: str,
    vocab: int,
    max_len: int,
    exact_len: int | None = None,
    limit: str = SLOT_LIMIT,
) -> np.ndarray:
    """Validate one utterance's token ids and return them as a contiguous (N,) int32 array.

    Args:
        values: a list/tuple of ints, an integer numpy array or tensor, of shape (N,) or with
            leading dimensions of size 1 ((1, N), (1, 1, N)); see ``as_utterance``.
        what: the argument's name, for messages ("semantic_ids", "global_ids").
        vocab: ids must lie in ``[0, vocab)``.
        max_len: the most ids accepted.
        exact_len: if set, exactly this many ids are required.
        limit: what ``max_len`` is, for the message of a request that is too long: "the N
            {limit}" (default: a slot of the server, whose --max-tokens sets it).
    """
    arr = as_utterance(values, what=what)
    n = arr.shape[0]
    if exact_len is not None and n != exact_len:
        raise ValueError(f"{what} must have exactly {exact_len} ids, got {n}")
    if n == 0:
        raise ValueError(f"{what} is empty: at least one token id is needed")
    if n > max_len:
        raise ValueError(f"{what} has {n} ids, more than the {max_len} {limit}")
    if arr.min() >= 0 and arr.max() < vocab:  # the common case, without a mask
        return np.ascontiguousarray(arr, dtype=np.int32)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{what}[{i}] = {int(arr[i])} is out of range: ids must be in 0..{vocab - 1}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def as_utterance(values: Any, *, what: str, batch_hint: str = BATCH_HINT) -> np.ndarray:
    """One utterance's ids as a 1-D integer array (no range checks): the shape rule.

    Leading dimensions of size 1 are dropped: (N,), (1, N) and (1, 1, N) are the same request.
    Anything else with more than one dimension is a batch, or a column, and is refused with
    ``batch_hint`` saying how to send it.

    Returns:
        (N,) integer array (a view where possible; any integer dtype).
    """
    arr = _to_numpy(values, what, batch_hint)
    shape = arr.shape
    while arr.ndim > 1 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim == 1:
        return arr
    if arr.ndim == 0:
        raise ValueError(f"{what} must be 1-D, a sequence of ids, got a single value ({arr.item()!r})")
    if all(d == 1 for d in arr.shape[1:]):
        raise _column_error(what, f"shape {shape}", arr.shape[0])
    raise _batch_error(what, f"shape {shape}", arr.shape[0], batch_hint)


def _column_error(what: str, got: str, n: int) -> ValueError:
    """(N, 1): one utterance's ids standing in a column, not N utterances of one id each."""
    return ValueError(
        f"{what} must be 1-D, the ids of one utterance, got {got}: a column of {n} ids; pass it "
        f"flattened (np.ravel({what}))"
    )


def _batch_error(what: str, got: str, rows: int, batch_hint: str) -> ValueError:
    return ValueError(
        f"{what} must be 1-D, the ids of one utterance (leading dimensions of size 1, as in "
        f"Spark-TTS's (1, T), are dropped), got {got}: a batch of {rows} rows; {batch_hint}"
    )


def _to_numpy(values: Any, what: str, batch_hint: str) -> np.ndarray:
    if values is None:
        raise ValueError(f"{what} is None: pass a list, numpy array or tensor of int ids")
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of int ids, got {type(values).__name__}")
    if _is_tensor(values):  # torch, duck-typed: never imported here
        values = values.detach().cpu().numpy()
    elif not isinstance(values, (np.ndarray, list, tuple)) and hasattr(values, "__array__"):
        try:
            values = np.asarray(values)  # another array library's array, a pandas Series, ...
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}: cannot read a {type(values).__name__} as an array ({exc})") from None
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise ValueError(f"{what} must have an integer dtype, got {values.dtype}")
        return values
    try:
        items = list(values)
    except TypeError:
        raise ValueError(
            f"{what} must be a sequence of int ids, got {type(values).__name__}"
        ) from None
    if items and _is_array_like(items[0]):  # nested: [[...]] is (1, N); more rows are a batch
        if len(items) == 1:
            return _to_numpy(items[0], what, batch_hint)
        if all(_is_array_like(v) and _len_or_none(v) == 1 for v in items):
            got = f"a {type(values).__name__} of {len(items)} one-id sequences"
            raise _column_error(what, got, len(items))
        raise _batch_error(what, f"a {type(values).__name__} of {len(items)} sequences", len(items),
                           batch_hint)  # fmt: skip
    kinds = set(map(type, items))
    if not kinds <= {int}:  # slow path only to name the offending element
        for i, v in enumerate(items):
            # bool is an int subclass, and numpy would silently turn True into 1.
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{what}[{i}] = {v!r} is a {type(v).__name__}, not an int id")
    try:
        return np.asarray(items, dtype=np.int64) if items else np.zeros(0, np.int64)
    except OverflowError:
        i, v = next((i, v) for i, v in enumerate(items) if not -(2**63) <= int(v) < 2**63)
        raise ValueError(f"{what}[{i}] = {v} does not fit in int32 (and is not a valid id)") from None


def _is_tensor(values: Any) -> bool:
    return hasattr(values, "detach") and hasattr(values, "numpy")


def _is_array_like(value: Any) -> bool:
    """A row inside a list: a list, tuple, array or tensor with at least one dimension."""
    if isinstance(value, (list, tuple)):
        return True
    if isinstance(value, (str, bytes, int, np.generic)):
        return False
    return (isinstance(value, np.ndarray) or _is_tensor(value) or hasattr(value, "__array__")) and (
        getattr(value, "ndim", 1) >= 1
    )


_DTYPE_CODES = {"int16": 0, "float32": 1}


def output_dtype_code(dtype: Any) -> int:
    """Map the ``dtype`` argument to the wire code: 0 for int16, 1 for float32."""
    if isinstance(dtype, str) and dtype in _DTYPE_CODES:
        return _DTYPE_CODES[dtype]  # the hot path: np.dtype(name) costs ~6 us
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name == "int16":
        return 0
    if name == "float32":
        return 1
    raise ValueError(f"dtype must be 'int16' or 'float32', got {dtype!r}")


def _len_or_none(values: Any) -> int | None:
    try:
        return len(values)
    except TypeError:
        return None
