"""Tests of bicodec_shm.model: token de-quantisation, shapes, batching exactness, input checks.

The single-item, unpadded decode is the ground truth for every batching test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bicodec_shm.model import BiCodecConfig, BiCodecDecoder
from bicodec_shm.model.bicodec import decoder as decoder_module
from bicodec_shm.model.bicodec.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]
HOP = 320


@pytest.fixture(scope="module")
def tiny() -> BiCodecDecoder:
    return BiCodecDecoder.from_config("tiny", seed=0)


@pytest.fixture(scope="module")
def full() -> BiCodecDecoder:
    return BiCodecDecoder.from_config("spark-tts-0.5b", seed=0)


def random_batch(
    batch: int, frames: int, seed: int, *, min_len: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ids and lengths; row 0 always has the full length T."""
    gen = torch.Generator().manual_seed(seed)
    semantic = torch.randint(0, 8192, (batch, frames), generator=gen)
    glob = torch.randint(0, 4096, (batch, 32), generator=gen)
    lengths = torch.randint(min_len, frames + 1, (batch,), generator=gen)
    lengths[0] = frames
    return semantic, glob, lengths


def batching_errors(
    model: BiCodecDecoder, semantic: torch.Tensor, glob: torch.Tensor, lengths: torch.Tensor
) -> tuple[float, float, float]:
    """(max |Δ| masked vs lone decodes, max |tail|, min over short rows of max |Δ| unmasked)."""
    masked = model.detokenize(semantic, glob, lengths)
    leaky = model.detokenize(semantic, glob, lengths, mask=False)
    worst, tail, leak = 0.0, 0.0, float("inf")
    for i, n in enumerate(lengths.tolist()):
        alone = model.detokenize(semantic[i : i + 1, :n], glob[i : i + 1])[0]
        assert alone.shape == (HOP * n,)
        worst = max(worst, (masked[i, : HOP * n] - alone).abs().max().item())
        tail = max(tail, masked[i, HOP * n :].abs().max().item() if n < semantic.shape[1] else 0.0)
        assert torch.all(leaky[i, HOP * n :] == 0), "mask=False must still zero the tail"
        if n < semantic.shape[1]:
            leak = min(leak, (leaky[i, : HOP * n] - alone).abs().max().item())
    return worst, tail, leak


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "spark-tts-0.5b"])
def test_config_vocabularies(preset: str) -> None:
    cfg = BiCodecConfig.preset(preset)
    assert (cfg.semantic_vocab, cfg.global_vocab, cfg.n_global, cfg.hop_length) == (
        8192,
        4096,
        32,
        320,
    )
    assert cfg.sample_rate == 16000
    assert BiCodecConfig.from_dict(cfg.to_dict()) == cfg


def test_config_accepts_whole_yaml_document_and_ignores_unknown_keys() -> None:
    doc = {"audio_tokenizer": {**PRESETS["tiny"], "postnet": {"anything": 1}, "encoder": {}}}
    assert BiCodecConfig.from_dict(doc) == BiCodecConfig.preset("tiny")


def test_config_lists_every_missing_field() -> None:
    mapping = {k: dict(v) for k, v in PRESETS["tiny"].items()}
    del mapping["prenet"]["vocos_dim"], mapping["decoder"]["rates"]
    del mapping["speaker_encoder"]
    with pytest.raises(ValueError) as info:
        BiCodecConfig.from_dict(mapping)
    message = str(info.value)
    for name in ("prenet.vocos_dim", "decoder.rates", "speaker_encoder"):
        assert name in message


@pytest.mark.parametrize(
    ("section", "key", "value", "needle"),
    [
        ("decoder", "kernel_sizes", [16, 10, 8, 4], "k - r even"),
        ("prenet", "condition_dim", 63, "prenet.condition_dim"),
        ("prenet", "sample_ratios", [2, 2], "sample_ratios"),
        ("quantizer", "codebook_size", "8192", "quantizer.codebook_size"),
        ("speaker_encoder", "fsq_num_quantizers", 2, "fsq_num_quantizers"),
    ],
)
def test_config_rejects_inconsistent_values(section: str, key: str, value, needle: str) -> None:
    mapping = {k: dict(v) for k, v in PRESETS["tiny"].items()}
    mapping[section][key] = value
    with pytest.raises(ValueError, match=needle):
        BiCodecConfig.from_dict(mapping)


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(ValueError, match="spark-tts-0.5b"):
        BiCodecDecoder.from_config("huge")


# --- global (speaker) tokens ------------------------------------------------------------------


def fsq_table_by_digit_loop(levels: list[int]) -> torch.Tensor:
    """Every FSQ code, by explicit mixed-radix digits: code_j = (d_j - L_j // 2) / (L_j // 2)."""
    rows = []
    for index in range(int(np.prod(levels))):
        rest, row = index, []
        for level in levels:
            digit = rest % level
            rest //= level
            row.append((digit - level // 2) / (level // 2))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def test_fsq_index_to_code(tiny: BiCodecDecoder) -> None:
    table = fsq_table_by_digit_loop([4, 4, 4, 4, 4, 4])
    assert table.shape == (4096, 6)
    assert set(table.unique().tolist()) == {-1.0, -0.5, 0.0, 0.5}
    assert table[1].tolist() == [-0.5, -1, -1, -1, -1, -1]  # digit 0 is the fastest
    assert table[1024].tolist() == [-1, -1, -1, -1, -1, -0.5]
    ids = torch.arange(4096).reshape(128, 32)
    codes = tiny.speaker_encoder.quantizer.codes(ids)
    assert torch.equal(codes.reshape(4096, 6), table)


def test_speaker_vector_flattens_channel_major(tiny: BiCodecDecoder) -> None:
    table = fsq_table_by_digit_loop([4] * 6)
    ids = torch.randint(0, 4096, (3, 32), generator=torch.Generator().manual_seed(5))
    proj_out = tiny.speaker_encoder.quantizer.project_out
    project = tiny.speaker_encoder.project
    latent = table[ids] @ proj_out.weight.T + proj_out.bias  # (B, 32 tokens, C)
    n_tok, n_ch = latent.shape[1], latent.shape[2]
    flat = torch.zeros(3, n_ch * n_tok)
    for c in range(n_ch):
        for t in range(n_tok):
            flat[:, c * n_tok + t] = latent[:, t, c]
    expected = flat @ project.weight.T + project.bias
    with torch.inference_mode():
        got = tiny.speaker_encoder(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    token_major = latent.reshape(3, -1) @ project.weight.T + project.bias
    assert (got - token_major).abs().max() > 1e-2  # the other order would be caught


# --- shapes -----------------------------------------------------------------------------------


def test_each_upsampling_block_lengthens_time_by_its_stride(tiny: BiCodecDecoder) -> None:
    blocks = list(tiny.decoder.model)[1:5]
    x = torch.randn(2, 64, 7)
    with torch.inference_mode():
        for block, rate in zip(blocks, (8, 5, 4, 2), strict=True):
            y = block(x)
            assert y.shape == (2, x.shape[1] // 2, x.shape[2] * rate)
            x = y


@pytest.mark.parametrize("frames", [1, 2, 17])
def test_output_is_hop_times_tokens(tiny: BiCodecDecoder, frames: int) -> None:
    semantic, glob, _ = random_batch(2, frames, seed=frames)
    audio = tiny.detokenize(semantic, glob)
    assert audio.shape == (2, HOP * frames)
    assert audio.dtype == torch.float32
    assert audio.device == tiny.device
    assert audio.abs().max() < 1
    assert not audio.requires_grad


def test_random_audio_is_neither_silent_nor_saturated(tiny: BiCodecDecoder) -> None:
    semantic, glob, _ = random_batch(4, 25, seed=3)
    audio = tiny.detokenize(semantic, glob)
    rms = audio.pow(2).mean().sqrt().item()
    assert 0.01 < rms < 0.5
    assert (audio.abs() > 0.99).float().mean() < 0.01


def test_seeded_weights_are_identical_across_processes(tiny: BiCodecDecoder) -> None:
    script = (
        "import torch\n"
        "from bicodec_shm.model import BiCodecDecoder\n"
        "m = BiCodecDecoder.from_config('tiny', seed=0)\n"
        "print(repr(sum(float(v.double().sum()) for v in m.state_dict().values())))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    here = sum(float(v.double().sum()) for v in tiny.state_dict().values())
    assert float(out.stdout) == here
    other = BiCodecDecoder.from_config("tiny", seed=1)
    assert not torch.equal(other.prenet.linear.weight, tiny.prenet.linear.weight)


# --- batching exactness -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_rows_equal_their_lone_decode_tiny(tiny: BiCodecDecoder, seed: int) -> None:
    semantic, glob, lengths = random_batch(5, 37, seed=seed)
    worst, tail, leak = batching_errors(tiny, semantic, glob, lengths)
    assert worst <= 1e-5
    assert tail == 0.0
    assert leak > 1e-2  # without the mask the padding clearly leaks into short rows


@pytest.mark.slow
def test_batched_rows_equal_their_lone_decode_full_size(full: BiCodecDecoder) -> None:
    semantic, glob, _ = random_batch(3, 16, seed=7)
    lengths = torch.tensor([16, 9, 13])
    worst, tail, leak = batching_errors(full, semantic, glob, lengths)
    assert worst <= 1e-5
    assert tail == 0.0
    assert leak > 1e-2


def test_unpadded_batch_builds_no_mask(tiny: BiCodecDecoder, monkeypatch) -> None:
    semantic, glob, _ = random_batch(3, 11, seed=4)
    reference = tiny.detokenize(semantic, glob)

    def no_mask(*args, **kwargs):
        raise AssertionError("a TimeMask was built for a batch without padding")

    monkeypatch.setattr(decoder_module, "TimeMask", no_mask)
    assert torch.equal(tiny.detokenize(semantic, glob, torch.full((3,), 11)), reference)
    assert torch.equal(tiny.detokenize(semantic, glob, [11, 11, 11]), reference)


def test_accepts_numpy_and_narrow_integer_ids(tiny: BiCodecDecoder) -> None:
    semantic, glob, lengths = random_batch(2, 9, seed=8)
    reference = tiny.detokenize(semantic, glob, lengths)
    got = tiny.detokenize(semantic.numpy().astype(np.int32), glob.to(torch.int16), lengths.tolist())
    assert torch.equal(got, reference)


# --- input checks -----------------------------------------------------------------------------


def _bad_call(model: BiCodecDecoder, case: str) -> None:
    semantic, glob, lengths = random_batch(2, 6, seed=9)
    if case == "semantic_out_of_range":
        semantic[1, 4] = 8192
    elif case == "negative_global":
        glob[0, 3] = -1
    elif case == "global_too_large":
        glob[1, 31] = 4096
    elif case == "31_globals":
        glob = glob[:, :31]
    elif case == "zero_frames":
        semantic, lengths = semantic[:, :0], None
    elif case == "length_zero":
        lengths[1] = 0
    elif case == "length_above_t":
        lengths[1] = 7
    elif case == "float_ids":
        semantic = semantic.float()
    elif case == "bool_ids":
        semantic = semantic > 0
    elif case == "one_dim":
        semantic = semantic[0]
    elif case == "float_lengths":
        lengths = lengths.float()
    elif case == "lengths_shape":
        lengths = lengths[:1]
    elif case == "batch_mismatch":
        glob = glob[:1]
    model.detokenize(semantic, glob, lengths)


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("semantic_out_of_range", r"semantic_ids\[1, 4\] = 8192 is out of range \[0, 8192\)"),
        ("negative_global", r"global_ids\[0, 3\] = -1 is out of range \[0, 4096\)"),
        ("global_too_large", r"global_ids\[1, 31\] = 4096"),
        ("31_globals", r"global_ids must have shape \(B, 32\).*got \(2, 31\)"),
        ("zero_frames", r"T = 0"),
        ("length_zero", r"lengths\[1\] = 0 is outside \[1, T\] = \[1, 6\]"),
        ("length_above_t", r"lengths\[1\] = 7 is outside"),
        ("float_ids", r"semantic_ids must have an integer dtype.*float32"),
        ("bool_ids", r"semantic_ids must have an integer dtype.*bool"),
        ("one_dim", r"semantic_ids must be 2-D, got 1-D"),
        ("float_lengths", r"lengths must have an integer dtype"),
        ("lengths_shape", r"lengths must have shape \(B,\) = \(2,\), got \(1,\)"),
        ("batch_mismatch", r"global_ids must have shape"),
    ],
)
def test_bad_input_raises_value_error(tiny: BiCodecDecoder, case: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _bad_call(tiny, case)


# --- full-size counts -------------------------------------------------------------------------


def decode_path_tensors(at: dict) -> list[tuple[str, int]]:
    """(kind, numel) of every decode-path tensor in a Spark-TTS checkpoint, weight norm as g, v.

    Written from the architecture description, independently of the model code.
    """
    q, s, p, d = at["quantizer"], at["speaker_encoder"], at["prenet"], at["decoder"]
    out: list[tuple[str, int]] = []

    def linear(n_in: int, n_out: int) -> None:
        out.extend([("w", n_in * n_out), ("b", n_out)])

    def conv(n_in: int, n_out: int, k: int, groups: int = 1) -> None:
        out.extend([("w", n_in // groups * n_out * k), ("b", n_out)])

    def wn_conv(n_in: int, n_out: int, k: int, transpose: bool = False) -> None:
        out.extend([("g", n_in if transpose else n_out), ("v", n_in * n_out * k), ("b", n_out)])

    def layer_norm(dim: int) -> None:
        out.extend([("w", dim), ("b", dim)])

    def backbone(dim: int, hidden: int, layers: int, cond: int | None) -> None:
        conv(dim, dim, 7)
        norm = (lambda: (linear(cond, dim), linear(cond, dim))) if cond else lambda: layer_norm(dim)
        norm()
        for _ in range(layers):
            conv(dim, dim, 7, groups=dim)
            norm()
            linear(dim, hidden)
            linear(hidden, dim)
            out.append(("gamma", dim))
        layer_norm(dim)

    out.append(("w", q["codebook_size"] * q["codebook_dim"]))
    wn_conv(q["codebook_dim"], q["input_dim"], 1)
    linear(len(s["fsq_levels"]), s["latent_dim"])
    linear(s["latent_dim"] * s["token_num"], s["out_dim"])
    dim, hidden = p["vocos_dim"], p["vocos_intermediate_dim"]
    linear(p["input_channels"], dim)
    for _ in p["sample_ratios"]:
        backbone(dim, hidden, 2, None)
    backbone(dim, hidden, p["vocos_num_layers"], p["condition_dim"])
    linear(dim, p["out_channels"])
    ch = d["channels"]
    wn_conv(d["input_channel"], ch, 7)
    for i, k in enumerate(d["kernel_sizes"]):
        c_in, c_out = ch // 2**i, ch // 2 ** (i + 1)
        out.append(("alpha", c_in))
        wn_conv(c_in, c_out, k, transpose=True)
        for _ in range(3):
            out.append(("alpha", c_out))
            wn_conv(c_out, c_out, 7)
            out.append(("alpha", c_out))
            wn_conv(c_out, c_out, 1)
    out.append(("alpha", c_out))
    wn_conv(c_out, 1, 7)
    return out


def test_full_size_parameter_count_matches_the_architecture(full: BiCodecDecoder) -> None:
    tensors = decode_path_tensors(PRESETS["spark-tts-0.5b"])
    assert len(tensors) == 319
    stored = sum(n for _, n in tensors)
    folded = sum(n for kind, n in tensors if kind != "g")
    assert stored == 96_287_714
    assert sum(p.numel() for p in full.parameters()) == folded == 96_273_633


@pytest.mark.slow
def test_full_size_checkpoint_has_319_decode_path_tensors(full: BiCodecDecoder, tmp_path) -> None:
    from safetensors import safe_open

    written = full.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        numel = sum(int(np.prod(f.get_slice(k).get_shape())) for k in keys)
    assert written == len(keys) == len(decode_path_tensors(PRESETS["spark-tts-0.5b"])) == 319
    assert numel == 96_287_714
    assert sum(k.endswith(".weight_g") for k in keys) == 31


# --- receptive field ------------------------------------------------------------------------------


def nan_reach(model: BiCodecDecoder, frames: int, poisoned: int) -> tuple[int, int]:
    """The first and last token whose audio turns NaN when token ``poisoned``'s codebook entry is
    NaN: the tokens whose audio depends on it (NaN spreads through a conv whatever its weights)."""
    gen = torch.Generator().manual_seed(5)
    semantic = torch.randint(1, 8192, (1, frames), generator=gen)
    semantic[0, poisoned] = 0
    glob = torch.randint(0, 4096, (1, 32), generator=gen)
    codebook = model.quantizer.codebook.weight
    saved = codebook.detach().clone()
    with torch.no_grad():
        codebook[0] = float("nan")
        try:
            audio = model.detokenize(semantic, glob)[0].reshape(frames, HOP)
        finally:
            codebook.copy_(saved)
    touched = torch.isnan(audio).any(dim=1).nonzero().flatten()
    return int(touched[0]), int(touched[-1])


@pytest.mark.parametrize("preset", ["tiny", "spark-tts-0.5b"])
def test_receptive_field_is_derived_from_the_config_and_is_exactly_what_a_token_reaches(preset, request):
    """A token's audio depends on exactly ``receptive_field`` tokens to each side: a window with
    that much context sees everything its region depends on, one token less misses one."""
    model = request.getfixturevalue("tiny" if preset == "tiny" else "full")
    rf = model.config.receptive_field
    frames, poisoned = 2 * rf + 41, rf + 20
    assert nan_reach(model, frames, poisoned) == (poisoned - rf, poisoned + rf)


def test_the_clients_receptive_field_is_the_released_models() -> None:
    from bicodec_shm.client.streaming import RECEPTIVE_FIELD

    assert RECEPTIVE_FIELD == BiCodecConfig.preset("spark-tts-0.5b").receptive_field == 67
    assert BiCodecConfig.preset("tiny").receptive_field == 37 < RECEPTIVE_FIELD
