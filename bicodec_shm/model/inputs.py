"""Checks of a decoder's integer inputs (ids, codes, lengths), shared by every codec's
``detokenize``: each bad value is a ValueError that names the argument and the position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

IdsLike = torch.Tensor | np.ndarray


def as_ids(name: str, value: Any, *, dims: int) -> torch.Tensor:
    """``value`` (a tensor or numpy array of any integer dtype, ``dims``-D) as int64."""
    tensor = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}"
        )
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise ValueError(
            f"{name} must have an integer dtype (int64, int32, ...), got {tensor.dtype}"
        )
    if tensor.dim() != dims:
        raise ValueError(
            f"{name} must be {dims}-D, got {tensor.dim()}-D with shape {tuple(tensor.shape)}"
        )
    return tensor.long()


def check_range(name: str, ids: torch.Tensor, vocab: int) -> None:
    """Every id of (B, N) ``ids`` in ``[0, vocab)``, else the first bad one, named by position."""
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if len(bad):
        row, pos = (int(v) for v in bad[0])
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(
            f"{name}[{row}, {pos}] = {int(ids[row, pos])} is out of range [0, {vocab}){more}"
        )


def check_lengths(lengths: IdsLike | Sequence[int], batch: int, frames: int) -> torch.Tensor:
    """(B,) valid frames per row, each in ``[1, frames]``, as int64 where the caller keeps them."""
    if not isinstance(lengths, (torch.Tensor, np.ndarray)):
        lengths = torch.as_tensor(lengths)
    lens = as_ids("lengths", lengths, dims=1)
    if lens.shape != (batch,):
        raise ValueError(f"lengths must have shape (B,) = ({batch},), got {tuple(lens.shape)}")
    bad = ((lens < 1) | (lens > frames)).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise ValueError(f"lengths[{i}] = {int(lens[i])} is outside [1, T] = [1, {frames}]")
    return lens
