"""Tests of bicodec_shm.model.qwen3_tts's encode path against qwen-tts's own 12 Hz tokenizer: lone
encodes around the 1920-sample frame, its ``save_pretrained`` folder through our loader, mixed-length
batches, the config, input checks.

``Qwen3TTSTokenizerV2Model.encode`` (qwen-tts 0.1.1, ``tests/upstream_qwen3_tts.py``) of one
unpadded row, with the same weights, is the ground truth for every row, batched or not.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from upstream_qwen3_tts import ENCODE_KEYS, make_tokenizer, upstream

from bicodec_shm.errors import CheckpointError
from bicodec_shm.model.qwen3_tts import Qwen3CodecConfig, Qwen3EncoderConfig, Qwen3TTSDecoder, Qwen3TTSEncoder
from bicodec_shm.model.qwen3_tts import encoder as encoder_module
from bicodec_shm.model.qwen3_tts.encoder import CODE_PAD

SPF = 1920
# Around the frame (1920 samples) and the SEANet strides (4, 20, 120, 960): one sample, less than
# one 960-sample step, a frame less one, a frame, a frame and one, partial third and fourth
# frames, five whole frames.
LENGTHS = [1, 100, 1919, 1920, 1921, 4000, 5767, 9600]


@pytest.fixture(scope="module")
def tiny() -> Qwen3TTSEncoder:
    return Qwen3TTSEncoder.from_config("tiny", seed=0)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """qwen-tts's tokenizer holding ``tiny``'s encoder (its own random weights in what we do not
    keep: codebooks 17 to 20, the output projections, the decoder), saved by its
    ``save_pretrained``; returns (the upstream model, the folder)."""
    torch.manual_seed(0)
    twin = make_tokenizer(Qwen3CodecConfig.preset("tiny").to_dict(), tiny.config.to_dict())
    result = twin.encoder.load_state_dict(tiny.encoder.state_dict(), strict=False)
    assert result.unexpected_keys == []
    unused = re.compile(r"quantizer\.(\w+\.output_proj\.weight|acoustic_\w+\.layers\.(15|16|17|18)\.)")
    assert result.missing_keys and all(unused.match(k) for k in result.missing_keys), result.missing_keys
    buffers = dict(twin.encoder.named_buffers())
    with torch.no_grad():  # the codebooks past the 16 kept are zero from Mimi's init: make them count
        for key in result.missing_keys:
            if key.endswith("embed_sum"):
                buffers[key].normal_()
    folder = tmp_path_factory.mktemp("qwen3_tokenizer")
    twin.save_pretrained(folder)
    return twin, folder


@pytest.fixture(scope="module")
def loaded(saved) -> Qwen3TTSEncoder:
    """Our encoder, loaded from qwen-tts's folder."""
    return Qwen3TTSEncoder.from_pretrained(saved[1])


def wave(lengths: list[int], seed: int, width: int | None = None) -> torch.Tensor:
    """(B, width) random audio, zeros past each row's length (qwen-tts's feature extractor pads with 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = 0.3 * torch.randn(len(lengths), width or max(lengths), generator=gen)
    for i, n in enumerate(lengths):
        x[i, n:] = 0.0
    return x


def upstream_encode(twin, audio: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """qwen-tts's ``encode`` of a padded batch and its padding mask: one (16, frames) per row."""
    mask = (torch.arange(audio.shape[1]) < torch.tensor(lengths)[:, None]).long()
    with torch.inference_mode():
        return [c.T for c in twin.encode(audio, mask).audio_codes]  # (frames, 16) -> (16, frames)


def test_loads_qwen_tts_save_pretrained_folder(tiny, saved, loaded):
    """Our loader reads qwen-tts's folder (config.json's encoder_config and top-level keys,
    model.safetensors' encoder.* among decoder.*) into exactly the weights qwen-tts holds."""
    twin, folder = saved
    doc = json.loads((folder / "config.json").read_text())
    assert doc["encoder_valid_num_quantizers"] == 16 and doc["encoder_config"]["num_quantizers"] == 20
    stored = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("decoder.") for k in stored)
    assert loaded.config == tiny.config
    state = loaded.state_dict()
    assert len(state) == len(tiny.state_dict()) > 40
    for key, value in state.items():
        assert torch.equal(value, stored[key]), key


@pytest.mark.parametrize("n", LENGTHS)
def test_lone_encodes_equal_qwen_tts(saved, loaded, n):
    """Every code of every codebook, and ceil(n / 1920) frames."""
    twin, _ = saved
    audio = wave([n], seed=n)
    ours, lengths = loaded.tokenize(audio[0])  # one (T,) waveform
    theirs = upstream_encode(twin, audio, [n])[0]
    assert lengths.tolist() == [math.ceil(n / SPF)]
    assert ours.shape == (1, 16, math.ceil(n / SPF)) == (1, *theirs.shape)
    assert ours.dtype == torch.int64
    assert torch.equal(ours[0], theirs)


def test_codes_are_not_degenerate(tiny):
    """A check of equal codes is weak if the codes hardly depend on the audio: every codebook
    takes several values over five frames, and other audio gives other codes."""
    codes = tiny.tokenize(wave([9600], seed=1)).codes[0]
    assert min(len(set(codes[q].tolist())) for q in range(16)) >= 3
    other = tiny.tokenize(wave([9600], seed=2)).codes[0]
    assert (codes != other).float().mean() > 0.9


def test_mixed_length_batch_equals_lone_encodes_and_qwen_tts(saved, loaded):
    """One right-padded batch (wider than its longest row): each row's codes are its lone encode's
    and qwen-tts's lone encode's, then CODE_PAD (0). (A batched row's floats differ from its lone encode's in
    the last bits; about one code in 1e5 sits close enough to a tie to flip, see
    benchmarks/bench_qwen3_encoder_ties.py; none of these 272 does.)"""
    twin, _ = saved
    model = loaded
    lengths = [5767, 1, 9600, 1921, 4000, 100, 1919]
    audio = wave(lengths, seed=3, width=10_000)
    batched, frames = model.tokenize(audio, lengths)
    assert batched.shape == (len(lengths), 16, 5)
    assert frames.tolist() == [math.ceil(n / SPF) for n in lengths] == [4, 1, 5, 2, 3, 1, 1]
    for i, n in enumerate(lengths):
        f = math.ceil(n / SPF)
        alone = model.tokenize(audio[i, :n]).codes[0]
        assert torch.equal(batched[i, :, :f], alone), f"row {i} ({n} samples)"
        assert torch.equal(alone, upstream_encode(twin, audio[i : i + 1, :n], [n])[0])
        assert (batched[i, :, f:] == CODE_PAD).all()


def test_without_the_padding_fill_a_batch_is_qwen_tts_batched_encode(saved, loaded, monkeypatch):
    """Why each convolution's input is filled past each row's end: qwen-tts's own batched
    ``encode`` gives a row whose length is not a whole frame another last frame than its lone
    encode. Our encoder with the fill removed gives exactly qwen-tts's batched codes (so it runs
    the same computation), and those differ from the lone codes in the last frame only."""
    twin, _ = saved
    model = loaded
    lengths = [9600, 5767, 4000, 1921]
    audio = wave(lengths, seed=4)
    batched_upstream = upstream_encode(twin, audio, lengths)

    def no_fill(conv, h, lens):
        return conv(h), [-(-n // conv.conv.stride[0]) for n in lens]

    monkeypatch.setattr(encoder_module, "padded_alone", no_fill)
    unfilled = model.tokenize(audio, lengths).codes
    monkeypatch.undo()
    for i, n in enumerate(lengths):
        frames = math.ceil(n / SPF)
        alone = model.tokenize(audio[i, :n]).codes[0]
        assert torch.equal(unfilled[i, :, :frames], batched_upstream[i])
        assert torch.equal(unfilled[i, :, : frames - 1], alone[:, :-1])
        if n < max(lengths):  # a partial last frame (5767, 4000, 1921) reads the other rows' width
            assert (batched_upstream[i][:, -1] != alone[:, -1]).sum() >= 8, f"row {i} ({n} samples)"


def test_codes_and_lengths_go_to_the_decoder_as_they_are(tiny):
    """The padding is a valid code, so the decoder takes a batch's (codes, lengths) unchanged; each
    row decodes as its lone encode's codes do (the decoder's own batching bound: 1e-5)."""
    decoder = Qwen3TTSDecoder.from_config("tiny", seed=0)
    lengths = [4000, 1921]
    audio = decoder.detokenize(*tiny.tokenize(wave(lengths, seed=7), lengths))
    alone = decoder.detokenize(tiny.tokenize(wave(lengths, seed=7)[1, :1921]).codes)
    assert audio.shape == (2, 3 * SPF) and alone.shape == (1, 2 * SPF)
    assert (audio[1, : 2 * SPF] - alone[0]).abs().max() <= 1e-5 and not audio[1, 2 * SPF :].any()


def test_what_lies_past_a_row_is_never_read(tiny):
    lengths = [3000, 9600]
    audio = wave(lengths, seed=5)
    noisy = audio.clone()
    noisy[0, 3000:] = torch.randn(6600) * 100
    noisy[0, 5000] = float("nan")
    clean, dirty = tiny.tokenize(audio, lengths), tiny.tokenize(noisy, lengths)
    assert torch.equal(clean.codes, dirty.codes) and torch.equal(clean.lengths, dirty.lengths)


def test_numpy_float64_and_a_list_of_lengths(tiny):
    audio = wave([2500, 4000], seed=6)
    as_numpy = tiny.tokenize(audio.double().numpy(), np.array([2500, 4000]))
    assert torch.equal(as_numpy.codes, tiny.tokenize(audio, [2500, 4000]).codes)


@pytest.mark.parametrize(("audio", "lengths", "kwargs", "message"), [
    (torch.zeros(0), None, {}, r"shape \(1, 0\); need B >= 1 rows of T >= 1 samples"),
    (torch.zeros(0, 100), None, {}, r"shape \(0, 100\)"),
    (torch.zeros(2, 1, 100), None, {}, r"\(T,\) or \(B, T\) mono waveforms, got 3-D"),
    (torch.zeros(2, 100, dtype=torch.int16), None, {}, "floating point.*int16"),
    ([0.0] * 100, None, {}, "torch.Tensor or numpy array, got list"),
    (torch.zeros(2, 100), [100, 101], {}, r"lengths\[1\] = 101 is outside \[1, T\] = \[1, 100\]"),
    (torch.zeros(2, 100), [0, 100], {}, r"lengths\[0\] = 0 is outside"),
    (torch.zeros(2, 100), [100], {}, r"lengths must have shape \(B,\) = \(2,\)"),
    (torch.zeros(2, 100), None, {"sample_rate": 16000}, "sample_rate=16000: the encoder takes 24000 Hz"),
    (torch.empty(1, 2**24 + 1), None, {}, "16777217 samples a row; the encoder takes at most 16777216"),
])  # fmt: skip
def test_bad_audio_is_refused_by_name(tiny, audio, lengths, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny.tokenize(audio, lengths, **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_sample_that_is_not_finite_is_named(tiny, bad):
    audio = torch.zeros(2, 500)
    audio[1, 321] = bad
    with pytest.raises(ValueError, match=rf"audio\[1, 321\] = {bad} is not finite"):
        tiny.tokenize(audio)
    assert tiny.tokenize(audio, [500, 300]).codes.shape == (2, 16, 1)  # past row 1's end: never read


def test_the_full_size_preset_is_the_published_encoder_config():
    """qwen-tts's config defaults (a MimiConfig's, as the published file holds them) parse to the
    full-size preset, and the encode path holds upstream's encoder parameters but the 16 unused
    codebooks and the decode-side output projections."""
    up = upstream()
    defaults = up.configuration.Qwen3TTSTokenizerV2Config()
    published = defaults.to_dict()
    top = {k: published[k] for k in ENCODE_KEYS}
    cfg = Qwen3EncoderConfig.from_dict({**published["encoder_config"], **top})
    assert cfg == Qwen3EncoderConfig.preset("qwen3-tts-12hz")
    assert cfg.samples_per_frame == 1920 and cfg.num_codebooks == 16 and cfg.frames(1921) == 2
    with torch.device("meta"):
        ours = sum(p.numel() for p in encoder_module.mimi_encode_path(cfg).state_dict().values())
        theirs = up.modeling.Qwen3TTSTokenizerV2Encoder(defaults.encoder_config)
    dropped = 16 * (2048 * 256 + 2048 + 1) + 2 * 256 * 512  # codebooks 17-32; output projections
    assert ours == sum(p.numel() for p in theirs.state_dict().values()) - dropped
    assert Qwen3EncoderConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(("change", "message"), [
    ({"use_causal_conv": False}, "use_causal_conv must be True"),
    ({"pad_mode": "reflect"}, "pad_mode must be 'constant'"),
    ({"encode_downsample_rate": 960}, "encode_downsample_rate=960 but the encoder's strides multiply to"),
    ({"codebook_dim": 16}, "codebook_dim=16 must equal vector_quantization_hidden_dimension=8"),
    ({"encoder_valid_num_quantizers": 21}, "encoder_valid_num_quantizers=21 must be between"),
    ({"_frame_rate": 25.0}, "'_frame_rate' must be sampling_rate / "),
    ({"input_sample_rate": 16000}, "input_sample_rate=16000 but the encoder's sampling_rate is 24000"),
    ({"hidden_size": "16"}, "'hidden_size' must be an integer"),
])  # fmt: skip
def test_bad_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        Qwen3EncoderConfig.from_dict({**Qwen3EncoderConfig.preset("tiny").to_dict(), **change})


def test_a_folder_without_the_encode_path_is_refused(tiny, saved, tmp_path):
    """A decode-only folder (ours) has no encoder_config; a file short of encoder tensors lists them."""
    Qwen3TTSDecoder.from_config("tiny", seed=0).save_pretrained(tmp_path / "decode_only")
    with pytest.raises(CheckpointError, match="encoder_config must be a mapping"):
        Qwen3TTSEncoder.from_pretrained(tmp_path / "decode_only")
    _, folder = saved
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["encoder.downsample.conv.weight"]
    save_file(tensors, str(short / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 encode-path tensor\(s\) missing(.|\n)*downsample\.conv"):
        Qwen3TTSEncoder.from_pretrained(short)

