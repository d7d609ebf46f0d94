"""Reduced precision: which dtypes the decoder runs in, and what stays float32 when it does.

The convolutions and linear layers (over 99 % of the FLOPs) run in the chosen dtype. Modules
marked ``keep_float32 = True`` keep float32 weights and compute in float32 whatever their input
dtype, returning the input's dtype:

- LayerNorm / AdaLayerNorm: the mean and variance of 384 channels lose most of their digits in
  bfloat16, and AdaLayerNorm's scale and shift come from the float32 speaker vector anyway;
- Snake: α and ``1 / (α + 1e-9)`` (a small α makes a large reciprocal) and ``sin²(α·x)``;
- the token de-quantisers (codebook, FSQ table, speaker projection): a few thousand FLOPs per
  token, and the speaker vector conditions every AdaLayerNorm;
- the wave generator's last Snake and output conv (96 -> 1 channel): under 0.1 % of the FLOPs,
  and the audio is no longer rounded to bfloat16's 8 bits before ``tanh``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``torch.float32`` / ``"bfloat16"`` / ... -> a torch dtype; None means float32.

    Raises:
        ValueError: anything but float32, bfloat16 or float16, naming the allowed values.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    allowed = ", ".join(DTYPES)
    raise ValueError(f"dtype must be one of {allowed} (a string or the torch dtype), got {dtype!r}")


def apply_dtype(model: nn.Module, dtype: str | torch.dtype | None) -> nn.Module:
    """Cast ``model`` in place to ``dtype``, keeping every ``keep_float32`` module in float32.

    Casting a float32 model to float32 changes no tensor, so the default model is bit-for-bit
    the one it always was. Returns ``model``.
    """
    model.to(resolve_dtype(dtype))
    for module in model.modules():
        if getattr(module, "keep_float32", False):
            module.float()
    return model


def snr_db(audio: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``audio`` against ``reference`` (same shape), in dB:
    ``10·log10(Σ ref² / Σ (audio - ref)²)``; ``inf`` when they are equal."""
    if audio.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(audio.shape)} vs {tuple(reference.shape)}")
    ref = reference.double()
    noise = (audio.double() - ref).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    return float("inf") if noise == 0 else 10.0 * math.log10(signal / noise)
