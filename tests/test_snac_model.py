"""Tests of bicodec_shm.model.snac: the reference check against the ``snac`` package, exact
mixed-length batching, deterministic noise, the checkpoint format, input checks.

The single-item, unpadded decode is the ground truth for every batching test; ``snac.SNAC`` with
the same weights and the same noise is the ground truth for the decoder itself.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from support import JIT_DEPRECATED, without_jit_deprecation

from bicodec_shm.errors import CheckpointError
from bicodec_shm.model import weights as shared
from bicodec_shm.model.snac import DEFAULT_NOISE_SEED, SNACConfig, SNACDecoder
from bicodec_shm.model.snac.config import PRESETS
from bicodec_shm.model.snac.noise import NOISE_CHUNK, batch_noise, row_noise

# The reference implementation, in the test extra: a missing one fails loudly. snac 1.2.1 wraps
# its Snake in torch.jit.script, which warns since torch 2.10 (and warnings are errors here): a
# DeprecationWarning up to torch 2.13, a FutureWarning from 2.14 on (support.py).
with without_jit_deprecation():
    import snac


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
def test_snac_s_jit_deprecation_is_silenced_whichever_category_torch_gives_it(category):
    """torch 2.10-2.13 warn with DeprecationWarning, 2.14 with FutureWarning: a filter of one
    category interrupts collecting this file on the other (warnings are errors here)."""
    with without_jit_deprecation():
        warnings.warn(f"{JIT_DEPRECATED}. Please switch to `torch.compile` or `torch.export`.", category,
                      stacklevel=1)  # fmt: skip


VARIANTS = ("24khz", "32khz", "44khz")
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, SNACDecoder]:
    return {v: SNACDecoder.from_config(f"tiny-{v}", seed=0) for v in VARIANTS}


def random_codes(cfg: SNACConfig, batch: int, frames: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.codebook_size, (batch, frames * r), generator=gen) for r in cfg.level_rates]


def row(codes: list[torch.Tensor], cfg: SNACConfig, i: int, frames: int) -> list[torch.Tensor]:
    return [c[i : i + 1, : frames * r] for c, r in zip(codes, cfg.level_rates)]


def upstream_twin(model: SNACDecoder) -> torch.nn.Module:
    """``snac.SNAC(**config)`` holding ``model``'s weights (weight norm as parametrizations)."""
    twin = snac.SNAC(**model.config.to_dict()).eval()
    state = shared.convert_state_dict(
        model.state_dict(), shared.weight_norm_prefixes(model), "parametrizations"
    )
    result = twin.load_state_dict(state, strict=False)
    assert result.unexpected_keys == []
    # What snac has and the decoder does not: the encoder, the quantizers' in_proj, and the
    # rotary inv_freq buffer, which both compute from the head width.
    decode_path = [k for k in result.missing_keys if not k.startswith("encoder.")
                   and ".in_proj." not in k and not k.endswith("rel_pos.inv_freq")]  # fmt: skip
    assert decode_path == []
    return twin


@contextmanager
def injected_randn(noise: list[torch.Tensor]):
    """Make snac's NoiseBlocks draw ``noise`` (in order) instead of torch.randn."""
    queue = iter(noise)

    def randn(shape, device=None, dtype=None):
        n = next(queue)
        assert tuple(n.shape) == tuple(shape), (tuple(n.shape), tuple(shape))
        return n.to(device=device, dtype=dtype)

    with mock.patch.object(snac.layers.torch, "randn", randn):
        yield
    assert next(queue, None) is None, "snac drew less noise than the decoder has blocks"


def upstream_decode(
    model: SNACDecoder, twin: torch.nn.Module, codes: list[torch.Tensor], seeds: list[int] | None
) -> torch.Tensor:
    """``twin``'s decode of an unpadded batch, with ``model``'s noise for ``seeds`` (None: zeros)."""
    cfg = model.config
    batch, latent = codes[0].shape[0], codes[0].shape[1] * cfg.latents_per_frame
    if seeds is None:
        noise = [torch.zeros(batch, 1, latent * f) for f in model.noise_factors]
    else:
        noise = batch_noise(seeds, [latent] * batch, [0] * batch, latent, model.noise_factors)
    with torch.inference_mode(), injected_randn(noise):
        return twin.decode(codes)[:, 0]


def check_against_upstream(model: SNACDecoder, frames: int, seed: int) -> None:
    cfg = model.config
    codes = random_codes(cfg, 2, frames, seed)
    seeds = [DEFAULT_NOISE_SEED, 1234]
    ours = model.detokenize(codes, noise_seeds=seeds)
    assert ours.shape == (2, frames * cfg.samples_per_frame)
    assert ours.pow(2).mean().sqrt() > 0.05, "random audio is near silent: the check would be weak"
    twin = upstream_twin(model)
    assert (ours - upstream_decode(model, twin, codes, seeds)).abs().max() <= TOL
    quiet = model.detokenize(codes, noise=False)
    assert (quiet - upstream_decode(model, twin, codes, None)).abs().max() <= TOL
    assert (quiet - ours).abs().max() > 1e-2, "the noise changes nothing: the check would be weak"


def check_batched_equals_lone(
    model: SNACDecoder, frames: int, lengths: list[int], seed: int, noises: tuple[bool, ...] = (True, False)
) -> None:
    cfg = model.config
    codes = random_codes(cfg, len(lengths), frames, seed)
    seeds = list(range(100, 100 + len(lengths)))
    for noise in noises:
        audio = model.detokenize(codes, lengths, noise=noise, noise_seeds=seeds)
        for i, n in enumerate(lengths):
            alone = model.detokenize(row(codes, cfg, i, n), noise=noise, noise_seeds=seeds[i])[0]
            end = n * cfg.samples_per_frame
            assert (audio[i, :end] - alone).abs().max() <= TOL, (i, n, noise)
            assert not audio[i, end:].any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_matches_snac_with_the_same_noise_and_without(tiny_models, variant):
    # 8 frames: two 32-frame attention windows at 32/44 kHz (snac needs whole windows).
    check_against_upstream(tiny_models[variant], frames=8, seed=1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_batched_rows_equal_their_lone_decodes(tiny_models, variant):
    # At 32/44 kHz a frame is 8 latent frames: lengths 5 and 2 end inside an attention window,
    # so a window holds a row's last frames and padding; with 9 frames the batch has 3 windows.
    check_batched_equals_lone(tiny_models[variant], 9, [9, 5, 2, 8], seed=2)


def test_equal_lengths_off_the_window_grid_batch(tiny_models):
    """5 frames = 40 latent frames, 2 attention windows, the second one short; no lengths."""
    model = tiny_models["44khz"]
    cfg = model.config
    codes = random_codes(cfg, 2, 5, seed=14)
    audio = model.detokenize(codes)
    for i in range(2):
        assert (audio[i] - model.detokenize(row(codes, cfg, i, 5))[0]).abs().max() <= TOL


def test_padding_content_does_not_matter(tiny_models):
    model = tiny_models["32khz"]
    cfg = model.config
    codes = random_codes(cfg, 2, 8, seed=3)
    other = [c.clone() for c in codes]
    for c, r in zip(other, cfg.level_rates):
        c[1, 3 * r :] = torch.randint(0, 4096, (c.shape[1] - 3 * r,))
    a = model.detokenize(codes, [8, 3])
    b = model.detokenize(other, [8, 3])
    assert torch.equal(a[1], b[1])


def test_lone_decode_off_the_window_grid_is_the_windows_prefix(tiny_models):
    """A lone row of 5 frames (40 latent frames) attends within windows [0, 32) and [32, 40): the
    first 32 latent frames' attention is that of any longer row with the same codes, so the
    audio differs from the 8-frame decode only near the end (convolutions reach a few frames)."""
    model = tiny_models["32khz"]
    cfg = model.config
    codes = random_codes(cfg, 1, 8, seed=4)
    long = model.detokenize(codes, noise=False)[0]
    short = model.detokenize(row(codes, cfg, 0, 5), noise=False)[0]
    assert short.shape == (5 * cfg.samples_per_frame,)
    assert (short[: 2 * cfg.samples_per_frame] - long[: 2 * cfg.samples_per_frame]).abs().max() <= TOL
    assert (short - long[: len(short)]).abs().max() > 1e-3


def test_noise_is_a_function_of_the_seed(tiny_models):
    model = tiny_models["24khz"]
    codes = random_codes(model.config, 1, 4, seed=5)
    a = model.detokenize(codes)
    assert torch.equal(a, model.detokenize(codes, noise_seeds=DEFAULT_NOISE_SEED))
    assert torch.equal(a, model.detokenize(codes))  # reproducible, call after call
    assert (a - model.detokenize(codes, noise_seeds=[1])).abs().max() > 1e-2


def test_noise_of_a_window_is_the_full_decodes_noise():
    assert NOISE_CHUNK > 100
    full = row_noise(7, 2, 0, 3 * NOISE_CHUNK)
    window = row_noise(7, 2, NOISE_CHUNK - 50, NOISE_CHUNK + 100)  # crosses two chunk edges
    assert np.array_equal(window, full[NOISE_CHUNK - 50 : 2 * NOISE_CHUNK + 50])
    assert not np.array_equal(row_noise(7, 3, 0, 100), full[:100])
    assert not np.array_equal(row_noise(8, 2, 0, 100), full[:100])
    assert 0.9 < full.std() < 1.1


def test_start_frames_shift_the_noise(tiny_models):
    """A window starting at frame 2 gets the noise the full decode has at frame 2: its noise
    inputs are the full decode's noise tensors, sliced."""
    model = tiny_models["24khz"]
    per = model.config.latents_per_frame
    full = batch_noise([3], [6 * per], [0], 6 * per, model.noise_factors)
    part = batch_noise([3], [3 * per], [2 * per], 3 * per, model.noise_factors)
    for f, a, b in zip(model.noise_factors, full, part):
        assert torch.equal(b[0, 0], a[0, 0, 2 * per * f : 5 * per * f])


def test_noise_false_on_a_config_without_noise_blocks():
    cfg = {**PRESETS["tiny-24khz"], "noise": False}
    model = SNACDecoder.from_config(cfg, seed=0)
    assert not any("NoiseBlock" in type(m).__name__ for m in model.modules())
    codes = random_codes(model.config, 1, 4, seed=6)
    assert torch.equal(model.detokenize(codes), model.detokenize(codes, noise=False))
    check_against_upstream_quiet = upstream_twin(model)
    with torch.inference_mode():
        want = check_against_upstream_quiet.decode(codes)[:, 0]
    assert (model.detokenize(codes) - want).abs().max() <= TOL


def test_loads_the_published_checkpoint_layout(tmp_path, tiny_models):
    """config.json + pytorch_model.bin as snac.SNAC saves them (hubertsiuzdak/snac_24khz)."""
    model = tiny_models["32khz"]
    twin = upstream_twin(model)
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    torch.save(twin.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = SNACDecoder.from_pretrained(tmp_path)
    assert loaded.config == model.config
    codes = random_codes(model.config, 1, 4, seed=7)
    assert (loaded.detokenize(codes) - model.detokenize(codes)).abs().max() <= TOL
    # What snac.SNAC.from_pretrained does with a local folder (it imports huggingface_hub first).
    snac.SNAC.from_config(str(tmp_path / "config.json")).load_state_dict(
        torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    )


def test_loads_weight_g_weight_v_and_round_trips(tmp_path, tiny_models):
    model = tiny_models["24khz"]
    state = shared.convert_state_dict(model.state_dict(), shared.weight_norm_prefixes(model), "weight_norm")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    torch.save(state, tmp_path / "pytorch_model.bin")
    codes = random_codes(model.config, 1, 3, seed=8)
    want = model.detokenize(codes)
    assert (SNACDecoder.from_pretrained(tmp_path / "config.json").detokenize(codes) - want).abs().max() <= TOL
    saved = tmp_path / "saved"
    assert model.save_pretrained(saved) > 0
    assert (SNACDecoder.from_pretrained(saved).detokenize(codes) - want).abs().max() <= TOL


def test_checkpoint_errors_name_the_problem(tmp_path, tiny_models):
    with pytest.raises(CheckpointError, match="missing .*config.json and .*pytorch_model.bin"):
        SNACDecoder.from_pretrained(tmp_path)
    model = tiny_models["24khz"]
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    state = dict(model.state_dict())
    del state["decoder.model.0.weight"]
    state["quantizer.quantizers.1.codebook.weight"] = torch.zeros(3, 8)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"(?s)missing: decoder.model.0.weight_g.*"
                                              r"wrong: quantizer.quantizers.1.codebook.weight"):  # fmt: skip
        SNACDecoder.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"vq_strides": [3, 2]}')
    with pytest.raises(CheckpointError, match="vq_strides"):
        SNACDecoder.from_pretrained(tmp_path)


def test_presets_have_snacs_parameter_counts_and_layouts():
    counts = {"snac-24khz": 19.8e6, "snac-32khz": 54.5e6, "snac-44khz": 54.5e6}  # snac's README
    for name, expected in counts.items():
        cfg = SNACConfig.preset(name)
        with torch.device("meta"):
            n = sum(p.numel() for p in snac.SNAC(**cfg.to_dict()).parameters())
        assert abs(n - expected) < 0.05e6, (name, n)  # the README rounds to 0.1 M
        assert cfg.layout.name == name
        assert SNACConfig.preset(name.replace("snac", "tiny")).layout == cfg.layout
    assert SNACConfig.preset("snac-24khz").layout.samples_per_frame == 2048
    with pytest.raises(ValueError, match="unknown preset 'big'"):
        SNACConfig.preset("big")
    assert SNACConfig.from_dict(SNACConfig.preset("snac-32khz").to_dict()) == SNACConfig.preset("snac-32khz")


@pytest.mark.parametrize(
    ("codes", "lengths", "message"),
    [
        (lambda c: c[:2], None, r"snac-24khz takes 3 code levels at rates 1:2:4, got 2"),
        (lambda c: [c[0], c[1][:, :-1], c[2]], None, r"codes\[1\] must have shape \(B, 2·T\) = \(2, 8\)"),
        (lambda c: [c[0], c[1], c[2].float()], None, "integer dtype"),
        (lambda c: [c[0], c[1], c[2] + 4096], None, r"codes\[2\]\[0, 0\] = \d+ is out of range \[0, 4096\)"),
        (lambda c: c, [4, 0], r"lengths\[1\] = 0 is outside \[1, T\] = \[1, 4\]"),
        (lambda c: c, [4], r"lengths must have shape \(B,\) = \(2,\)"),
        (lambda c: c[0], None, "codes must be a list of 3"),
    ],
)  # fmt: skip
def test_bad_input_raises_value_error(tiny_models, codes, lengths, message):
    model = tiny_models["24khz"]
    good = random_codes(model.config, 2, 4, seed=9)
    with pytest.raises(ValueError, match=message):
        model.detokenize(codes(good), lengths)


def test_bad_seeds_raise_value_error(tiny_models):
    model = tiny_models["24khz"]
    codes = random_codes(model.config, 2, 2, seed=10)
    with pytest.raises(ValueError, match="one seed per row"):
        model.detokenize(codes, noise_seeds=[1])
    with pytest.raises(ValueError, match=r"noise_seeds\[1\] = -1"):
        model.detokenize(codes, noise_seeds=[1, -1])
    with pytest.raises(ValueError, match="start_frames"):
        model.detokenize(codes, start_frames=[0, -2])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_stays_close_and_batches_exactly(dtype):
    ref = SNACDecoder.from_config("tiny-32khz", seed=0)
    model = SNACDecoder.from_config("tiny-32khz", seed=0, dtype=dtype)
    assert model.dtype == getattr(torch, dtype)
    codes = random_codes(model.config, 3, 5, seed=11)
    audio = model.detokenize(codes, [5, 4, 2])
    assert audio.dtype == torch.float32
    want = ref.detokenize(codes, [5, 4, 2])
    signal, error = want.pow(2).sum(), (audio - want).pow(2).sum()
    assert 10 * torch.log10(signal / error) > 15  # dB
    alone = model.detokenize(row(codes, model.config, 2, 2))[0]
    assert (audio[2, : len(alone)] - alone).abs().max() <= 1e-2  # batched vs lone, in 16 bits


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_full_size_matches_snac_and_batches_exactly(variant):
    model = SNACDecoder.from_config(f"snac-{variant}", seed=0)
    # 4 frames: one 32-frame attention window at 32/44 kHz, the shortest snac can decode.
    check_against_upstream(model, frames=4, seed=12)
    # 5 frames = 40 latent frames at 32/44 kHz: the 3-frame row ends inside the second window.
    # (Masking does not depend on the noise; the tiny tests cover noise=False.)
    check_batched_equals_lone(model, 5, [5, 3, 1], seed=13, noises=(True,))
