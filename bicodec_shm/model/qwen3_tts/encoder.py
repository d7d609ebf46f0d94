"""``Qwen3TTSEncoder``: Qwen3-TTS's 12 Hz speech tokenizer's encode path, 24 kHz audio -> codes,
exact under mixed-length batching.

qwen-tts's ``Qwen3TTSTokenizerV2Model.encode`` runs transformers' ``MimiModel.encode`` over the
padded batch (no padding mask reaches the encoder), keeps the first ``encoder_valid_num_quantizers``
(16) of its 32 codebooks and cuts each row to ``ceil(samples / 1920)`` frames. This module builds
the same ``MimiModel`` from the checkpoint's ``encoder_config`` (``Qwen3TTSEncoder.encoder``, named
as upstream's ``encoder``, so its state dict is the file's ``encoder.*`` as is) and runs its
blocks in the same order: the SEANet convolutions (960 samples to a 25 Hz frame), the transformer,
the strided downsampling (to 12.5 Hz) and the split residual quantizer.

**Right padding.** Every block is causal: convolutions padded on the left, and a causal
transformer (in transformers 4.57 plainly causal: its ``sliding_window`` of 250 frames does not
limit this encode, every 25 Hz frame attends to all before it). But a strided convolution pads its
input on the right up to a whole stride, and a row's last, partial frame reads that padding: zeros
(``pad_mode="constant"``) or the last column repeated (the downsampling's ``"replicate"``) when
the row is encoded alone, the activations of the other rows' width when it is encoded in a padded
batch. qwen-tts's batched ``encode`` therefore gives a row whose length is not a multiple of the
stride another last frame than its lone ``encode`` (on random weights, most of that frame's 16
codes differ). So before each of the encoder's top-level convolutions, and the downsampling,
every row's positions past its own length are set to what that convolution's padding puts there
alone::

    row i, layer input    | valid (lens_i) | past the row: 0, or the row's last column |
    conv output           | ceil(lens_i / stride) valid columns | ...

and a row of a batch gets its lone encode's codes; the stride-1 convolutions inside the residual
blocks pad nothing on the right, and the transformer only looks back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ...errors import CheckpointError
from ..config_values import as_config
from ..random_weights import WeightDraw, init_common_layers, seeded
from ..weights import meta_model
from . import checkpoint
from .encoder_config import Qwen3EncoderConfig
from .encoder_inputs import AudioLike, check_audio

# Random-init gain of the quantizer's input projection (see _random_init).
PROJECTION_GAIN = 3.0
# Past each row's frames: a valid code, so that (codes, lengths) go to Qwen3TTSDecoder.detokenize
# as they are (qwen-tts pads a codes batch with -1 and clamps it to 0 before decoding).
CODE_PAD = 0


class Qwen3TTSCodes(NamedTuple):
    """What :meth:`Qwen3TTSEncoder.tokenize` returns (int64, on the model's device)."""

    codes: torch.Tensor  # (B, 16, F): CODE_PAD past each row's frames
    lengths: torch.Tensor  # (B,): frames of each row, ceil(samples / 1920)


def mimi_encode_path(config: Qwen3EncoderConfig) -> nn.Module:
    """transformers' ``MimiModel`` of ``config`` with what its encode runs only: no decoder,
    transformer or upsampling of the decode side (qwen-tts's ``Qwen3TTSTokenizerV2Encoder`` drops
    the same three), and no codebook past the ``encoder_valid_num_quantizers`` kept nor the
    quantizers' output projections (residual quantization is sequential: the first 16 codes
    never read the later codebooks)."""
    mimi = _transformers().MimiModel(config.mimi_config())
    mimi.upsample = mimi.decoder_transformer = mimi.decoder = None
    acoustic = mimi.quantizer.acoustic_residual_vector_quantizer
    del acoustic.layers[config.num_codebooks - mimi.quantizer.num_semantic_quantizers :]
    for rvq in (mimi.quantizer.semantic_residual_vector_quantizer, acoustic):
        rvq.output_proj = None
    return mimi


class Qwen3TTSEncoder(nn.Module):
    """Encode path of Qwen3-TTS's 12 Hz tokenizer: 24 kHz audio ``(B, T)`` -> codes
    ``(B, 16, ceil(T / 1920))``.

    Build with :meth:`from_pretrained` (a ``Qwen3-TTS-Tokenizer-12Hz`` folder, or a Qwen3-TTS
    model folder with its ``speech_tokenizer/``) or :meth:`from_config` (random weights); encode
    with :meth:`tokenize`.
    """

    def __init__(self, config: Qwen3EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = mimi_encode_path(config)

    @property
    def device(self) -> torch.device:
        return self.encoder.downsample.conv.weight.device

    @classmethod
    def from_config(cls, cfg: Qwen3EncoderConfig | Mapping[str, Any] | str, *,
                    seed: int | None = None) -> Qwen3TTSEncoder:  # fmt: skip
        """An encoder with random weights (``"qwen3-tts-12hz"``, ``"tiny-12hz"``, ``"tiny"``, a
        config or an ``encoder_config`` mapping); ``seed`` makes them identical in every process.

        Raises:
            ValueError: an unknown preset, or an inconsistent config.
        """
        config = as_config(cfg, Qwen3EncoderConfig)
        model = meta_model(cls, config, Path(f"<{type(config).__name__}>"))  # nothing allocated twice
        _allocate(model)
        _random_init(model, seeded(seed))
        return model.eval()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str],
                        device: str | torch.device | None = None) -> Qwen3TTSEncoder:  # fmt: skip
        """Load a folder with ``config.json`` (its ``encoder_config``) and ``model.safetensors``
        (its ``encoder.*`` tensors), as qwen-tts's ``save_pretrained`` writes and
        ``Qwen/Qwen3-TTS-Tokenizer-12Hz`` publishes, or a model folder holding one as
        ``speech_tokenizer/``. Weights load in float32.

        Raises:
            CheckpointError: a missing or unreadable file, a bad or missing ``encoder_config``,
                or encode-path tensors missing or misshapen (all of them listed).
        """
        folder = checkpoint.find_folder(path)
        config = checkpoint.read_encoder_config(folder)
        # Shapes first, on the meta device: nothing the config asks for is allocated unless the
        # file holds it; the file's tensors then become the model's.
        model = meta_model(cls, config, folder)
        model.load_state_dict(checkpoint.read_weights(folder, model, part="encode-path"), assign=True)
        if any(t.is_meta for t in model.state_dict().values()):
            raise CheckpointError(f"{folder}: the encode path was left partly unloaded")
        return model.to(device).eval()

    def encode_adapter(self) -> Any:
        """How a server encodes a batch with this encoder (``server.adapters.encode_adapter``)."""
        from .serving import Qwen3TTSEncodeAdapter

        return Qwen3TTSEncodeAdapter(self)

    @torch.inference_mode()
    def tokenize(self, audio: AudioLike, lengths: Any = None, *,
                 sample_rate: int | None = None) -> Qwen3TTSCodes:  # fmt: skip
        """Encode a right-padded batch; each row's codes are what qwen-tts's ``encode`` gives
        that row alone.

        Args:
            audio: (B, T) float waveforms (a tensor or numpy array; one (T,) waveform is a batch
                of one) in the codec's sample rate, mono, scaled to [-1, 1] as qwen-tts reads
                files; float64 is cast to float32 as qwen-tts's feature extractor casts it.
            lengths: (B,) valid samples per row, each in ``[1, T]``; None means all T. What lies
                past a row's length is never read.
            sample_rate: the audio's rate; anything but the config's ``input_sample_rate``
                (24000) is refused (qwen-tts resamples with librosa's soxr, which this package
                does not reproduce). None: the config's.

        Returns:
            ``codes`` (B, 16, F), F = ``ceil(max(lengths) / 1920)``: row i holds ``lengths[i]``
            = ``ceil(samples_i / 1920)`` frames (qwen-tts's ``audio_codes[i]``, transposed from
            its (frames, 16)), then ``CODE_PAD``; and those ``lengths`` (B,). Both go to
            ``Qwen3TTSDecoder.detokenize`` as they are.

        Raises:
            ValueError: naming the bad argument (rate, dtype, shape, a NaN or infinite sample, a
                length).
        """
        cfg = self.config
        wave, lens = check_audio(audio, lengths, sample_rate=sample_rate, expected_rate=cfg.input_sample_rate)
        codes = self(wave.to(self.device), lens)
        frames = torch.tensor([cfg.frames(n) for n in lens], device=codes.device)
        codes = codes[:, :, : int(frames.max())]
        past = torch.arange(codes.shape[2], device=codes.device) >= frames[:, None, None]
        return Qwen3TTSCodes(codes.masked_fill(past, CODE_PAD), frames)

    def forward(self, audio: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """audio (B, T) float32 -> codes (B, 16, ceil(T / 1920)), row i exact for its first
        ``ceil(lengths[i] / 1920)`` frames. No input checks: use :meth:`tokenize`."""
        mimi = self.encoder
        for codebook in _codebooks(mimi):  # MimiEuclideanCodebook caches embed_sum / usage on first use
            codebook._embed = None
        h, lens = audio[:, None], list(lengths)  # (B, T) -> (B, 1, T)
        for layer in mimi.encoder.layers:
            if _is_mimi_conv(layer):
                h, lens = padded_alone(layer, h, lens)
            else:  # ELU, or a residual block: stride-1 causal convolutions, nothing padded right
                h = layer(h)
        h = h.transpose(1, 2)  # (B, C, T) -> (B, T, C)
        h = mimi.encoder_transformer(h, return_dict=True).last_hidden_state
        h, lens = padded_alone(mimi.downsample, h.transpose(1, 2), lens)  # (B, T, C) -> (B, C, T)
        codes = mimi.quantizer.encode(h, self.config.num_codebooks)  # (16, B, F)
        return codes.transpose(0, 1)  # (16, B, F) -> (B, 16, F)


def padded_alone(conv: nn.Module, h: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """A ``MimiConv1d`` over (B, C, W) ``h`` whose row i holds ``lens[i]`` valid columns: past
    them, each row holds what the convolution pads a lone row with (module docstring). Returns
    (B, C', W') and each row's valid outputs, ``ceil(lens[i] / stride)``."""
    width = h.shape[-1]
    if min(lens) < width:
        ends = torch.tensor(lens, device=h.device)[:, None]  # (B, 1)
        col = torch.arange(width, device=h.device)[None]  # (1, W)
        if conv.pad_mode == "constant":
            h = h.masked_fill((col >= ends)[:, None], 0.0)
        elif conv.pad_mode == "replicate":
            last = torch.minimum(col, ends - 1)  # (B, W): each column, or the row's last one
            h = h.gather(2, last[:, None].expand(-1, h.shape[1], -1))
        else:
            raise AssertionError(f"pad_mode {conv.pad_mode!r}: the config refuses it")
    stride = conv.conv.stride[0]
    out = conv(h)
    assert out.shape[-1] == -(-width // stride), (width, stride, tuple(out.shape))
    return out, [-(-n // stride) for n in lens]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "the Qwen3-TTS encode path runs transformers' MimiModel: pip install 'bicodec-shm[qwen3-encoder]'"
        ) from exc
    return transformers


def _is_mimi_conv(module: nn.Module) -> bool:
    from transformers.models.mimi.modeling_mimi import MimiConv1d

    return isinstance(module, MimiConv1d)


def _codebooks(mimi: nn.Module) -> list[nn.Module]:
    from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook

    return [m for m in mimi.modules() if isinstance(m, MimiEuclideanCodebook)]


def _allocate(model: nn.Module) -> None:
    """Give every meta parameter and buffer of ``model`` CPU memory, NaN until drawn."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.full_like(p, float("nan"), device="cpu"),
                                                   requires_grad=p.requires_grad))  # fmt: skip
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                setattr(module, name, torch.full_like(b, float("nan"), device="cpu"))


def _random_init(model: Qwen3TTSEncoder, gen: torch.Generator) -> None:
    """Fill every weight from ``gen``: the common rule (``random_weights``), then what only Mimi
    has. Scaled so that every block changes the codes (the trained-from layer scale, 0.01, would
    hide the transformer), the quantizer's input lands among its codewords (the projection's
    gain), and every codebook's code varies from frame to frame."""
    from transformers.models.mimi.modeling_mimi import MimiLayerScale

    draw = WeightDraw(gen)
    with torch.no_grad():
        init_common_layers(model, draw)
        for module in model.modules():
            if isinstance(module, MimiLayerScale):
                draw.uniform(module.scale, 0.2, 0.6)
        for codebook in _codebooks(model.encoder):
            codebook.embed_sum.normal_(0.0, 1.0, generator=gen)
            draw.uniform(codebook.cluster_usage, 0.5, 2.0)
            codebook.embed_sum.mul_(codebook.cluster_usage[:, None])  # codewords ~ N(0, 1)
        for rvq in (model.encoder.quantizer.semantic_residual_vector_quantizer,
                    model.encoder.quantizer.acoustic_residual_vector_quantizer):  # fmt: skip
            if rvq.input_proj is not None:
                draw.fan_in(rvq.input_proj.weight, rvq.input_proj.weight[0].numel(), gain=PROJECTION_GAIN)
    undrawn = [name for name, t in model.state_dict().items() if t.is_floating_point() and t.isnan().any()]
    assert not undrawn, f"weights left undrawn: {undrawn}"
