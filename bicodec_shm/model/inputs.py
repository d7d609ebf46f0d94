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


def check_waves(name: str, value: Any, lengths: IdsLike | Sequence[int] | None, *, dtype: torch.dtype,
                one_row: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """An encoder's audio, ``(B, N)`` float waveforms right-padded to N, as a ``dtype`` tensor on
    its device, and each row's valid samples, ``(B,)`` int64 in ``[1, N]`` (all N if ``lengths``
    is None). ``one_row``: a (N,) waveform is a batch of one; otherwise it is refused. Each bad
    value is a ValueError naming ``name``: not a tensor or numpy array, not floating point, of
    another shape, empty, or a sample that is not finite within its row (its row and position;
    the padding past a row's length may hold anything)."""
    wave = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    if not isinstance(wave, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    if not wave.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype (float32, float64): floating point, scaled to "
                         f"[-1, 1], got {wave.dtype} (divide int16 PCM by 32768)")  # fmt: skip
    if one_row and wave.dim() == 1:
        wave = wave[None]  # (N,) -> (1, N)
    if wave.dim() != 2:
        shape = f"got {wave.dim()}-D with shape {tuple(wave.shape)}"
        if one_row:
            raise ValueError(f"{name} must be (T,) or (B, T) mono waveforms, {shape}")
        raise ValueError(f"{name} must be 2-D (B, N): one row per waveform (a lone one as "
                         f"wav[None]), {shape}")  # fmt: skip
    batch, width = wave.shape
    if batch == 0 or width == 0:
        raise ValueError(f"{name} is empty: shape {tuple(wave.shape)}; need B >= 1 rows of T >= 1 samples")
    wave = wave.detach().to(dtype)
    lens = torch.full((batch,), width) if lengths is None else check_lengths(lengths, batch, width).cpu()
    valid = torch.arange(width, device=wave.device) < lens.to(wave.device)[:, None]
    bad = (~wave.isfinite() & valid).nonzero()
    if len(bad):
        row, pos = (int(v) for v in bad[0])
        raise ValueError(f"{name}[{row}, {pos}] = {float(wave[row, pos])} is not finite ({len(bad)} such "
                         "sample(s))")  # fmt: skip
    return wave, lens
