"""``DACDecoder``: the DAC decode path, codebook codes -> audio, exact under mixed-length batching.

Submodule names follow ``dac`` (``quantizer``, ``decoder``), so the folded state dict uses the
checkpoint's keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config_values import as_config
from ..inputs import IdsLike, as_ids, check_lengths
from ..modules import ResidualUnit
from ..precision import apply_dtype
from ..random_weights import WeightDraw, init_common_layers, seeded
from ..weights import meta_model
from . import checkpoint
from .config import DACConfig
from .layers import ResidualDequantizer, StageMask, WaveDecoder

# Random-init gains, measured with seed 0 on 2 rows of 6 frames at full size: RMS 0.12 / 0.19 /
# 0.14 and peaks 0.49 / 0.70 / 0.48 at 44.1 / 24 / 16 kHz (tests/test_dac_model.py asserts an RMS
# above 0.05). With an output gain of 0.05 the 24 kHz model's peaks reach 0.94, where tanh
# flattens the audio, and float rounding's share of the error against upstream doubles.
RESIDUAL_GAIN = 0.3
OUTPUT_GAIN = 0.025


class DACDecoder(nn.Module):
    """Decode path of DAC: codes ``(B, n_codebooks, T)`` -> audio ``(B, decoded_samples(T))``.

    ``T`` counts frames; every codebook has one code per frame, and a frame decodes to ``spf =
    config.samples_per_frame`` samples (512 at 44.1 kHz, 320 at 24 and 16 kHz), less 8 samples
    per decode at 24 and 16 kHz (``config.decoded_samples``, as ``dac.DAC.decode``). Build with
    :meth:`from_pretrained` (a ``weights.pth`` as descript-audio-codec publishes it) or
    :meth:`from_config` (random weights); decode with :meth:`detokenize`.
    """

    def __init__(self, config: DACConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = ResidualDequantizer(config)
        self.decoder = WaveDecoder(config)

    @property
    def device(self) -> torch.device:
        """Device of the weights; :meth:`detokenize` moves its inputs there."""
        return self.quantizer.quantizers[0].codebook.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: that of the convolutions (quantizer, Snake α and the output conv stay
        float32)."""
        return self.decoder.model[0].weight.dtype

    @classmethod
    def from_config(
        cls,
        cfg: DACConfig | Mapping[str, Any] | str,
        *,
        seed: int | None = None,
        dtype: str | torch.dtype = torch.float32,
    ) -> DACDecoder:
        """A decoder with random weights, for tests and benchmarks.

        Args:
            cfg: a config, a kwargs mapping, or a preset name (``"dac-44khz"``, ``"dac-24khz"``,
                ``"dac-16khz"``, ``"tiny-44khz"``, ..., ``"tiny"``).
            seed: makes the weights identical in every process; None draws it from torch.
            dtype: compute dtype, ``float32`` (default), ``bfloat16`` or ``float16``.

        Raises:
            ValueError: an unknown preset or dtype, or an inconsistent config.
        """
        model = cls(as_config(cfg, DACConfig))
        _random_init(model, seeded(seed))
        return apply_dtype(model, dtype).eval()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: str | torch.device | None = None,
        *,
        dtype: str | torch.dtype = torch.float32,
    ) -> DACDecoder:
        """Load a ``weights.pth`` of descript-audio-codec (the file, or a folder holding one
        ``.pth``): its config from the file's ``metadata["kwargs"]``, weight norm folded once, in
        float32. Encoder weights are ignored.

        Raises:
            CheckpointError: a missing or unreadable file, a bad config, or decode-path tensors
                missing or of the wrong shape (all of them are listed).
            ValueError: an unknown dtype.
        """
        file = checkpoint.find_file(path)
        kwargs, tensors = checkpoint.read_file(file)
        config = checkpoint.read_config(kwargs, file)
        # Shapes first, on the meta device: nothing the config asks for is allocated unless the
        # file holds it.
        state = checkpoint.fold(tensors, meta_model(cls, config, file), file)
        model = cls(config)
        model.load_state_dict(state)
        return apply_dtype(model.to(device), dtype).eval()

    def codec_adapter(self) -> Any:
        """How the server decodes a batch of DAC requests (``server.adapters.codec_adapter``)."""
        from .serving import DACAdapter

        return DACAdapter(self)

    def save_pretrained(self, path: str | os.PathLike[str]) -> int:
        """Write ``path`` (a ``.pth`` file, or ``weights.pth`` in a folder) as dac saves it:
        ``{"state_dict": ..., "metadata": {"kwargs": ...}}``, decode path only, weight norm as
        ``weight_g``/``weight_v``; returns the number of tensors written."""
        target = Path(path)
        if target.suffix != ".pth":
            target.mkdir(parents=True, exist_ok=True)
            target = target / checkpoint.WEIGHTS_FILE
        return checkpoint.write_file(target, self)

    def forward(self, codes: torch.Tensor, mask: StageMask | None = None) -> torch.Tensor:
        """codes (B, n_codebooks, T) int64 -> float32 audio (B, 1, stage_lengths(T)[-1]). No input
        checks: use :meth:`detokenize`."""
        z = self.quantizer(codes).to(self.dtype)  # (B, latent, T)
        return self.decoder(z, mask)

    @torch.inference_mode()
    def detokenize(
        self,
        codes: IdsLike | Sequence[IdsLike],
        lengths: IdsLike | Sequence[int] | None = None,
        *,
        mask: bool = True,
    ) -> torch.Tensor:
        """Decode a right-padded batch; each row's audio is exactly its unpadded decode.

        Args:
            codes: (B, n_codebooks, T) integer tensor or array, or one (B, T) per codebook; ids
                in ``[0, codebook_size)``.
            lengths: (B,) valid frames per row, each in ``[1, T]``; None means all T.
            mask: zero each row's padding before every time-mixing layer. False lets padding
                leak into short rows (for benchmarks); the tail is zeroed anyway.

        Returns:
            float32 audio (B, config.decoded_samples(T)) in (-1, 1) on the model's device. Row i
            holds ``config.decoded_samples(lengths[i])`` samples (``dac.DAC.decode``'s length:
            ``spf·lengths[i]`` at 44.1 kHz, 8 fewer at 24 and 16 kHz), then zeros.

        Raises:
            ValueError: naming the bad argument (codebook count, shape, id or length).
        """
        cfg = self.config
        ids, lens = _check_inputs(cfg, codes, lengths)
        batch, _, frames = ids.shape
        device = self.device
        host_lens = lens.tolist() if lens is not None else [frames] * batch
        padded = cfg.stage_lengths(frames)
        stages = [cfg.stage_lengths(n) for n in host_lens]  # per row, per stage
        stage_mask = None
        if min(host_lens) < frames and mask:
            per_stage = torch.tensor(stages, device=device).T  # (B, stages) -> (stages, B)
            shortest = tuple(min(column) for column in zip(*stages))
            stage_mask = StageMask(list(per_stage), padded, shortest, dtype=self.dtype)
        out = self(ids.to(device), stage_mask)[:, 0].float()  # (B, 1, N) -> (B, N)
        ends = [s[-1] for s in stages]
        if min(ends) < out.shape[1]:
            ends_t = torch.tensor(ends, device=device)[:, None]
            out.masked_fill_(torch.arange(out.shape[1], device=device) >= ends_t, 0.0)
        return out


def _check_inputs(
    cfg: DACConfig, codes: IdsLike | Sequence[IdsLike], lengths: IdsLike | Sequence[int] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate and convert to int64 tensors: codes (B, n_codebooks, T), lengths (B,) or None."""
    name, n = cfg.codec_name, cfg.n_codebooks
    if isinstance(codes, (torch.Tensor, np.ndarray)):
        ids = as_ids("codes", codes, dims=3)
    elif isinstance(codes, Sequence) and not isinstance(codes, (str, bytes)):
        if len(codes) != n:
            raise ValueError(f"{name} takes {n} codebooks, got a list of {len(codes)}")
        levels = [as_ids(f"codes[{i}]", c, dims=2) for i, c in enumerate(codes)]
        shapes = {tuple(level.shape) for level in levels}
        if len(shapes) != 1:
            raise ValueError(f"codes[i] must all have one shape (B, T), got {sorted(shapes)}")
        ids = torch.stack(levels, dim=1)  # n x (B, T) -> (B, n, T)
    else:
        raise ValueError(
            f"codes must be a (B, {n}, T) tensor or array, or a list of {n} (B, T) ones, got "
            f"{type(codes).__name__}"
        )
    batch, books, frames = ids.shape
    if books != n:
        raise ValueError(
            f"codes must have shape (B, {n}, T) for {name}'s {n} codebooks, got {tuple(ids.shape)}"
        )
    if batch == 0 or frames == 0:
        raise ValueError(f"codes has shape {tuple(ids.shape)}; need B >= 1 and T >= 1")
    bad = ((ids < 0) | (ids >= cfg.codebook_size)).nonzero()
    if len(bad):
        b, c, t = (int(v) for v in bad[0])
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(
            f"codes[{b}, {c}, {t}] = {int(ids[b, c, t])} (row {b}, codebook {c}, frame {t}) is out "
            f"of range [0, {cfg.codebook_size}){more}"
        )
    if lengths is None:
        return ids, None
    return ids, check_lengths(lengths, batch, frames).cpu()


def _random_init(model: DACDecoder, gen: torch.Generator) -> None:
    """Fill every weight from ``gen`` (``random_weights``), then keep the residual branches small
    and the output conv quiet."""
    draw = WeightDraw(gen)
    with torch.no_grad():
        init_common_layers(model, draw)
        for module in model.modules():
            if isinstance(module, ResidualUnit):  # 12 stacked residuals: keep each branch small
                conv1 = module.block[3]
                draw.fan_in(conv1.weight, conv1.in_channels, gain=RESIDUAL_GAIN)
        out_conv = model.decoder.model[-2]
        draw.fan_in(out_conv.weight, out_conv.weight[0].numel(), gain=OUTPUT_GAIN)
