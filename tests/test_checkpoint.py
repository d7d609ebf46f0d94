"""Tests of loading and saving BiCodec folders (config.yaml + model.safetensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bicodec_shm.errors import CheckpointError
from bicodec_shm.model import BiCodecDecoder
from bicodec_shm.model.dac.config import PRESETS as DAC_PRESETS
from bicodec_shm.model.weights import FORMS, convert_state_dict, fold_weight_norm, weight_norm_prefixes


@pytest.fixture(scope="module")
def tiny() -> BiCodecDecoder:
    return BiCodecDecoder.from_config("tiny", seed=11)


@pytest.fixture(scope="module")
def tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    semantic = torch.randint(0, 8192, (3, 12), generator=gen)
    glob = torch.randint(0, 4096, (3, 32), generator=gen)
    return semantic, glob, torch.tensor([12, 7, 10])


@pytest.fixture
def saved(tiny: BiCodecDecoder, tmp_path: Path) -> Path:
    folder = tmp_path / "BiCodec"
    tiny.save_pretrained(folder)
    return folder


def rewrite(folder: Path, edit) -> None:
    """Load model.safetensors, let ``edit`` change the dict in place, write it back."""
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def audio(model: BiCodecDecoder, tokens) -> torch.Tensor:
    return model.detokenize(*tokens)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_round_trip_in_every_weight_norm_form(tiny, tokens, tmp_path: Path, form: str) -> None:
    tiny.save_pretrained(tmp_path)
    state = convert_state_dict(tiny.state_dict(), weight_norm_prefixes(tiny), form)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    suffix = {
        "weight_norm": ".weight_g",
        "parametrizations": ".parametrizations.weight.original0",
        "folded": ".weight",
    }[form]
    assert "decoder.model.0" + suffix in keys
    assert "quantizer.out_project" + suffix in keys

    loaded = BiCodecDecoder.from_pretrained(tmp_path)
    assert not loaded.training
    difference = (audio(loaded, tokens) - audio(tiny, tokens)).abs().max().item()
    if form == "folded":
        assert difference == 0.0
    else:  # g = ‖w‖ is rounded to float32, so folding may move a weight by an ulp
        assert difference <= 1e-5
    for name, module in loaded.named_modules():
        assert not hasattr(module, "parametrizations"), name
    assert not any("weight_g" in n or "original" in n for n, _ in loaded.named_parameters())


def test_save_pretrained_writes_spark_tts_layout(tiny, saved: Path) -> None:
    with safe_open(str(saved / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["quantizer.codebook.weight"] == (8192, 8)
    assert shapes["quantizer.out_project.weight_g"] == (64, 1, 1)
    assert shapes["quantizer.out_project.weight_v"] == (64, 8, 1)
    assert shapes["speaker_encoder.quantizer.project_out.weight"] == (16, 6)
    assert shapes["speaker_encoder.project.weight"] == (64, 16 * 32)
    assert shapes["prenet.downsample.1.1.convnext.1.gamma"] == (32,)
    assert shapes["prenet.vocos_backbone.norm.scale.weight"] == (32, 64)
    assert shapes["prenet.vocos_backbone.convnext.1.norm.shift.bias"] == (32,)
    # ConvTranspose1d weight is (in, out, k), so its g is (in, 1, 1).
    assert shapes["decoder.model.1.block.1.weight_g"] == (64, 1, 1)
    assert shapes["decoder.model.1.block.1.weight_v"] == (64, 32, 16)
    assert shapes["decoder.model.4.block.4.block.1.weight_v"] == (4, 4, 7)
    assert shapes["decoder.model.5.alpha"] == (1, 4, 1)
    assert shapes["decoder.model.6.weight_g"] == (1, 1, 1)
    assert not any(
        k.endswith(".weight") and k.replace(".weight", "") in weight_norm_prefixes(tiny) for k in shapes
    )

    doc = yaml.safe_load((saved / "config.yaml").read_text())
    section = doc["audio_tokenizer"]
    assert {"quantizer", "speaker_encoder", "prenet", "decoder"} <= set(section)
    assert section["decoder"] == {
        "input_channel": 64,
        "channels": 64,
        "rates": [8, 5, 4, 2],
        "kernel_sizes": [16, 11, 8, 4],
    }
    assert section["speaker_encoder"]["fsq_levels"] == [4] * 6
    assert section["quantizer"]["codebook_size"] == 8192


def test_weight_norm_fold_matches_torch(tiny) -> None:
    conv_t = torch.nn.ConvTranspose1d(6, 4, 5)
    wn = torch.nn.utils.parametrizations.weight_norm(conv_t)
    g = wn.parametrizations.weight.original0
    v = wn.parametrizations.weight.original1
    assert g.shape == (6, 1, 1)
    torch.testing.assert_close(fold_weight_norm(g, v), wn.weight, rtol=1e-6, atol=1e-7)


def test_model_folder_containing_bicodec_works(tiny, tokens, tmp_path: Path) -> None:
    tiny.save_pretrained(tmp_path / "Spark-TTS-0.5B" / "BiCodec")
    loaded = BiCodecDecoder.from_pretrained(str(tmp_path / "Spark-TTS-0.5B"), device="cpu")
    assert loaded.device == torch.device("cpu")
    assert (audio(loaded, tokens) - audio(tiny, tokens)).abs().max() <= 1e-5


def test_extra_keys_are_ignored(tiny, tokens, saved: Path) -> None:
    def add(tensors):
        tensors["encoder.encoder.0.weight"] = torch.zeros(3, 3)
        tensors["postnet.linear.weight"] = torch.zeros(2)
        tensors["quantizer.in_project.weight_g"] = torch.zeros(8, 1, 1)
        tensors["quantizer.cluster_size"] = torch.zeros(8192)
        tensors["speaker_encoder.quantizer.project_in.weight"] = torch.zeros(6, 16)

    rewrite(saved, add)
    loaded = BiCodecDecoder.from_pretrained(saved)
    assert (audio(loaded, tokens) - audio(tiny, tokens)).abs().max() <= 1e-5


def test_half_precision_checkpoint_loads(tiny, tokens, saved: Path) -> None:
    rewrite(saved, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    loaded = BiCodecDecoder.from_pretrained(saved)
    assert loaded.dtype == torch.float32
    assert (audio(loaded, tokens) - audio(tiny, tokens)).abs().max() < 0.05


# --- errors -----------------------------------------------------------------------------------


def test_every_missing_key_is_listed(saved: Path) -> None:
    gone = [
        "quantizer.codebook.weight",
        "prenet.vocos_backbone.convnext.1.gamma",
        "decoder.model.2.block.3.block.1.weight_v",
        "decoder.model.6.bias",
        "speaker_encoder.quantizer.project_out.weight",
    ]
    rewrite(saved, lambda t: [t.pop(k) for k in gone])
    with pytest.raises(CheckpointError) as info:
        BiCodecDecoder.from_pretrained(saved)
    message = str(info.value)
    assert "5 decode-path tensor(s) missing" in message
    for key in gone:
        assert f"missing: {key}\n" in message + "\n"
    assert "decoder.model.2.block.3.block.1.weight_g" not in message  # g itself is present
    assert str(saved / "model.safetensors") in message


def test_missing_weight_norm_pair_names_both_and_other_forms(saved: Path) -> None:
    rewrite(saved, lambda t: [t.pop(f"decoder.model.0.weight_{x}") for x in "gv"])
    with pytest.raises(CheckpointError) as info:
        BiCodecDecoder.from_pretrained(saved)
    message = str(info.value)
    assert "missing: decoder.model.0.weight_g" in message
    assert "missing: decoder.model.0.weight_v" in message
    assert "parametrizations.weight.original0/1" in message


def test_wrong_shapes_are_listed_with_expected_and_got(saved: Path) -> None:
    def damage(tensors):
        tensors["quantizer.codebook.weight"] = torch.zeros(8192, 16)
        tensors["decoder.model.1.block.1.weight_g"] = torch.zeros(32, 1, 1)
        tensors["prenet.linear.bias"] = torch.zeros(65)

    rewrite(saved, damage)
    with pytest.raises(CheckpointError) as info:
        BiCodecDecoder.from_pretrained(saved)
    message = str(info.value)
    assert "quantizer.codebook.weight: expected (8192, 8), got (8192, 16)" in message
    assert "decoder.model.1.block.1.weight_g: expected (64, 1, 1), got (32, 1, 1)" in message
    assert "prenet.linear.bias: expected (64,), got (65,)" in message
    assert "3 of the wrong shape" in message


def test_integer_tensor_is_rejected(saved: Path) -> None:
    rewrite(saved, lambda t: t.update({"prenet.linear.bias": torch.zeros(64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"prenet.linear.bias: expected a floating-point"):
        BiCodecDecoder.from_pretrained(saved)


@pytest.mark.parametrize("name", ["config.yaml", "model.safetensors"])
def test_missing_file_is_named_with_its_path(saved: Path, name: str) -> None:
    (saved / name).unlink()
    with pytest.raises(CheckpointError) as info:
        BiCodecDecoder.from_pretrained(saved)
    assert str(saved / name) in str(info.value)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file or directory"):
        BiCodecDecoder.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="BiCodec"):
        BiCodecDecoder.from_pretrained(tmp_path)  # exists, but holds nothing


def test_damaged_safetensors(saved: Path) -> None:
    (saved / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        BiCodecDecoder.from_pretrained(saved)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("audio_tokenizer: [unclosed\n", r"not valid YAML"),
        ("something_else: {}\n", r"no 'audio_tokenizer' mapping"),
        ("- a list\n", r"no 'audio_tokenizer' mapping"),
        ("", r"no 'audio_tokenizer' mapping"),
    ],
)
def test_bad_yaml(saved: Path, text: str, pattern: str) -> None:
    (saved / "config.yaml").write_text(text)
    with pytest.raises(CheckpointError, match=pattern) as info:
        BiCodecDecoder.from_pretrained(saved)
    assert str(saved / "config.yaml") in str(info.value)


def test_yaml_missing_needed_fields_lists_them(saved: Path) -> None:
    doc = yaml.safe_load((saved / "config.yaml").read_text())
    del doc["audio_tokenizer"]["decoder"]["channels"]
    del doc["audio_tokenizer"]["prenet"]["vocos_num_layers"]
    del doc["audio_tokenizer"]["quantizer"]
    (saved / "config.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(CheckpointError) as info:
        BiCodecDecoder.from_pretrained(saved)
    message = str(info.value)
    for needle in ("decoder.channels", "prenet.vocos_num_layers", "section 'quantizer'"):
        assert needle in message


def test_yaml_dimensions_decide_the_expected_shapes(saved: Path) -> None:
    doc = yaml.safe_load((saved / "config.yaml").read_text())
    doc["audio_tokenizer"]["prenet"]["vocos_intermediate_dim"] = 48  # the file holds 64
    (saved / "config.yaml").write_text(yaml.safe_dump(doc))
    expected = r"pwconv1.weight: expected \(48, 32\), got \(64, 32\)"
    with pytest.raises(CheckpointError, match=expected):
        BiCodecDecoder.from_pretrained(saved)


# --- a model folder cannot exhaust memory ----------------------------------------------------
# Each load runs in a child process whose address space is capped at what it had after importing
# torch plus LOAD_HEADROOM, and under a timeout: a loader that formats an alias tree or allocates
# what a config asks for before checking the file fails the test instead of the machine.

LOAD_HEADROOM = 1 << 30
PRESET_TINY_DAC = DAC_PRESETS["tiny"]
LOAD_SCRIPT = r"""
import json, resource, sys, time
import torch  # noqa: F401  (imported before the cap, as a server has it)
from bicodec_shm.errors import CheckpointError
from bicodec_shm.model.registry import decoder_class

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

cls = decoder_class(sys.argv[1])
cap = status("VmSize") + int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.monotonic()
try:
    cls.from_pretrained(sys.argv[2])
    outcome, message = "loaded", ""
except CheckpointError as exc:
    outcome, message = "CheckpointError", str(exc)
except BaseException as exc:  # MemoryError, a raw RuntimeError, ...
    outcome, message = type(exc).__name__, str(exc)[:300]
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(json.dumps({"outcome": outcome, "length": len(message), "message": message[:3000],
                  "peak_growth": grown, "seconds": time.monotonic() - start}))
"""


def bounded_load(codec: str, path: Path) -> dict:
    """``from_pretrained(path)`` in a child with LOAD_HEADROOM of address space and 120 s."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, codec, str(path), str(LOAD_HEADROOM)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the loading process died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(lines[-1])


def assert_refused_cheaply(result: dict, *needles: str) -> None:
    assert result["outcome"] == "CheckpointError", result
    assert result["length"] <= 8192, result["length"]
    assert result["peak_growth"] <= 256 << 20, result["peak_growth"]
    assert result["seconds"] < 30, result["seconds"]
    for needle in needles:
        assert needle in result["message"], (needle, result["message"])


def alias_tree_yaml(levels: int) -> str:
    """config.yaml whose codebook_size is a YAML alias tree: 9**levels leaves in ~100·levels bytes."""
    lines = ["t0: &t0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"t{i}: &t{i} [{', '.join([f'*t{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_yaml_alias_tree_is_refused_without_formatting_it(saved: Path) -> None:
    doc = yaml.safe_load((saved / "config.yaml").read_text())
    text = yaml.safe_dump(doc).replace("codebook_size: 8192", f"codebook_size: *t{9}")
    (saved / "config.yaml").write_text(alias_tree_yaml(9) + text)
    assert (saved / "config.yaml").stat().st_size < 4096
    assert_refused_cheaply(bounded_load("bicodec", saved), "alias", "config.yaml")


def test_yaml_anchor_and_alias_are_refused(saved: Path) -> None:
    doc = yaml.safe_load((saved / "config.yaml").read_text())
    text = yaml.safe_dump(doc).replace("codebook_size: 8192", "codebook_size: &n 8192")
    (saved / "config.yaml").write_text(text.replace("codebook_dim: 8", "codebook_dim: *n"))
    with pytest.raises(CheckpointError, match=r"alias \(\*n\).*anchors and aliases"):
        BiCodecDecoder.from_pretrained(saved)


def memo_tree(levels: int) -> list:
    """A list of 9 references to a list of 9 references ...: pickles to ~30·levels bytes."""
    tree: list = [1] * 9
    for _ in range(levels):
        tree = [tree] * 9
    return tree


@pytest.mark.parametrize(("key", "value"), [("decoder_dim", memo_tree(9)), ("codebook_dim", memo_tree(9)),
                                            ("decoder_rates", [8, memo_tree(9)])])  # fmt: skip
def test_dac_pickle_memo_tree_is_refused_without_formatting_it(tmp_path: Path, key: str, value) -> None:
    from bicodec_shm.model.dac import DACDecoder

    file = tmp_path / "weights.pth"
    DACDecoder.from_config("tiny", seed=1).save_pretrained(file)
    doc = torch.load(file, weights_only=True)
    doc["metadata"]["kwargs"][key] = value
    torch.save(doc, file)
    assert file.stat().st_size < 1 << 20
    assert_refused_cheaply(bounded_load("dac-44khz", file), "weights.pth", f"'{key}'")


@pytest.mark.parametrize(("size", "limit"), [(2**40, "at most 2147483647"), (2**20, "at most 65536")])
def test_config_dimensions_are_capped_before_anything_is_built(saved: Path, size: int, limit: str) -> None:
    doc = yaml.safe_load((saved / "config.yaml").read_text())
    doc["audio_tokenizer"]["quantizer"]["codebook_size"] = size
    (saved / "config.yaml").write_text(yaml.safe_dump(doc))
    assert_refused_cheaply(bounded_load("bicodec", saved), "quantizer.codebook_size", str(size), limit)


def test_shapes_are_checked_on_the_meta_device_before_allocating(saved: Path) -> None:
    # Within every limit, but 2**28 floats (1 GiB) of codebook that the (empty) file does not hold.
    doc = yaml.safe_load((saved / "config.yaml").read_text())
    doc["audio_tokenizer"]["quantizer"].update(codebook_size=2**16, codebook_dim=2**12)
    (saved / "config.yaml").write_text(yaml.safe_dump(doc))
    save_file({}, str(saved / "model.safetensors"))
    result = bounded_load("bicodec", saved)
    assert_refused_cheaply(result, "missing: quantizer.codebook.weight", "more")


def test_dac_shapes_are_checked_on_the_meta_device_before_allocating(tmp_path: Path) -> None:
    # 2 codebooks of 2**16 x 2**12 (2 GiB of float32) that the file does not hold.
    file = tmp_path / "weights.pth"
    kwargs = {**PRESET_TINY_DAC, "n_codebooks": 2, "codebook_size": 2**16, "codebook_dim": 2**12}
    torch.save({"state_dict": {}, "metadata": {"kwargs": kwargs}}, file)
    result = bounded_load("dac-44khz", file)
    assert_refused_cheaply(result, "missing: quantizer.quantizers.0.codebook.weight")


def test_a_config_asking_for_more_than_the_weight_limit_is_refused(tmp_path: Path) -> None:
    from bicodec_shm.model.weights import MAX_ELEMENTS

    file = tmp_path / "weights.pth"
    kwargs = {**PRESET_TINY_DAC, "n_codebooks": 64, "codebook_size": 2**16, "codebook_dim": 2**12}
    torch.save({"state_dict": {}, "metadata": {"kwargs": kwargs}}, file)
    assert_refused_cheaply(bounded_load("dac-44khz", file), f"at most {MAX_ELEMENTS}")


def test_compressed_torch_archive_is_refused(tmp_path: Path) -> None:
    import zipfile

    from bicodec_shm.model.dac import DACDecoder

    file = tmp_path / "weights.pth"
    DACDecoder.from_config("tiny", seed=1).save_pretrained(file)
    with zipfile.ZipFile(file) as src, zipfile.ZipFile(tmp_path / "z.pth", "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with pytest.raises(CheckpointError, match="compressed"):
        DACDecoder.from_pretrained(tmp_path / "z.pth")


def test_oversized_config_is_refused_unread(saved: Path) -> None:
    from bicodec_shm.model.weights import MAX_CONFIG_BYTES

    with open(saved / "config.yaml", "a") as f:
        f.write("#" * MAX_CONFIG_BYTES)
    with pytest.raises(CheckpointError, match=f"larger than {MAX_CONFIG_BYTES} bytes"):
        BiCodecDecoder.from_pretrained(saved)


def test_deeply_nested_config_is_a_checkpoint_error(saved: Path) -> None:
    (saved / "config.yaml").write_text("audio_tokenizer: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(CheckpointError, match="not valid YAML"):
        BiCodecDecoder.from_pretrained(saved)
