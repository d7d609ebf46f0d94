"""``SNACDecoder``: the SNAC decode path, per-level codes -> audio, exact under mixed-length batching.

Submodule names follow ``snac`` (``quantizer``, ``decoder``), so the folded state dict uses the
checkpoint's keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config_values import as_config
from ..inputs import IdsLike, as_ids, check_lengths, check_range
from ..modules import ResidualUnit, TimeMask
from ..precision import apply_dtype
from ..random_weights import WeightDraw, init_common_layers, seeded
from ..weights import meta_model
from . import checkpoint
from .config import SNACConfig
from .layers import BatchContext, LocalMHA, NoiseBlock, ResidualDequantizer, WaveDecoder
from .noise import batch_noise, check_seeds

# Random-init gains, measured with seed 0 on 4 frames: RMS 0.16 (24 kHz) and 0.18-0.21 (32 kHz),
# peaks 0.60-0.69, noise ~1/3 of the RMS; with an output gain of 0.2, tanh saturates (RMS 0.5).
RESIDUAL_GAIN = 0.3
NOISE_GAIN = 0.1
OUTPUT_GAIN = 0.05


class SNACDecoder(nn.Module):
    """Decode path of SNAC: per-level codes ``[(B, T·r_0), (B, T·r_1), ...]`` -> ``(B, spf·T)``.

    ``T`` counts frames (codes of the coarsest level); level ``i`` has ``r_i`` codes per frame
    (``config.level_rates``: 1:2:4 at 24 kHz, 1:2:4:8 at 32 and 44 kHz), and a frame decodes to
    ``spf = config.samples_per_frame`` samples. Build with :meth:`from_pretrained` (a
    ``config.json`` + ``pytorch_model.bin`` folder, as published) or :meth:`from_config`
    (random weights); decode with :meth:`detokenize`.
    """

    def __init__(self, config: SNACConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = ResidualDequantizer(config)
        self.decoder = WaveDecoder(config)
        # Upsampling at each decoder block's output, where its noise is added: 8, 64, 256, 512.
        self.noise_factors = self.decoder.time_factors[1:]

    @property
    def device(self) -> torch.device:
        """Device of the weights; :meth:`detokenize` moves its inputs there."""
        return self.quantizer.quantizers[0].codebook.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: that of the convolutions (quantizer, norms, Snake α, rotary and the
        output conv stay float32)."""
        return self.decoder.model[0].weight.dtype

    @classmethod
    def from_config(
        cls,
        cfg: SNACConfig | Mapping[str, Any] | str,
        *,
        seed: int | None = None,
        dtype: str | torch.dtype = torch.float32,
    ) -> SNACDecoder:
        """A decoder with random weights, for tests and benchmarks.

        Args:
            cfg: a config, a ``config.json`` mapping, or a preset name (``"snac-24khz"``,
                ``"snac-32khz"``, ``"snac-44khz"``, ``"tiny-24khz"``, ..., ``"tiny"``).
            seed: makes the weights identical in every process; None draws it from torch.
            dtype: compute dtype, ``float32`` (default), ``bfloat16`` or ``float16``.

        Raises:
            ValueError: an unknown preset or dtype, or an inconsistent config.
        """
        model = cls(as_config(cfg, SNACConfig))
        _random_init(model, seeded(seed))
        return apply_dtype(model, dtype).eval()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: str | torch.device | None = None,
        *,
        dtype: str | torch.dtype = torch.float32,
    ) -> SNACDecoder:
        """Load a folder with ``config.json`` and ``pytorch_model.bin`` (or ``model.safetensors``),
        as published in ``hubertsiuzdak/snac_24khz``; weight norm is folded once, in float32.
        Encoder weights are ignored.

        Raises:
            CheckpointError: a missing or unreadable file, a bad config, or decode-path tensors
                missing or of the wrong shape (all of them are listed).
            ValueError: an unknown dtype.
        """
        folder = checkpoint.find_folder(path)
        config = checkpoint.read_config(folder / checkpoint.CONFIG_FILE)
        # Shapes first, on the meta device: nothing the config asks for is allocated unless the
        # file holds it.
        state = checkpoint.read_state_dict(folder, meta_model(cls, config, folder))
        model = cls(config)
        model.load_state_dict(state)
        return apply_dtype(model.to(device), dtype).eval()

    def codec_adapter(self) -> Any:
        """How the server decodes a batch of SNAC requests (``adapters.codec_adapter``)."""
        from .serving import SNACAdapter

        return SNACAdapter(self)

    def save_pretrained(self, path: str | os.PathLike[str]) -> int:
        """Write ``config.json`` and ``pytorch_model.bin`` (decode path only, weight norm as
        ``parametrizations``); returns the number of tensors written."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / checkpoint.CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2))
        return checkpoint.write_state_dict(folder / checkpoint.WEIGHTS_FILE, self)

    def forward(self, codes: list[torch.Tensor], ctx: BatchContext | None = None) -> torch.Tensor:
        """codes[i] (B, T·r_i) int64 -> float32 audio (B, 1, spf·T). No input checks: use
        :meth:`detokenize`."""
        z = self.quantizer(codes).to(self.dtype)  # (B, latent, T·latents_per_frame)
        return self.decoder(z, ctx or BatchContext())

    @torch.inference_mode()
    def detokenize(
        self,
        codes: Sequence[IdsLike],
        lengths: IdsLike | Sequence[int] | None = None,
        *,
        noise: bool = True,
        noise_seeds: Sequence[int] | int | None = None,
        start_frames: Sequence[int] | None = None,
        mask: bool = True,
        unpadded_forward: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decode a right-padded batch; each row's audio is exactly its unpadded decode.

        Args:
            codes: one (B, T·r_i) integer tensor or array per level, ids in ``[0, codebook_size)``.
            lengths: (B,) valid frames per row, each in ``[1, T]``; None means all T.
            noise: add the NoiseBlocks' noise (as SNAC does); False decodes without it.
            noise_seeds: (B,) seeds in ``[0, 2**63)`` or one for every row; None means
                ``noise.DEFAULT_NOISE_SEED`` (0). The same seed and codes give the same audio.
            start_frames: (B,) frame at which each row starts in its utterance, so that a
                streaming window draws the full decode's noise; None means 0.
            mask: zero each row's padding before every time-mixing layer. False lets padding
                leak into short rows (for benchmarks); the tail is zeroed anyway.
            unpadded_forward: what decodes a batch whose rows all have length T, as
                ``serving.UnpaddedForward`` does; None: this module. The server's CPU lanes pass its
                traced graphs (model/traced.py).

        Returns:
            float32 audio (B, spf·T) in (-1, 1) on the model's device; row i is 0 from
            ``spf·lengths[i]`` on.

        Raises:
            ValueError: naming the bad argument (level count, shape, id, length or seed).
        """
        cfg = self.config
        levels, lens = _check_inputs(cfg, codes, lengths)
        batch, frames = levels[0].shape
        device, per_frame = self.device, cfg.latents_per_frame
        latent_frames = frames * per_frame
        host_lens = lens.tolist() if lens is not None else [frames] * batch
        shortest = min(host_lens)
        ctx = BatchContext()
        if shortest < frames:
            latent_lens = lens.to(device) * per_frame
            ctx.latent_lengths = latent_lens
            if mask:
                ctx.mask = TimeMask(latent_lens, latent_frames, self.decoder.time_factors,
                                    dtype=self.dtype, shortest=shortest * per_frame)  # fmt: skip
        if noise and cfg.noise:
            starts = _check_starts(start_frames, batch)
            seeds = check_seeds(noise_seeds, batch)
            ctx.noise = [
                n.to(device=device, dtype=self.dtype, non_blocking=True)
                for n in batch_noise(seeds, [n * per_frame for n in host_lens],
                                     [s * per_frame for s in starts], latent_frames,
                                     self.noise_factors)
            ]  # fmt: skip
        levels = [level.to(device) for level in levels]
        if unpadded_forward is not None and shortest == frames:
            audio = unpadded_forward(*levels, *(ctx.noise or ()))
        else:
            audio = self(levels, ctx)
        audio = audio[:, 0].float()  # (B, 1, N) -> (B, N)
        if shortest < frames:
            ends = torch.tensor(host_lens, device=device)[:, None] * cfg.samples_per_frame
            audio.masked_fill_(torch.arange(audio.shape[1], device=device) >= ends, 0.0)
        return audio


def _check_inputs(
    cfg: SNACConfig, codes: Sequence[IdsLike], lengths: IdsLike | Sequence[int] | None
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Validate and convert to int64 tensors: per level (B, T·r_i), lengths (B,) or None."""
    name = cfg.codec_name
    if isinstance(codes, (torch.Tensor, np.ndarray)) or not isinstance(codes, Sequence):
        raise ValueError(f"codes must be a list of {cfg.n_levels} per-level (B, T·rate) tensors")
    if len(codes) != cfg.n_levels:
        rates = ":".join(map(str, cfg.level_rates))
        raise ValueError(f"{name} takes {cfg.n_levels} code levels at rates {rates}, got {len(codes)}")
    levels = [as_ids(f"codes[{i}]", c, dims=2) for i, c in enumerate(codes)]
    batch, frames = levels[0].shape
    if batch == 0 or frames == 0:
        raise ValueError(f"codes[0] has shape {tuple(levels[0].shape)}; need B >= 1 and T >= 1")
    for i, (level, rate) in enumerate(zip(levels, cfg.level_rates, strict=True)):
        if level.shape != (batch, frames * rate):
            raise ValueError(
                f"codes[{i}] must have shape (B, {rate}·T) = ({batch}, {frames * rate}) for the "
                f"T = {frames} frames of codes[0] ({name}: rates "
                f"{':'.join(map(str, cfg.level_rates))}), got {tuple(level.shape)}"
            )
        check_range(f"codes[{i}]", level, cfg.codebook_size)
    if lengths is None:
        return levels, None
    return levels, check_lengths(lengths, batch, frames).cpu()


def _check_starts(start_frames: Sequence[int] | None, batch: int) -> list[int]:
    if start_frames is None:
        return [0] * batch
    starts = [int(s) for s in start_frames]
    if len(starts) != batch or min(starts) < 0:
        raise ValueError(f"start_frames must be {batch} frame indices >= 0, got {list(start_frames)}")
    return starts


def _random_init(model: SNACDecoder, gen: torch.Generator) -> None:
    """Fill every weight from ``gen`` (``random_weights``), then keep the residual branches, the
    noise and the attention output small and the output conv quiet."""
    draw = WeightDraw(gen)
    with torch.no_grad():
        init_common_layers(model, draw)
        for module in model.modules():
            if isinstance(module, ResidualUnit):  # 12 stacked residuals: keep each branch small
                conv1 = module.block[3]
                draw.fan_in(conv1.weight, conv1.in_channels, gain=RESIDUAL_GAIN)
            elif isinstance(module, NoiseBlock):
                draw.fan_in(module.linear.weight, module.linear.in_channels, gain=NOISE_GAIN)
            elif isinstance(module, LocalMHA):
                draw.fan_in(module.to_out.weight, module.to_out.in_features, gain=RESIDUAL_GAIN)
        out_conv = model.decoder.model[-2]
        draw.fan_in(out_conv.weight, out_conv.weight[0].numel(), gain=OUTPUT_GAIN)
