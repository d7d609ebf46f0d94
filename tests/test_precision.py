"""Tests of the precision option: dtype handling, what stays float32, and the audio it gives.

Ground truth is the float32 decode of the same weights (SNR) and, for batching, the lone
unpadded decode in the same dtype. Tests marked ``gpu`` run only where CUDA is available (the
device check, ``benchmarks/device_check.sh``); they record what they measure as junit
properties.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bicodec_shm.model import BiCodecDecoder
from bicodec_shm.model.devices import exact_cuda_math, uses_exact_cuda_math
from bicodec_shm.model.modules import AdaLayerNorm, Snake1d
from bicodec_shm.model.precision import DTYPES, apply_dtype, resolve_dtype, snr_db
from bicodec_shm.tools.cli import _parser
from bicodec_shm.tools.model_args import load_decoder

HOP = 320
# Measured on CPU (torch 2.13), tiny model, T = 40-50, B = 2: bfloat16 29.5-29.7 dB, float16
# 47.4-47.8 dB. Rounding only the weights to bfloat16 (computing in float32) already gives 34 dB:
# with 8-bit mantissas, ~60 rounded layers add up. The bounds leave ~6 dB of margin for other
# CPUs and torch versions; a broken cast (a norm or Snake in bfloat16, a wrong mask) costs far
# more than that.
MIN_SNR_DB = {"bfloat16": 20.0, "float16": 35.0}
HALF_DTYPES = ("bfloat16", "float16")


@pytest.fixture(scope="module")
def tiny32() -> BiCodecDecoder:
    return BiCodecDecoder.from_config("tiny", seed=0)


@pytest.fixture(scope="module", params=HALF_DTYPES)
def tiny_half(request) -> BiCodecDecoder:
    return BiCodecDecoder.from_config("tiny", seed=0, dtype=request.param)


def random_batch(batch: int, frames: int, seed: int):
    """(B, T) semantic, (B, 32) global ids and (B,) lengths; row 0 has the full length."""
    gen = torch.Generator().manual_seed(seed)
    semantic = torch.randint(0, 8192, (batch, frames), generator=gen)
    glob = torch.randint(0, 4096, (batch, 32), generator=gen)
    lengths = torch.randint(1, frames + 1, (batch,), generator=gen)
    lengths[0] = frames
    return semantic, glob, lengths


def batched_vs_lone(model: BiCodecDecoder, semantic, glob, lengths) -> tuple[float, float]:
    """(max |Δ|, SNR in dB) of each batched row against its lone unpadded decode, all rows."""
    batched = model.detokenize(semantic, glob, lengths)
    rows, lone = [], []
    for i, n in enumerate(lengths.tolist()):
        rows.append(batched[i, : HOP * n])
        lone.append(model.detokenize(semantic[i : i + 1, :n], glob[i : i + 1])[0])
        assert torch.all(batched[i, HOP * n :] == 0)
    rows_cat, lone_cat = torch.cat(rows), torch.cat(lone)
    return (rows_cat - lone_cat).abs().max().item(), snr_db(rows_cat, lone_cat)


# --- dtype handling ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, torch.float32),
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_resolve_dtype_accepts_names_and_torch_dtypes(given, expected) -> None:
    assert resolve_dtype(given) is expected


@pytest.mark.parametrize("bad", ["fp16", "half", "int8", torch.float64, torch.int32, 16])
def test_bad_dtype_is_a_value_error_naming_the_allowed_values(bad) -> None:
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        BiCodecDecoder.from_config("tiny", seed=0, dtype=bad)


def test_cli_dtype_choices_are_the_models(capsys) -> None:
    assert _parser().parse_args(["serve"]).dtype == "float32"
    for name in DTYPES:
        assert _parser().parse_args(["serve", "--dtype", name]).dtype == name
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--dtype", "float64"])
    assert "choose from 'float32', 'bfloat16', 'float16'" in capsys.readouterr().err


def test_load_decoder_builds_the_requested_dtype() -> None:
    args = _parser().parse_args(["serve", "--preset", "tiny", "--dtype", "bfloat16"])
    decoder = load_decoder(args, announce=False)
    assert isinstance(decoder, BiCodecDecoder)
    assert decoder.dtype == torch.bfloat16


# --- float32 stays as it was ------------------------------------------------------------------


def test_float32_is_the_default_and_changes_nothing(tiny32: BiCodecDecoder) -> None:
    semantic, glob, lengths = random_batch(3, 21, seed=2)
    reference = tiny32.detokenize(semantic, glob, lengths)
    for dtype in ("float32", torch.float32):
        again = BiCodecDecoder.from_config("tiny", seed=0, dtype=dtype)
        assert torch.equal(again.detokenize(semantic, glob, lengths), reference)
    assert all(p.dtype == torch.float32 for p in tiny32.parameters())
    assert tiny32.dtype == torch.float32


def test_apply_dtype_float32_keeps_every_tensor(tiny32: BiCodecDecoder) -> None:
    model = BiCodecDecoder.from_config("tiny", seed=0)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    apply_dtype(model, torch.float32)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before


# --- what stays float32 -----------------------------------------------------------------------


def test_reduced_precision_keeps_norms_snake_and_dequantisers_float32(tiny_half) -> None:
    dtype = tiny_half.dtype
    assert dtype in (torch.bfloat16, torch.float16)
    kept, cast = 0, 0
    for name, module in tiny_half.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        float32 = (
            isinstance(module, (Snake1d, nn.LayerNorm))
            or any(isinstance(parent, AdaLayerNorm) for parent in _parents(tiny_half, name))
            or name.startswith(("quantizer", "speaker_encoder"))
            or module is tiny_half.decoder.model[-2]
        )
        want = torch.float32 if float32 else dtype
        assert all(p.dtype == want for p in own), (name, [p.dtype for p in own])
        kept += float32
        cast += not float32
    assert kept > 10 and cast > 10
    # The work is in the reduced dtype: every conv and linear but the output conv and the
    # de-quantisers, norms excluded.
    big = [m for m in tiny_half.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    assert sum(m.weight.dtype == dtype for m in big) == len(big) - 2  # out_project, conv_out


def _parents(model: nn.Module, name: str):
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield model.get_submodule(".".join(parts[:i]))


def test_layer_norm_statistics_run_in_float32() -> None:
    """A bfloat16 input whose mean dwarfs its spread: float32 statistics keep the spread."""
    norm = BiCodecDecoder.from_config("tiny", seed=0, dtype="bfloat16").prenet.vocos_backbone.final_layer_norm
    dim = norm.normalized_shape[0]
    x = (100 + torch.linspace(-0.5, 0.5, dim)).to(torch.bfloat16)[None, None, :].expand(1, 3, dim)
    got = norm(x).float()
    ref = torch.nn.functional.layer_norm(x.float(), (dim,), norm.weight, norm.bias, 1e-6)
    assert got.dtype == torch.float32 and norm(x).dtype == torch.bfloat16
    assert (got - ref).abs().max() < 0.05  # bfloat16 rounding of the result only


# --- audio ------------------------------------------------------------------------------------


def test_reduced_precision_output_is_float32(tiny_half) -> None:
    semantic, glob, lengths = random_batch(2, 9, seed=3)
    audio = tiny_half.detokenize(semantic, glob, lengths)
    assert audio.dtype == torch.float32
    assert audio.shape == (2, HOP * 9)
    assert torch.isfinite(audio).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_reduced_precision_snr_against_float32(tiny32, tiny_half, seed: int, record_property) -> None:
    name = str(tiny_half.dtype).removeprefix("torch.")
    semantic, glob, lengths = random_batch(2, 40 + 10 * seed, seed=seed)
    reference = tiny32.detokenize(semantic, glob, lengths)
    audio = tiny_half.detokenize(semantic, glob, lengths)
    snr = snr_db(audio, reference)
    record_property(f"snr_db_{name}", round(snr, 2))
    assert snr >= MIN_SNR_DB[name], f"{name}: {snr:.1f} dB"
    assert snr < 80  # it really ran in reduced precision


@pytest.mark.parametrize("seed", [0, 1])
def test_reduced_precision_batched_rows_equal_their_lone_decode(
    tiny_half, seed: int, record_property
) -> None:
    """Masking still isolates rows: measured on CPU, bfloat16 rows differ from their lone decode
    by 9e-8 (150 dB) and float16 rows by 1.4e-3-1.7e-3 (58-59 dB), below each dtype's own error
    against float32; without the mask short rows move by ~0.3."""
    name = str(tiny_half.dtype).removeprefix("torch.")
    worst, snr = batched_vs_lone(tiny_half, *random_batch(5, 37, seed=seed))
    record_property(f"batched_vs_lone_max_abs_{name}", worst)
    assert snr >= MIN_SNR_DB[name] + 15, f"{name}: max |Δ| {worst:.2e}, {snr:.1f} dB"
    assert worst <= 1e-2


@pytest.mark.slow
def test_full_size_bfloat16_batched_rows_stay_at_bfloat16_noise() -> None:
    """At full size on CPU, oneDNN's bfloat16 kernels round differently per batch size, so rows
    differ from their lone decode by bfloat16 noise, spread evenly over each row: measured here
    38.4 dB (max |Δ| 0.012); with mask=False the padding leaks into the short row and it falls
    to 7.5 dB. Two rows, one padded: a CPU bfloat16 decode at full size costs ~0.7 s a token."""
    model = BiCodecDecoder.from_config("spark-tts-0.5b", seed=0, dtype="bfloat16")
    semantic, glob, _ = random_batch(2, 12, seed=7)
    lengths = torch.tensor([12, 7])
    worst, snr = batched_vs_lone(model, semantic, glob, lengths)
    assert snr >= MIN_SNR_DB["bfloat16"], f"max |Δ| {worst:.2e}, {snr:.1f} dB"


def test_snr_db() -> None:
    ref = torch.tensor([1.0, -1.0, 1.0, -1.0])
    assert snr_db(ref, ref) == float("inf")
    assert snr_db(ref * 1.1, ref) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="shapes differ"):
        snr_db(ref, ref[:2])


def test_from_pretrained_takes_a_dtype(tiny32: BiCodecDecoder, tmp_path) -> None:
    tiny32.save_pretrained(tmp_path)
    loaded32 = BiCodecDecoder.from_pretrained(tmp_path)
    loaded16 = BiCodecDecoder.from_pretrained(tmp_path, dtype="bfloat16")
    assert loaded32.dtype == torch.float32 and loaded16.dtype == torch.bfloat16
    assert loaded16.decoder.model[0].weight.dtype == torch.bfloat16
    assert loaded16.decoder.model[1].block[0].alpha.dtype == torch.float32
    semantic, glob, lengths = random_batch(2, 30, seed=4)
    reference = loaded32.detokenize(semantic, glob, lengths)
    assert snr_db(loaded16.detokenize(semantic, glob, lengths), reference) >= MIN_SNR_DB["bfloat16"]
    with pytest.raises(ValueError, match="bfloat16"):
        BiCodecDecoder.from_pretrained(tmp_path, dtype="float64")


# --- on a GPU (benchmarks/device_check.sh) -----------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


FLAGS = ("cudnn.allow_tf32", "cuda.matmul.allow_tf32", "cudnn.deterministic", "cudnn.benchmark")


def _flag(name: str):
    module, attr = name.rsplit(".", 1)
    owner = torch.backends
    for part in module.split("."):
        owner = getattr(owner, part)
    return owner, attr


@pytest.fixture
def no_tf32():
    """The server's CUDA math (exact_cuda_math: no TF32, deterministic cuDNN): float32 must be
    exact under batching, and a shape must decode to the same bits every time."""
    saved = {name: getattr(*_flag(name)) for name in FLAGS}
    exact_cuda_math()
    yield
    for name, value in saved.items():
        setattr(*_flag(name), value)


@pytest.fixture(scope="module")
def full_cuda() -> dict[str, BiCodecDecoder]:
    return {
        name: BiCodecDecoder.from_config("spark-tts-0.5b", seed=0, dtype=name).to("cuda")
        for name in DTYPES
    }


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("preset", ["tiny", "spark-tts-0.5b"])
def test_cuda_float32_batched_rows_equal_their_lone_decode(no_tf32, preset: str, record_property) -> None:
    model = BiCodecDecoder.from_config(preset, seed=0).to("cuda")
    semantic, glob, lengths = random_batch(6, 50, seed=5)
    worst, _ = batched_vs_lone(model, semantic.cuda(), glob.cuda(), lengths.cuda())
    record_property(f"cuda_float32_batched_vs_lone_max_abs_{preset}", worst)
    assert worst <= 1e-5


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_cuda_reduced_precision_against_float32(no_tf32, full_cuda, name: str, record_property) -> None:
    semantic, glob, lengths = (t.cuda() for t in random_batch(4, 100, seed=6))
    reference = full_cuda["float32"].detokenize(semantic, glob, lengths)
    audio = full_cuda[name].detokenize(semantic, glob, lengths)
    assert audio.dtype == torch.float32
    snr = snr_db(audio, reference)
    worst, lone_snr = batched_vs_lone(full_cuda[name], semantic, glob, lengths)
    record_property(f"cuda_snr_db_{name}", round(snr, 2))
    record_property(f"cuda_batched_vs_lone_max_abs_{name}", worst)
    record_property(f"cuda_batched_vs_lone_snr_db_{name}", round(lone_snr, 2))
    assert snr >= MIN_SNR_DB[name], f"{name}: {snr:.1f} dB against float32"
    # Batching may pick other kernels, so rows move by this dtype's rounding, not more.
    assert lone_snr >= MIN_SNR_DB[name], f"{name}: batched vs lone {lone_snr:.1f} dB"


def test_exact_cuda_math_turns_tf32_off_and_cudnn_deterministic(no_tf32) -> None:
    """The flags every CUDA decode here runs with (server, graphs, every bench system); they
    are process-wide and settable on a CPU-only torch, where they do nothing."""
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.deterministic = False
    assert not uses_exact_cuda_math()
    exact_cuda_math()
    assert uses_exact_cuda_math()
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


# --- int16 LSBs between a batched row and its lone decode, per dtype ---------------------------


def lsb_spread(dtype: str) -> tuple[dict[str, int], dict[str, int]]:
    """Worst int16 differences (in LSB) on the tiny model of each codec family, 5 rows of 24, 17,
    9, 3 and 20 frames, seeds 0-2: (a row of a padded batch against its lone decode, that lone
    decode against the float32 model's lone decode of the same ids)."""
    import numpy as np
    from support import seed_int16

    from bicodec_shm.model.dac import DACDecoder
    from bicodec_shm.model.snac import SNACDecoder

    def pcm(audio: torch.Tensor):
        return seed_int16(audio.numpy()).astype(np.int32)

    def lsb(a: torch.Tensor, b: torch.Tensor) -> int:
        return int(np.abs(pcm(a) - pcm(b)).max())

    lengths = [24, 17, 9, 3, 20]
    builders = {
        "bicodec": lambda dt: BiCodecDecoder.from_config("tiny", seed=0, dtype=dt),
        "snac-24khz": lambda dt: SNACDecoder.from_config("tiny-24khz", seed=0, dtype=dt),
        "dac-24khz": lambda dt: DACDecoder.from_config("tiny-24khz", seed=0, dtype=dt),
    }
    batching, rounding = dict.fromkeys(builders, 0), dict.fromkeys(builders, 0)
    for name, build in builders.items():
        model, exact = build(dtype), build("float32")
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            if name == "bicodec":
                semantic, glob, _ = random_batch(len(lengths), max(lengths), seed)
                batched = model.detokenize(semantic, glob, torch.tensor(lengths))
                rows = [(semantic[i : i + 1, :n], glob[i : i + 1]) for i, n in enumerate(lengths)]
            elif name == "snac-24khz":
                rates = model.config.layout.level_rates
                codes = [torch.randint(0, 4096, (len(lengths), max(lengths) * r), generator=gen)
                         for r in rates]  # fmt: skip
                batched = model.detokenize(codes, torch.tensor(lengths))
                rows = [([c[i : i + 1, : n * r] for c, r in zip(codes, rates)],)
                        for i, n in enumerate(lengths)]  # fmt: skip
            else:
                shape = (len(lengths), model.config.n_codebooks, max(lengths))
                codes = torch.randint(0, 1024, shape, generator=gen)
                batched = model.detokenize(codes, torch.tensor(lengths))
                rows = [(codes[i : i + 1, :, :n],) for i, n in enumerate(lengths)]
            for row, args in zip(batched, rows, strict=True):
                alone = model.detokenize(*args)[0]
                batching[name] = max(batching[name], lsb(row[: len(alone)], alone))
                rounding[name] = max(rounding[name], lsb(alone, exact.detokenize(*args)[0]))
    return batching, rounding


def test_float32_tiny_rows_are_within_1_lsb_of_their_lone_decode(record_property) -> None:
    batching, _ = lsb_spread("float32")
    record_property("lsb_spread_float32", batching)
    assert max(batching.values()) <= 1, batching


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_lsb_spread_of_a_batched_row_is_within_its_dtypes_own_rounding(
    dtype: str, record_property
) -> None:
    """In bfloat16 and float16 the CPU's kernels may round by shape (oneDNN's native bfloat16
    kernels, where the CPU has AVX512-BF16 or AMX, and its float16 convolutions), so a batched row
    carries the dtype's rounding, not float32's 1 LSB: docs/exactness.md states the bound as "no
    farther from its lone decode than that decode is from float32", and this checks it, with the
    spreads measured. A mask that let padding in moves short rows by ~0.3 (~10,000 LSB)."""
    batching, rounding = lsb_spread(dtype)
    record_property(f"lsb_spread_{dtype}", batching)
    record_property(f"lsb_from_float32_{dtype}", rounding)
    for name in batching:
        assert batching[name] <= rounding[name], (name, batching, rounding)


def test_bfloat16_rows_are_within_1_lsb_where_the_cpu_computes_it_through_float32(record_property) -> None:
    """Without native bfloat16 kernels oneDNN computes bfloat16 in float32, where batching keeps a
    row within 1 LSB of its lone decode, as docs/exactness.md states."""
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has native bfloat16 kernels (AVX512-BF16 or AMX)")
    batching, _ = lsb_spread("bfloat16")
    record_property("lsb_spread_bfloat16", batching)
    assert max(batching.values()) <= 1, batching


def test_exactness_md_states_the_lsb_bounds_this_file_checks() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "exactness.md").read_text()
    flat = " ".join(text.split())
    assert "no farther from its lone decode than that decode is from float32" in flat
    assert "python -m pytest tests/test_precision.py -k lsb" in flat
