"""Client-side checks of token arrays, done before anything is written to shared memory.

numpy only (no torch): a torch tensor is accepted by duck typing (``.detach().cpu().numpy()``).
Every rejection is a ``ValueError`` whose message names the argument, and where it applies the
position and the offending value.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def as_token_array(
    values: Any, *, what: str, vocab: int, max_len: int, exact_len: int | None = None
) -> np.ndarray:
    """Validate a 1-D sequence of token ids and return it as a contiguous int32 array.

    Args:
        values: a list/tuple of ints, a 1-D integer numpy array, or a 1-D integer tensor.
        what: the argument's name, for messages ("semantic_ids", "global_ids").
        vocab: ids must lie in ``[0, vocab)``.
        max_len: the most ids accepted.
        exact_len: if set, exactly this many ids are required.
    """
    arr = _to_numpy(values, what)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got an array of shape {arr.shape}")
    n = arr.shape[0]
    if exact_len is not None and n != exact_len:
        raise ValueError(f"{what} must have exactly {exact_len} ids, got {n}")
    if n == 0:
        raise ValueError(f"{what} is empty: at least one token id is needed")
    if n > max_len:
        raise ValueError(
            f"{what} has {n} ids, more than the {max_len} a slot holds "
            f"(the server's --max-tokens); split the request"
        )
    if arr.min() >= 0 and arr.max() < vocab:  # the common case, without a mask
        return np.ascontiguousarray(arr, dtype=np.int32)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{what}[{i}] = {int(arr[i])} is out of range: ids must be in 0..{vocab - 1}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _to_numpy(values: Any, what: str) -> np.ndarray:
    if values is None:
        raise ValueError(f"{what} is None: pass a list, numpy array or tensor of int ids")
    if hasattr(values, "detach") and hasattr(values, "numpy"):  # a torch tensor, duck-typed
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise ValueError(f"{what} must have an integer dtype, got {values.dtype}")
        return values
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of int ids, got {type(values).__name__}")
    try:
        items = list(values)
    except TypeError:
        raise ValueError(
            f"{what} must be a sequence of int ids, got {type(values).__name__}"
        ) from None
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
