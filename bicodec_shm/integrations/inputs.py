"""What every drop-in shares: one client per server name for the process, and reading the
integer arrays upstream code passes (torch tensors on any device, numpy arrays, nested lists)
without importing torch."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from bicodec_shm.client.decoder_client import DecoderClient

_clients: dict[str, DecoderClient] = {}
_clients_lock = threading.Lock()


def shared_client(name: str | None = None) -> DecoderClient:
    """This process's ``DecoderClient`` for the server ``name`` (default ``"bicodec-shm"``),
    made on first use and kept: every stream and tokenizer of the process shares it (it
    follows forks)."""
    key = name or "bicodec-shm"
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = DecoderClient(key)
        return client


def integer_array(values: Any, what: str, wanted: str, *, empty_float_ok: bool = False) -> np.ndarray:
    """An integer numpy array from a tensor (any device, duck-typed), numpy array or nested list.

    ``wanted`` completes the message for a float dtype: ``"{what} must hold {wanted}, got dtype
    ..."``. ``empty_float_ok``: an empty array may be float (``np.asarray([])`` is float64).

    Raises:
        ValueError: a float or complex dtype, or something numpy cannot read.
    """
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor, duck-typed
        dtype = getattr(values, "dtype", None)
        name = str(dtype).removeprefix("torch.")
        if getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False):
            # bfloat16 has no numpy dtype: refuse every float before converting
            raise ValueError(f"{what} must hold {wanted}, got dtype {name}")
        try:
            values = values.detach().cpu().numpy()
        except (TypeError, RuntimeError) as exc:  # a dtype or device numpy cannot take
            raise ValueError(f"{what}: cannot read a {name} tensor as an array ({exc})") from None
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read a {type(values).__name__} as an array ({exc})") from None
    if arr.dtype.kind not in "iu" and not (empty_float_ok and arr.size == 0 and arr.dtype.kind == "f"):
        raise ValueError(f"{what} must hold {wanted}, got dtype {arr.dtype}")
    return arr
