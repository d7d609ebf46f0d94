"""``Qwen3TTSDecoder``: Qwen3-TTS's 12 Hz speech tokenizer's decode path, codes -> 24 kHz audio,
exact under mixed-length batching.

The published file's decoder keys begin with ``decoder.`` (its encoder's with ``encoder.``):
``Qwen3TTSDecoder.decoder`` is upstream's ``Qwen3TTSTokenizerV2Decoder``, submodules named as
there, so its state dict is the file's decode path as is.

**The chunk schedule.** qwen-tts's ``decode`` runs ``chunked_decode``: windows of 300 frames,
each but the first decoded with the 25 frames before it as left context (which is then cut), each
window a separate forward pass whose positions start at 0. That changes the audio: frame 300's
attention sees frames 275..300, where one pass over the whole row would let it see 229..300 (the
72-frame window), and the convolutions lose their history at the cut. So this decoder runs the
same schedule, and since every layer is causal a row padded on the right gets, in every window,
the samples it gets alone; a window past a row's end is not computed for that row.

**Rows that start inside an utterance.** A stream decodes windows of an utterance; a window's
``start_frames`` says where in it the window starts, and the chunk grid stays the utterance's:
windows cut at its multiples of 300 frames, each with the 25 frames before the cut (as many as the
row holds). A stream window that starts 25 frames before a cut therefore gives every frame after
the cut exactly what the whole utterance's decode gives it::

    utterance  0 ......... 275 ... 300 ................ 575 ... 600 ......
    row (start_frames=275)  |  ctx  |   chunk 1: exact   |
                            |<-- one pass, positions from 0 -->|
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config_values import as_config
from ..inputs import IdsLike, as_ids, check_lengths
from ..precision import apply_dtype
from ..random_weights import WeightDraw, init_common_layers, seeded
from . import checkpoint
from .config import Qwen3CodecConfig
from .layers import (
    CausalConv,
    Codebook,
    ConvNeXtBlock,
    ResidualUnit,
    SnakeBeta,
    SplitDequantizer,
    upsamplers,
    wave_decoder,
)
from .transformer import LayerScale, RMSNorm, Transformer

# Random-init gains (see _random_init).
RESIDUAL_GAIN = 0.2
OUTPUT_GAIN = 0.05

CHUNK_FRAMES = 300  # qwen-tts's chunked_decode(chunk_size=300, left_context_size=25)
CONTEXT_FRAMES = 25


class SpeechDecoder(nn.Module):
    """upstream's ``Qwen3TTSTokenizerV2Decoder.forward``: codes (B, Q, T) -> audio (B, 1, spf·T)
    in [-1, 1], one pass, no chunking."""

    def __init__(self, cfg: Qwen3CodecConfig) -> None:
        super().__init__()
        self.quantizer = SplitDequantizer(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = Transformer(cfg)
        self.upsample = upsamplers(cfg)
        self.decoder = wave_decoder(cfg)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        dtype = self.pre_conv.conv.weight.dtype
        h = self.pre_conv(self.quantizer(codes).to(dtype))  # (B, latent, T)
        h = self.pre_transformer(h.transpose(1, 2)).transpose(1, 2)
        for up, block in self.upsample:
            h = block(up(h))
        *body, snake, conv_out = self.decoder
        for layer in body:
            h = layer(h)
        return conv_out(snake(h.float())).clamp(-1.0, 1.0)  # the last SnakeBeta and conv in float32


class Qwen3TTSDecoder(nn.Module):
    """Decode path of Qwen3-TTS's 12 Hz tokenizer: codes ``(B, 16, T)`` -> audio ``(B, 1920·T)``.

    Build with :meth:`from_pretrained` (a ``Qwen3-TTS-Tokenizer-12Hz`` folder, or a Qwen3-TTS
    model folder with its ``speech_tokenizer/``) or :meth:`from_config` (random weights); decode
    with :meth:`detokenize`.
    """

    # A stream's window says where in its utterance it starts (``detokenize(start_frames=)``).
    takes_start_frames = True

    def __init__(self, config: Qwen3CodecConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = SpeechDecoder(config)

    @property
    def device(self) -> torch.device:
        return self.decoder.pre_conv.conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: that of the convolutions and the transformer (codebooks, SnakeBeta and
        the output conv stay float32)."""
        return self.decoder.pre_conv.conv.weight.dtype

    @classmethod
    def from_config(cls, cfg: Qwen3CodecConfig | Mapping[str, Any] | str, *, seed: int | None = None,
                    dtype: str | torch.dtype = torch.float32) -> Qwen3TTSDecoder:  # fmt: skip
        """A decoder with random weights (``"qwen3-tts-12hz"``, ``"tiny-12hz"``, ``"tiny"``, a
        config or a ``decoder_config`` mapping); ``seed`` makes them identical in every process.

        Raises:
            ValueError: an unknown preset or dtype, or an inconsistent config.
        """
        model = cls(as_config(cfg, Qwen3CodecConfig))
        _random_init(model, seeded(seed))
        return apply_dtype(model, dtype).eval()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], device: str | torch.device | None = None, *,
                        dtype: str | torch.dtype = torch.float32) -> Qwen3TTSDecoder:  # fmt: skip
        """Load a folder with ``config.json`` and ``model.safetensors`` (as qwen-tts's
        ``save_pretrained`` writes and ``Qwen/Qwen3-TTS-Tokenizer-12Hz`` publishes), or a model
        folder holding one as ``speech_tokenizer/``. Only the decoder's tensors are read.

        Raises:
            CheckpointError: a missing or unreadable file, a bad config, or decode-path tensors
                missing or misshapen (all of them listed).
            ValueError: an unknown dtype.
        """
        folder = checkpoint.find_folder(path)
        model = cls(checkpoint.read_config(folder))
        model.load_state_dict(checkpoint.read_weights(folder, model))
        return apply_dtype(model.to(device), dtype).eval()

    def save_pretrained(self, path: str | os.PathLike[str]) -> int:
        """Write ``config.json`` and ``model.safetensors`` (decode path only) into the folder
        ``path``; returns the number of tensors written."""
        return checkpoint.write_folder(Path(path), self)

    def codec_adapter(self) -> Any:
        """How the server decodes a batch (``server.adapters.codec_adapter``)."""
        from .serving import Qwen3TTSAdapter

        return Qwen3TTSAdapter(self)

    @torch.inference_mode()
    def detokenize(self, codes: IdsLike | Sequence[IdsLike],
                   lengths: IdsLike | Sequence[int] | None = None, *,
                   start_frames: Sequence[int] | None = None,
                   window_decoder: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   ) -> torch.Tensor:  # fmt: skip
        """Decode a right-padded batch; each row's audio is what qwen-tts's ``decode`` gives it.

        Args:
            codes: (B, num_quantizers, T) integer tensor or array, or one (B, T) per codebook;
                ids in ``[0, codebook_size)``.
            lengths: (B,) valid frames per row, each in ``[1, T]``; None means all T.
            start_frames: (B,) frame of its utterance where each row starts (a stream's window):
                the chunk grid is the utterance's (see the module docstring). None: all 0.
            window_decoder: what decodes each padded window (B, 16, W) -> (B, 1, 1920·W); None:
                ``self.decoder``. The server's CPU lanes pass its traced graph (model/traced.py).

        Returns:
            float32 audio (B, 1920·T) in [-1, 1] on the model's device; row i holds
            ``1920·lengths[i]`` samples, then zeros.

        Raises:
            ValueError: naming the bad argument (codebook count, shape, id or length).
        """
        ids, lens = _check_inputs(self.config, codes, lengths)
        batch, _, frames = ids.shape
        spf = self.config.samples_per_frame
        host_lens = lens.tolist() if lens is not None else [frames] * batch
        starts = _check_starts(start_frames, batch)
        decode = self.decoder if window_decoder is None else window_decoder
        ids = ids.to(self.device)
        out = torch.zeros((batch, spf * frames), device=self.device)
        # Pass k decodes every row's k-th chunk window, right-padded to the longest of them.
        windows = [chunk_windows(s, n) for s, n in zip(starts, host_lens, strict=True)]
        for k in range(max(len(w) for w in windows)):
            rows = [i for i, w in enumerate(windows) if len(w) > k]
            cut = [windows[i][k] for i in rows]  # (context, first, end) in row frames
            width = max(end - first + context for context, first, end in cut)
            window = torch.zeros((len(rows), ids.shape[1], width), dtype=ids.dtype, device=self.device)
            for j, (i, (context, first, end)) in enumerate(zip(rows, cut, strict=True)):
                window[j, :, : end - first + context] = ids[i, :, first - context : end]
            audio = decode(window)[:, 0]  # (rows, spf·width)
            for j, (i, (context, first, end)) in enumerate(zip(rows, cut, strict=True)):
                out[i, first * spf : end * spf] = audio[j, context * spf : (context + end - first) * spf]
        if min(host_lens) < frames:
            ends = torch.tensor(host_lens, device=self.device)[:, None] * spf
            out.masked_fill_(torch.arange(out.shape[1], device=self.device) >= ends, 0.0)
        return out


def chunk_windows(start: int, length: int) -> list[tuple[int, int, int]]:
    """The chunk windows of a row of ``length`` frames starting at frame ``start`` of its
    utterance: ``(context, first, end)`` in row frames, ``[first, end)`` kept and the ``context``
    frames before it decoded with it and cut (qwen-tts's ``chunked_decode`` for ``start == 0``)."""
    cuts = [0] + list(range((start // CHUNK_FRAMES + 1) * CHUNK_FRAMES - start, length, CHUNK_FRAMES))
    ends = cuts[1:] + [length]
    return [(min(CONTEXT_FRAMES, first), first, end) for first, end in zip(cuts, ends, strict=True)]


def _check_starts(start_frames: Sequence[int] | None, batch: int) -> list[int]:
    if start_frames is None:
        return [0] * batch
    starts = [int(s) for s in start_frames]
    if len(starts) != batch or min(starts) < 0:
        raise ValueError(f"start_frames must be {batch} frame numbers >= 0, got {list(start_frames)}")
    return starts


def _check_inputs(
    cfg: Qwen3CodecConfig, codes: IdsLike | Sequence[IdsLike], lengths: IdsLike | Sequence[int] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate and convert to int64 tensors: codes (B, Q, T), lengths (B,) or None."""
    name, n = cfg.codec_name, cfg.num_quantizers
    if isinstance(codes, (torch.Tensor, np.ndarray)):
        ids = as_ids("codes", codes, dims=3)
    elif isinstance(codes, Sequence) and not isinstance(codes, (str, bytes)):
        if len(codes) != n:
            raise ValueError(f"{name} takes {n} codebooks, got a list of {len(codes)}")
        levels = [as_ids(f"codes[{i}]", c, dims=2) for i, c in enumerate(codes)]
        if len({tuple(level.shape) for level in levels}) != 1:
            raise ValueError(
                f"codes[i] must all have one shape (B, T), got {sorted({tuple(x.shape) for x in levels})}"
            )
        ids = torch.stack(levels, dim=1)  # n x (B, T) -> (B, n, T)
    else:
        raise ValueError(f"codes must be a (B, {n}, T) tensor or array, or a list of {n} (B, T) ones, "
                         f"got {type(codes).__name__}")  # fmt: skip
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
        raise ValueError(f"codes[{b}, {c}, {t}] = {int(ids[b, c, t])} (row {b}, codebook {c}, frame {t}) is "
                         f"out of range [0, {cfg.codebook_size}){more}")  # fmt: skip
    if lengths is None:
        return ids, None
    return ids, check_lengths(lengths, batch, frames).cpu()


def _random_init(model: Qwen3TTSDecoder, gen: torch.Generator) -> None:
    """Fill every weight from ``gen``: the common rule (``random_weights``), then what only this
    codec has, scaled so that the transformer and every ConvNeXt branch change the audio (their
    trained-from scales, 0.01 and 1e-6, would hide them) and the output is not clipped."""
    draw = WeightDraw(gen)
    with torch.no_grad():
        init_common_layers(model, draw)
        for module in model.modules():
            if isinstance(module, Codebook):
                module.embedding_sum.normal_(0.0, 1.0, generator=gen)
                draw.uniform(module.cluster_usage, 0.5, 2.0)
            elif isinstance(module, SnakeBeta):
                draw.uniform(module.alpha, -0.5, 0.5)
                draw.uniform(module.beta, -0.5, 0.5)
            elif isinstance(module, RMSNorm):
                draw.uniform(module.weight, 0.8, 1.2)
            elif isinstance(module, LayerScale):
                draw.uniform(module.scale, 0.2, 0.6)
            elif isinstance(module, ConvNeXtBlock):
                draw.uniform(module.gamma, 0.2, 0.6)
            elif isinstance(module, ResidualUnit):  # 12 stacked residuals: keep each branch small
                draw.fan_in(module.conv2.conv.weight, module.conv2.conv.in_channels, gain=RESIDUAL_GAIN)
        conv_out = model.decoder.decoder[-1].conv
        draw.fan_in(conv_out.weight, conv_out.weight[0].numel(), gain=OUTPUT_GAIN)
