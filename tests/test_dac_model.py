"""Tests of bicodec_shm.model.dac: the reference check against ``descript-audio-codec``, exact
mixed-length batching, the ``weights.pth`` format, precision, input checks.

``dac.DAC(...).decode(dac.DAC(...).quantizer.from_codes(codes)[0])`` with the same weights is the
ground truth for the decoder; the single-item, unpadded decode is the ground truth for batching.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support import seed_int16
from upstream_dac import load_dac, make_dac, upstream

from bicodec_shm.codecs import DAC_16KHZ, DAC_24KHZ, DAC_44KHZ
from bicodec_shm.errors import CheckpointError
from bicodec_shm.model import weights as shared
from bicodec_shm.model.dac import DACConfig, DACDecoder
from bicodec_shm.model.dac.config import PRESETS
from bicodec_shm.model.precision import snr_db

VARIANTS = ("44khz", "24khz", "16khz")
LAYOUTS = {"44khz": DAC_44KHZ, "24khz": DAC_24KHZ, "16khz": DAC_16KHZ}
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, DACDecoder]:
    return {v: DACDecoder.from_config(f"tiny-{v}", seed=0) for v in VARIANTS}


def random_codes(cfg: DACConfig, batch: int, frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.codebook_size, (batch, cfg.n_codebooks, frames), generator=gen)


def upstream_twin(model: DACDecoder) -> torch.nn.Module:
    """``dac.DAC(**config)`` holding ``model``'s weights (weight norm as weight_g/weight_v). Built
    on the meta device and assigned: its own random init of 76 M values would take seconds."""
    with torch.device("meta"):
        twin = make_dac(**model.config.to_dict())
    state = shared.convert_state_dict(model.state_dict(), shared.weight_norm_prefixes(model), "weight_norm")
    result = twin.load_state_dict(state, strict=False, assign=True)
    assert result.unexpected_keys == []
    # What dac has and the decoder does not: the encoder and the quantizers' in_proj.
    assert [k for k in result.missing_keys if not k.startswith("encoder.") and ".in_proj." not in k] == []
    return twin


def upstream_decode(twin: torch.nn.Module, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return twin.decode(twin.quantizer.from_codes(codes)[0])[:, 0]


def check_against_upstream(model: DACDecoder, frames: int, seed: int) -> None:
    cfg = model.config
    codes = random_codes(cfg, 2, frames, seed)
    ours = model.detokenize(codes)
    want = upstream_decode(upstream_twin(model), codes)
    assert ours.shape == want.shape == (2, cfg.decoded_samples(frames))  # upstream's own length
    assert ours.pow(2).mean().sqrt() > 0.05, "random audio is near silent: the check would be weak"
    assert (ours - want).abs().max() <= TOL


def check_batched_equals_lone(model: DACDecoder, frames: int, lengths: list[int], seed: int,
                              tol: float = TOL) -> float:  # fmt: skip
    cfg = model.config
    codes = random_codes(cfg, len(lengths), frames, seed)
    audio = model.detokenize(codes, lengths)
    worst = worst16 = 0.0
    for i, n in enumerate(lengths):
        alone = model.detokenize(codes[i : i + 1, :, :n])[0]
        assert alone.shape == (cfg.decoded_samples(n),)
        worst = max(worst, (audio[i, : len(alone)] - alone).abs().max().item())
        pcm, pcm_alone = (seed_int16(a.numpy()).astype(np.int32) for a in (audio[i, : len(alone)], alone))
        worst16 = max(worst16, np.abs(pcm - pcm_alone).max())
        assert not audio[i, len(alone) :].any()
    assert worst <= tol, worst
    if tol <= TOL:
        assert worst16 <= 1, worst16
    return worst


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_matches_descript_audio_codec(tiny_models, variant):
    check_against_upstream(tiny_models[variant], frames=7, seed=1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_batched_rows_equal_their_lone_decodes(tiny_models, variant):
    # At 24/16 kHz the stride-5 block makes every stage one step short of frames x upsampling:
    # a row of 3 frames is 119 steps there, not 120, and its mask must say so.
    check_batched_equals_lone(tiny_models[variant], 9, [9, 5, 1, 3, 8], seed=2)


def test_unmasked_padding_leaks_into_short_rows(tiny_models):
    """The control: without the masks the short rows hear their padding."""
    model = tiny_models["24khz"]
    codes = random_codes(model.config, 2, 8, seed=3)
    leaky = model.detokenize(codes, [8, 3], mask=False)
    alone = model.detokenize(codes[1:, :, :3])[0]
    assert (leaky[1, : len(alone)] - alone).abs().max() > 1e-2


def test_padding_content_does_not_matter(tiny_models):
    model = tiny_models["16khz"]
    codes = random_codes(model.config, 2, 8, seed=4)
    other = codes.clone()
    other[1, :, 3:] = torch.randint(0, 1024, (model.config.n_codebooks, 5))
    assert torch.equal(model.detokenize(codes, [8, 3])[1], model.detokenize(other, [8, 3])[1])


def test_codes_as_a_list_of_codebooks_decode_the_same(tiny_models):
    model = tiny_models["44khz"]
    codes = random_codes(model.config, 2, 4, seed=5)
    as_list = [codes[:, i].numpy() for i in range(model.config.n_codebooks)]
    assert torch.equal(model.detokenize(as_list, [4, 2]), model.detokenize(codes, [4, 2]))


def test_odd_strides_decode_eight_samples_short_as_upstream_and_the_layout_says_so():
    """dac's 24/16 kHz decoders give 320·n - 8 samples for n frames (stride 5: 5L - 1 steps); the
    decoder returns that length, and the torch-free layout (which the server's header carries to
    clients) knows it for every n."""
    cfg = DACConfig.preset("dac-24khz")
    assert cfg.stage_lengths(3) == (3, 24, 119, 476, 952)
    assert cfg.decoded_samples(3) == 3 * 320 - 8
    assert DACConfig.preset("dac-44khz").decoded_samples(3) == 3 * 512
    for variant in VARIANTS:
        cfg = DACConfig.preset(f"dac-{variant}")
        assert LAYOUTS[variant].end_trim == (8 if variant != "44khz" else 0)
        assert all(cfg.layout.decoded_samples(n) == cfg.decoded_samples(n) for n in (1, 2, 7, 2584))
        model = DACDecoder.from_config(f"tiny-{variant}", seed=0)
        assert model.detokenize(random_codes(cfg, 2, 3, seed=0), [3, 1]).shape == (2, cfg.decoded_samples(3))


def test_presets_have_upstreams_parameter_counts_and_layouts():
    dac = upstream()
    for variant in VARIANTS:
        cfg = DACConfig.preset(f"dac-{variant}")
        assert cfg.layout == LAYOUTS[variant] and cfg.codec_name == f"dac-{variant}"
        assert DACConfig.preset(f"tiny-{variant}").layout == cfg.layout
        with torch.device("meta"):
            twin = make_dac(**cfg.to_dict())
            ours = DACDecoder(cfg)
        decode_path = sum(p.numel() for k, p in twin.state_dict().items()
                          if not k.startswith("encoder.") and ".in_proj." not in k)  # fmt: skip
        # weight norm: upstream keeps g (one per output channel) and v; we keep the folded weight.
        g = sum(p.numel() for k, p in twin.state_dict().items() if k.endswith("weight_g")
                and not k.startswith("encoder.") and ".in_proj." not in k)  # fmt: skip
        assert sum(p.numel() for p in ours.parameters()) == decode_path - g
        assert twin.hop_length == cfg.samples_per_frame and dac.version == "1.0.0"
    assert DACConfig.preset("tiny") == DACConfig.preset("tiny-44khz")
    with pytest.raises(ValueError, match="unknown preset 'big'"):
        DACConfig.preset("big")
    cfg = DACConfig.preset("dac-24khz")
    assert DACConfig.from_dict(cfg.to_dict()) == cfg


def test_loads_a_weights_file_saved_by_upstream(tmp_path, tiny_models):
    """``dac.DAC.save(path, package=False)``, audiotools' own save: the published format, with
    weight_g/weight_v and the whole codec (encoder included)."""
    model = tiny_models["24khz"]
    twin = make_dac(**model.config.to_dict())
    state = shared.convert_state_dict(model.state_dict(), shared.weight_norm_prefixes(model), "weight_norm")
    twin.load_state_dict(state, strict=False)
    twin.save(str(tmp_path / "weights_24khz.pth"), package=False)
    saved = torch.load(tmp_path / "weights_24khz.pth", weights_only=True)
    assert any(k.startswith("encoder.") for k in saved["state_dict"])
    assert "decoder.model.0.weight_g" in saved["state_dict"]
    loaded = DACDecoder.from_pretrained(tmp_path)  # the folder's one .pth
    assert loaded.config.latent_dim == 64  # upstream saves the latent it computed
    assert loaded.config.latent == model.config.latent and loaded.config.layout == model.config.layout
    codes = random_codes(model.config, 1, 5, seed=6)
    assert (loaded.detokenize(codes) - model.detokenize(codes)).abs().max() <= TOL
    assert (loaded.detokenize(codes)[:, : model.config.decoded_samples(5)]
            - upstream_decode(twin, codes)).abs().max() <= TOL  # fmt: skip


@pytest.mark.parametrize("form", shared.FORMS)
def test_loads_every_weight_norm_form_and_round_trips(tmp_path, tiny_models, form):
    model = tiny_models["16khz"]
    file = tmp_path / "weights.pth"
    state = shared.export_state_dict(model, form)
    torch.save({"state_dict": state, "metadata": {"kwargs": model.config.to_dict()}}, file)
    codes = random_codes(model.config, 1, 3, seed=7)
    want = model.detokenize(codes)
    assert (DACDecoder.from_pretrained(file).detokenize(codes) - want).abs().max() <= TOL
    assert model.save_pretrained(tmp_path / "saved") > 0
    again = DACDecoder.from_pretrained(tmp_path / "saved")
    assert (again.detokenize(codes) - want).abs().max() <= TOL
    # What we save, upstream loads (dac.DAC.load: kwargs from the metadata, strict=False).
    twin = load_dac(str(tmp_path / "saved" / "weights.pth"))
    assert (upstream_decode(twin, codes) - want[:, : model.config.decoded_samples(3)]).abs().max() <= TOL


def test_checkpoint_errors_name_the_problem(tmp_path, tiny_models):
    with pytest.raises(CheckpointError, match="expected one DAC weights file.*found none"):
        DACDecoder.from_pretrained(tmp_path)
    model = tiny_models["44khz"]
    torch.save(model.state_dict(), tmp_path / "plain.pth")
    with pytest.raises(CheckpointError, match="not a descript-audio-codec weights file"):
        DACDecoder.from_pretrained(tmp_path / "plain.pth")
    state = dict(shared.export_state_dict(model, "weight_norm"))
    del state["decoder.model.0.weight_g"]
    state["quantizer.quantizers.3.codebook.weight"] = torch.zeros(3, 8)
    torch.save({"state_dict": state, "metadata": {"kwargs": model.config.to_dict()}}, tmp_path / "bad.pth")
    (tmp_path / "plain.pth").unlink()
    with pytest.raises(CheckpointError, match=r"(?s)missing: decoder.model.0.weight_g.*"
                                              r"wrong: quantizer.quantizers.3.codebook.weight"):  # fmt: skip
        DACDecoder.from_pretrained(tmp_path)
    torch.save({"state_dict": state, "metadata": {"kwargs": {"decoder_rates": [8, 1]}}}, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match="decoder_rates"):
        DACDecoder.from_pretrained(tmp_path / "bad.pth")
    (tmp_path / "other.pth").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="2 of them: bad.pth, other.pth"):
        DACDecoder.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="cannot read the weights"):
        DACDecoder.from_pretrained(tmp_path / "other.pth")


@pytest.mark.parametrize(
    ("codes", "lengths", "message"),
    [
        (lambda c: c[:, :8], None, r"codes must have shape \(B, 9, T\) for dac-44khz's 9 codebooks"),
        (lambda c: [c[:, i] for i in range(8)], None, "dac-44khz takes 9 codebooks, got a list of 8"),
        (lambda c: c.float(), None, "integer dtype"),
        (lambda c: c[0], None, "must be 3-D"),
        (lambda c: torch.where(torch.arange(4) == 2, 1024, c), None,
         r"codes\[0, 0, 2\] = 1024 \(row 0, codebook 0, frame 2\) is out of range \[0, 1024\)"),
        (lambda c: c, [4, 0], r"lengths\[1\] = 0 is outside \[1, T\] = \[1, 4\]"),
        (lambda c: c, [4], r"lengths must have shape \(B,\) = \(2,\)"),
        (lambda c: "codes", None, "codes must be a \\(B, 9, T\\) tensor"),
    ],
)  # fmt: skip
def test_bad_input_raises_value_error(tiny_models, codes, lengths, message):
    model = tiny_models["44khz"]
    good = random_codes(model.config, 2, 4, seed=8)
    with pytest.raises(ValueError, match=message):
        model.detokenize(codes(good), lengths)


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="decoder_rates must be non-empty, each >= 2"):
        DACConfig.from_dict({**PRESETS["tiny"], "decoder_rates": [8, 1]})
    with pytest.raises(ValueError, match="'n_codebooks' must be an integer"):
        DACConfig.from_dict({"n_codebooks": "9"})
    with pytest.raises(ValueError, match="one per codebook"):
        DACConfig.from_dict({"codebook_dim": [8, 8]})
    per_book = DACConfig.from_dict({**PRESETS["tiny"], "n_codebooks": 2, "codebook_dim": [8, 4]})
    assert DACDecoder(per_book).quantizer.quantizers[1].codebook.weight.shape == (1024, 4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_stays_close_and_batches_exactly(tiny_models, dtype):
    ref = tiny_models["24khz"]
    model = DACDecoder.from_config("tiny-24khz", seed=0, dtype=dtype)
    assert model.dtype == getattr(torch, dtype)
    assert model.quantizer.quantizers[0].out_proj.weight.dtype == torch.float32
    assert model.decoder.model[-2].weight.dtype == torch.float32
    codes = random_codes(model.config, 3, 6, seed=9)
    audio = model.detokenize(codes, [6, 4, 2])
    assert audio.dtype == torch.float32
    snr = snr_db(audio, ref.detokenize(codes, [6, 4, 2]))
    assert 15 < snr < 80, snr  # it really ran in reduced precision, and not far off
    check_batched_equals_lone(model, 6, [6, 4, 2], seed=9, tol=1e-2)  # batched vs lone, in 16 bits


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_full_size_matches_descript_audio_codec_and_batches_exactly(variant):
    model = DACDecoder.from_config(f"dac-{variant}", seed=0)
    check_against_upstream(model, frames=3, seed=10)
    worst = check_batched_equals_lone(model, 4, [4, 1, 3], seed=11)
    assert math.isfinite(worst)


@pytest.mark.slow
def test_full_size_bfloat16_rows_stay_at_bfloat16_noise():
    """oneDNN's bfloat16 kernels may round differently per batch size: rows move by bfloat16
    noise against their lone decode, nothing like the padding's leak."""
    model = DACDecoder.from_config("dac-44khz", seed=0, dtype="bfloat16")
    codes = random_codes(model.config, 2, 3, seed=12)
    audio = model.detokenize(codes, [3, 2])
    alone = model.detokenize(codes[1:, :, :2])[0]
    assert snr_db(audio[1, : len(alone)], alone) > 20



# --- on a GPU (benchmarks/device_check.sh) -----------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def batched_vs_lone(model: DACDecoder, codes: torch.Tensor, lengths: list[int]) -> tuple[float, float]:
    """(max |Δ|, SNR dB) of every row of a padded batch against its lone decode, rows joined."""
    audio = model.detokenize(codes, lengths)
    rows, lone = [], []
    for i, n in enumerate(lengths):
        lone.append(model.detokenize(codes[i : i + 1, :, :n])[0])
        rows.append(audio[i, : len(lone[-1])])
    rows_cat, lone_cat = torch.cat(rows), torch.cat(lone)
    return (rows_cat - lone_cat).abs().max().item(), snr_db(rows_cat, lone_cat)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_full_size_float32_batched_rows_equal_their_lone_decode(exact_math, variant, record_property):
    model = DACDecoder.from_config(f"dac-{variant}", seed=0).to("cuda")
    codes = random_codes(model.config, 6, 50, seed=13).cuda()
    worst, _ = batched_vs_lone(model, codes, [50, 7, 31, 1, 44, 19])
    record_property(f"dac_{variant}_cuda_float32_batched_vs_lone_max_abs", worst)
    assert worst <= TOL
    want = upstream_decode(upstream_twin(model.cpu()), codes[:2, :, :12].cpu())
    ours = model.cuda().detokenize(codes[:2, :, :12]).cpu()[:, : want.shape[1]]
    record_property(f"dac_{variant}_cuda_vs_upstream_cpu_max_abs", (ours - want).abs().max().item())
    assert (ours - want).abs().max() <= 1e-4  # two devices' float32 rounding, not a mismatch


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_reduced_precision_against_float32(exact_math, dtype, record_property):
    ref = DACDecoder.from_config("dac-44khz", seed=0).to("cuda")
    model = DACDecoder.from_config("dac-44khz", seed=0, dtype=dtype).to("cuda")
    codes = random_codes(model.config, 4, 86, seed=14).cuda()
    lengths = [86, 40, 63, 9]
    snr = snr_db(model.detokenize(codes, lengths), ref.detokenize(codes, lengths))
    worst, lone_snr = batched_vs_lone(model, codes, lengths)
    record_property(f"dac_cuda_snr_db_{dtype}", round(snr, 2))
    record_property(f"dac_cuda_batched_vs_lone_snr_db_{dtype}", round(lone_snr, 2))
    assert snr >= {"bfloat16": 20.0, "float16": 35.0}[dtype], snr
    assert lone_snr >= {"bfloat16": 20.0, "float16": 35.0}[dtype], lone_snr
