"""Tests of bicodec_shm.model.qwen3_tts against qwen-tts's own 12 Hz tokenizer: lone and batched
decodes around the 300-frame chunk and the 72-frame window, its ``save_pretrained`` folder,
precision, input checks.

``Qwen3TTSTokenizerV2Model.decode`` (qwen-tts 0.1.1, ``tests/upstream_qwen3_tts.py``) with the same
weights is the ground truth for the decoder; the single-item, unpadded decode is the ground truth
for batching.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support import seed_int16
from upstream_qwen3_tts import make_tokenizer

from bicodec_shm.codecs import QWEN3_TTS_12HZ
from bicodec_shm.errors import CheckpointError
from bicodec_shm.model.precision import snr_db
from bicodec_shm.model.qwen3_tts import Qwen3CodecConfig, Qwen3TTSDecoder, checkpoint
from bicodec_shm.model.qwen3_tts.config import PRESETS

TOL = 1e-5
SPF = 1920


@pytest.fixture(scope="module")
def tiny() -> Qwen3TTSDecoder:
    return Qwen3TTSDecoder.from_config("tiny", seed=0)


def upstream_twin(model: Qwen3TTSDecoder, *, meta: bool = True):
    """qwen-tts's ``Qwen3TTSTokenizerV2Model`` holding ``model``'s weights. Built on the meta
    device and assigned (its own init of 114 M values would take seconds); its encoder, which
    decoding never runs, stays on meta unless ``meta`` is False."""
    with torch.device("meta" if meta else "cpu"):
        twin = make_tokenizer(model.config.to_dict())
    state = {k.removeprefix("decoder."): v for k, v in model.state_dict().items()}
    result = twin.decoder.load_state_dict(state, strict=False, assign=meta)
    assert result.unexpected_keys == []
    assert sorted(result.missing_keys) == ["quantizer.rvq_first.input_proj.weight",
                                           "quantizer.rvq_rest.input_proj.weight"]  # fmt: skip
    if meta:  # a non-persistent buffer: computed at init, so recomputed off the meta device
        rope = twin.decoder.pre_transformer.rotary_emb
        rope.inv_freq = rope.original_inv_freq = rope.rope_init_fn(rope.config, "cpu")[0]
    return twin


def upstream_decode(twin, codes: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """qwen-tts's ``decode``: codes (B, T, 16) with -1 past each row's end, one waveform per row."""
    padded = codes.transpose(1, 2).clone()
    for i, n in enumerate(lengths):
        padded[i, n:] = -1
    with torch.inference_mode():
        return list(twin.decode(padded).audio_values)


def random_codes(batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, 16, frames), generator=torch.Generator().manual_seed(seed))


_LONE: dict[tuple[int, int], torch.Tensor] = {}


def lone(model: Qwen3TTSDecoder, codes: torch.Tensor, row: int, frames: int) -> torch.Tensor:
    """Our decode of ``codes[row, :, :frames]`` alone, remembered for the tiny model."""
    key = (id(model), hash(codes[row, :, :frames].numpy().tobytes()))
    if key not in _LONE:
        _LONE[key] = model.detokenize(codes[row : row + 1, :, :frames])[0]
    return _LONE[key]


def check_against_upstream(model, twin, lengths: list[int], seed: int, lone_rows: int | None = None) -> float:
    """A batch of ``lengths`` decoded by us and by qwen-tts; every row equal within 1e-5 and of the
    same length, and (batched) equal to our lone decode (rows from ``lone_rows`` on, default all).
    Returns the largest difference."""
    codes = random_codes(len(lengths), max(lengths), seed)
    ours = model.detokenize(codes, lengths)
    theirs = upstream_decode(twin, codes, lengths)
    worst = 0.0
    for i, n in enumerate(lengths):
        assert theirs[i].shape == (n * SPF,)
        assert not ours[i, n * SPF :].any()  # zeros past the row's end
        worst = max(worst, (ours[i, : n * SPF] - theirs[i]).abs().max().item())
        if len(lengths) > 1 and i >= (lone_rows or 0):
            alone = lone(model, codes, i, n)
            assert alone.shape == (n * SPF,)
            assert (ours[i, : n * SPF] - alone).abs().max() <= TOL
            pcm, pcm_alone = (seed_int16(a.numpy()).astype(np.int32) for a in (ours[i, : n * SPF], alone))
            assert np.abs(pcm - pcm_alone).max() <= 1
    rms = ours[0, : lengths[0] * SPF].pow(2).mean().sqrt()
    assert 0.05 < rms < 0.5, f"random audio RMS {rms}: near silent or clipped, the check would be weak"
    assert worst <= TOL, worst
    return worst


@pytest.mark.parametrize("frames", [1, 72, 73, 299, 300, 301, 325, 600])
def test_tiny_lone_decodes_match_qwen_tts(tiny, frames, record_property):
    """Around the window (72 frames) and the chunk (300; 325 is one chunk plus the 25-frame
    context; 600 two full chunks)."""
    worst = check_against_upstream(tiny, upstream_twin(tiny), [frames], seed=frames)
    record_property("qwen3_tiny_max_abs_vs_qwen_tts", worst)


def test_tiny_mixed_length_batch_matches_qwen_tts_row_by_row(tiny, record_property):
    """One right-padded batch across both chunks: every row equals qwen-tts's decode of the same
    batch and our lone decode (float32 within 1e-5, int16 within 1 LSB), lengths equal. The rows
    the second chunk reaches (0, 2, 3) are not the first rows."""
    worst = check_against_upstream(tiny, upstream_twin(tiny), [600, 299, 325, 301, 73, 1], seed=1)
    record_property("qwen3_tiny_batched_max_abs_vs_qwen_tts", worst)


def test_the_chunk_schedule_changes_the_audio_after_frame_300(tiny):
    """Why the decoder runs upstream's chunks: one pass over 330 frames equals the chunked decode
    for the first 300 frames and not after (frame 300 sees 25 frames back, not 72)."""
    codes = random_codes(1, 330, seed=2)
    chunked = tiny.detokenize(codes)[0]
    with torch.inference_mode():
        one_pass = tiny.decoder(codes)[0, 0]
    assert (chunked[: 300 * SPF] - one_pass[: 300 * SPF]).abs().max() <= TOL
    assert (chunked[300 * SPF :] - one_pass[300 * SPF :]).abs().max() > 1e-2


def test_rows_that_start_inside_the_utterance_keep_its_chunk_grid(tiny, record_property):
    """A stream's windows, batched: a row of utterance frames [s, s + n) with ``start_frames=s``
    gives every frame whose chunk context it holds (from 25 frames before the chunk's cut, or the
    utterance's start) what qwen-tts's decode of the whole utterance gives it; without
    ``start_frames`` the cuts would fall 300 frames into the row instead."""
    codes = random_codes(1, 700, seed=5)
    whole = upstream_decode(upstream_twin(tiny), codes, [700])[0]
    # (start, frames, first exact frame): a window across a cut, one in the first chunk from the
    # utterance's start, one reaching into the last chunk.
    rows = [(275, 325, 300), (0, 40, 0), (575, 125, 600)]
    width = max(n for _, n, _ in rows)
    batch = torch.zeros((len(rows), 16, width), dtype=torch.int64)
    for i, (s, n, _) in enumerate(rows):
        batch[i, :, :n] = codes[0, :, s : s + n]
    lengths = [n for _, n, _ in rows]
    ours = tiny.detokenize(batch, lengths, start_frames=[s for s, _, _ in rows])
    worst = 0.0
    for i, (s, n, exact) in enumerate(rows):
        got, want = ours[i, (exact - s) * SPF : n * SPF], whole[exact * SPF : (s + n) * SPF]
        worst = max(worst, (got - want).abs().max().item())
        assert not ours[i, n * SPF :].any()
    record_property("qwen3_window_max_abs_vs_whole_decode", worst)
    assert worst <= TOL, worst
    # The row of [275, 600) decoded as an utterance of its own cuts at its frame 300 (utterance
    # frame 575), which the utterance's decode does not.
    alone = tiny.detokenize(batch[:1, :, :325])[0]
    assert (alone[300 * SPF :] - whole[575 * SPF : 600 * SPF]).abs().max() > 1e-2


def test_start_frames_must_be_one_per_row_and_not_negative(tiny):
    codes = random_codes(2, 5, seed=6)
    for bad in ([0], [0, -1], [0, 1, 2]):
        with pytest.raises(ValueError, match="start_frames must be 2 frame numbers"):
            tiny.detokenize(codes, start_frames=bad)


def test_padding_content_does_not_matter(tiny):
    codes = random_codes(2, 80, seed=3)
    other = codes.clone()
    other[1, :, 30:] = torch.randint(0, 2048, (16, 50))
    assert torch.equal(tiny.detokenize(codes, [80, 30])[1], tiny.detokenize(other, [80, 30])[1])


def test_codes_as_a_list_of_codebooks_decode_the_same(tiny):
    codes = random_codes(2, 5, seed=4)
    as_list = [codes[:, i].numpy() for i in range(16)]
    assert torch.equal(tiny.detokenize(as_list, [5, 2]), tiny.detokenize(codes, [5, 2]))


def test_presets_have_upstreams_parameter_count_and_the_layout():
    cfg = Qwen3CodecConfig.preset("qwen3-tts-12hz")
    assert cfg.layout == QWEN3_TTS_12HZ and cfg.codec_name == "qwen3-tts-12hz"
    assert Qwen3CodecConfig.preset("tiny").layout == QWEN3_TTS_12HZ
    assert Qwen3CodecConfig.preset("tiny-12hz") == Qwen3CodecConfig.preset("tiny")
    with torch.device("meta"):
        twin = make_tokenizer(cfg.to_dict())
        ours = Qwen3TTSDecoder(cfg)
    decode_path = sum(p.numel() for k, p in twin.decoder.state_dict().items() if "input_proj.weight" not in k
                      or "pre_transformer" in k)  # fmt: skip
    assert sum(p.numel() for p in ours.parameters()) == decode_path
    assert int(twin.decoder.total_upsample) == cfg.samples_per_frame == 1920
    assert twin.config.decoder_config.head_dim == 64 and twin.decoder.config.sliding_window == 72
    with pytest.raises(ValueError, match="unknown preset 'big'"):
        Qwen3CodecConfig.preset("big")
    assert Qwen3CodecConfig.from_dict(cfg.to_dict()) == cfg


def test_loads_a_folder_saved_by_qwen_tts(tmp_path, tiny):
    """``Qwen3TTSTokenizerV2Model.save_pretrained``: the published layout, encoder included; also
    as the ``speech_tokenizer/`` of a Qwen3-TTS model folder."""
    twin = upstream_twin(tiny, meta=False)
    twin.save_pretrained(tmp_path / "model" / "speech_tokenizer")
    doc = json.loads((tmp_path / "model" / "speech_tokenizer" / "config.json").read_text())
    assert doc["model_type"] == "qwen3_tts_tokenizer_12hz" and "encoder_config" in doc
    codes = random_codes(1, 40, seed=5)
    want = upstream_decode(twin, codes, [40])[0]
    for path in (tmp_path / "model" / "speech_tokenizer", tmp_path / "model"):
        assert checkpoint.codec_in(path) == "qwen3-tts-12hz"
        loaded = Qwen3TTSDecoder.from_pretrained(path)
        assert loaded.config == tiny.config
        assert (loaded.detokenize(codes)[0] - want).abs().max() <= TOL


def test_save_pretrained_round_trips(tmp_path, tiny):
    assert tiny.save_pretrained(tmp_path) > 0
    codes = random_codes(1, 9, seed=6)
    again = Qwen3TTSDecoder.from_pretrained(tmp_path / "model.safetensors")
    assert again.config == tiny.config
    assert torch.equal(again.detokenize(codes), tiny.detokenize(codes))


def test_checkpoint_errors_name_the_problem(tmp_path, tiny):
    with pytest.raises(CheckpointError, match="no config.json; expected a Qwen3-TTS-Tokenizer-12Hz folder"):
        Qwen3TTSDecoder.from_pretrained(tmp_path)
    assert checkpoint.codec_in(tmp_path) is None
    with pytest.raises(CheckpointError, match="no such file"):
        Qwen3TTSDecoder.from_pretrained(tmp_path / "absent")
    tiny.save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    good = json.loads(config.read_text())
    config.write_text(json.dumps({**good, "model_type": "qwen3_tts"}))
    with pytest.raises(CheckpointError, match='expected "model_type": "qwen3_tts_tokenizer_12hz"'):
        Qwen3TTSDecoder.from_pretrained(tmp_path)
    config.write_text(json.dumps({**good, "decode_upsample_rate": 2000}))
    with pytest.raises(CheckpointError, match="decode_upsample_rate=2000 but the decoder's rates multiply"):
        Qwen3TTSDecoder.from_pretrained(tmp_path)
    config.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Qwen3TTSDecoder.from_pretrained(tmp_path)
    config.write_text(json.dumps({**good, "decoder_config": {**good["decoder_config"], "hidden_size": 32}}))
    with pytest.raises(CheckpointError, match=r"(?s)wrong: decoder.pre_transformer.input_proj.weight: "
                                              r"expected \(32, 16\), got \(16, 16\)"):  # fmt: skip
        Qwen3TTSDecoder.from_pretrained(tmp_path)
    config.write_text(json.dumps(good))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        Qwen3TTSDecoder.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("codes", "lengths", "message"),
    [
        (lambda c: c[:, :15], None, r"codes must have shape \(B, 16, T\) for qwen3-tts-12hz's 16 codebooks"),
        (lambda c: [c[:, i] for i in range(15)], None, "qwen3-tts-12hz takes 16 codebooks, got a list of 15"),
        (lambda c: c.float(), None, "integer dtype"),
        (lambda c: torch.where(torch.arange(4) == 2, 2048, c), None,
         r"codes\[0, 0, 2\] = 2048 \(row 0, codebook 0, frame 2\) is out of range \[0, 2048\)"),
        (lambda c: torch.where(torch.arange(4) == 3, -1, c), None, r"codes\[0, 0, 3\] = -1"),
        (lambda c: c, [4, 0], r"lengths\[1\] = 0 is outside \[1, T\] = \[1, 4\]"),
        (lambda c: c[:, :, :0], None, "need B >= 1 and T >= 1"),
    ],
)  # fmt: skip
def test_bad_input_raises_value_error(tiny, codes, lengths, message):
    with pytest.raises(ValueError, match=message):
        tiny.detokenize(codes(random_codes(2, 4, seed=7)), lengths)


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="'sliding_window' must be an integer"):
        Qwen3CodecConfig.from_dict({**PRESETS["tiny"], "sliding_window": "72"})
    with pytest.raises(ValueError, match="'hidden_act' must be 'silu'"):
        Qwen3CodecConfig.from_dict({"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="'rope_scaling' must be null"):
        Qwen3CodecConfig.from_dict({"rope_scaling": {"rope_type": "dynamic"}})
    with pytest.raises(ValueError, match="must be a multiple of num_key_value_heads=3"):
        Qwen3CodecConfig.from_dict({**PRESETS["tiny"], "num_key_value_heads": 3})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_stays_close_and_batches_exactly(tiny, dtype):
    model = Qwen3TTSDecoder.from_config("tiny", seed=0, dtype=dtype)
    assert model.dtype == getattr(torch, dtype)
    assert model.decoder.quantizer.rvq_first.vq.layers[0]._codebook.embedding_sum.dtype == torch.float32
    assert model.decoder.decoder[-1].conv.weight.dtype == torch.float32
    codes = random_codes(3, 30, seed=8)
    audio = model.detokenize(codes, [30, 20, 7])
    assert audio.dtype == torch.float32
    snr = snr_db(audio, tiny.detokenize(codes, [30, 20, 7]))
    assert 10 < snr < 80, snr  # it really ran in reduced precision, and not far off
    for i, n in enumerate([30, 20, 7]):
        alone = model.detokenize(codes[i : i + 1, :, :n])[0]
        assert snr_db(audio[i, : n * SPF], alone) > 30


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_full_size_matches_qwen_tts_past_the_attention_window(record_property):
    """The published architecture (random weights): a mixed-length batch past the 72-frame
    attention window against qwen-tts's decode of it, row by row; the short row also against its
    lone decode. The 300-frame chunk is cut in Python the same way at every size: crossing it is
    checked at tiny size (above) and through the server (a full-size batch of 301 frames takes
    about two minutes on a 2-core CPU)."""
    model = Qwen3TTSDecoder.from_config("qwen3-tts-12hz", seed=0)
    worst = check_against_upstream(model, upstream_twin(model), [80, 2], seed=9, lone_rows=1)
    record_property("qwen3_full_max_abs_vs_qwen_tts", worst)


# --- on a GPU (benchmarks/device_check.sh) -----------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_full_size_float32_rows_equal_their_lone_decode_and_qwen_tts(exact_math, record_property):
    """Full size on the GPU: a mixed-length batch across the 300-frame cut, every row within
    1e-5 of its lone decode there, and a short batch within 1e-4 of qwen-tts's decode on the CPU
    (two devices' float32 rounding)."""
    model = Qwen3TTSDecoder.from_config("qwen3-tts-12hz", seed=0).to("cuda")
    lengths = [330, 7, 301, 150, 1]
    codes = random_codes(len(lengths), max(lengths), seed=20).cuda()
    audio = model.detokenize(codes, lengths)
    worst = max((audio[i, : n * SPF] - model.detokenize(codes[i : i + 1, :, :n])[0]).abs().max().item()
                for i, n in enumerate(lengths))  # fmt: skip
    record_property("qwen3_cuda_float32_batched_vs_lone_max_abs", worst)
    assert worst <= TOL, worst
    short = codes[:2, :, :40].cpu()
    want = upstream_decode(upstream_twin(model.cpu()), short, [40, 40])
    ours = model.cuda().detokenize(short.cuda()).cpu()
    off = max((ours[i] - want[i]).abs().max().item() for i in range(2))
    record_property("qwen3_cuda_vs_qwen_tts_cpu_max_abs", off)
    assert off <= 1e-4, off


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_qwen3_reduced_precision_against_float32(exact_math, dtype, record_property):
    ref = Qwen3TTSDecoder.from_config("qwen3-tts-12hz", seed=0).to("cuda")
    model = Qwen3TTSDecoder.from_config("qwen3-tts-12hz", seed=0, dtype=dtype).to("cuda")
    lengths = [120, 33, 75]
    codes = random_codes(3, 120, seed=21).cuda()
    audio = model.detokenize(codes, lengths)
    snr = snr_db(audio, ref.detokenize(codes, lengths))
    lone = min(snr_db(audio[i, : n * SPF], model.detokenize(codes[i : i + 1, :, :n])[0])
               for i, n in enumerate(lengths))  # fmt: skip
    record_property(f"qwen3_cuda_snr_db_{dtype}", round(snr, 2))
    record_property(f"qwen3_cuda_batched_vs_lone_snr_db_{dtype}", round(lone, 2))
    assert snr >= {"bfloat16": 15.0, "float16": 30.0}[dtype], snr
    assert lone >= {"bfloat16": 15.0, "float16": 30.0}[dtype], lone
