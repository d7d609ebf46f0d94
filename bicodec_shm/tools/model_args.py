"""The model options of ``serve``, ``demo`` and ``bench``: which codec, preset, weights, device and
dtype, and the decoder they build (the only place the tools import torch and the model)."""

from __future__ import annotations

import argparse
import sys

from ..codecs.layout import LAYOUTS
from ..server.batching import DEFAULT_MAX_BATCH

PRESETS = ("spark-tts-0.5b", "tiny")


# Codecs `serve --codec` knows: every layout (model/registry.py has a decoder for each). Each codec
# but BiCodec has a full-size preset named after it and a tiny one, tiny-RATE (resolve_preset).
CODECS = tuple(LAYOUTS)


def _rate(codec: str) -> str:
    """The rate that names a codec's tiny preset: the name's last part (24khz, 12hz)."""
    return codec.rsplit("-", 1)[1]


CODEC_PRESETS = tuple(dict.fromkeys(p for c in CODECS[1:] for p in (c, f"tiny-{_rate(c)}")))


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None,
                   help="a Spark-TTS model folder or its BiCodec/ folder; for SNAC a folder with "
                        "config.json and pytorch_model.bin (hubertsiuzdak/snac_24khz); for DAC "
                        "descript-audio-codec's weights.pth; for qwen3-tts-12hz a Qwen3-TTS-Tokenizer-12Hz "
                        "folder (or a Qwen3-TTS model folder); default: none, random weights of "
                        "--preset")  # fmt: skip
    p.add_argument("--preset", default=None, choices=PRESETS + CODEC_PRESETS,
                   help="architecture with random weights when no --model-dir is given (default: "
                        "the codec's full size; tiny: a small one of the same token layout)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--device", default="cpu",
                   help="torch device, e.g. cuda:0; for serve, several separated by commas "
                        "(cuda:0,cuda:1) run one server per device as a group")  # fmt: skip
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's own choice, one per core)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype; norms, Snake and audio stay float32 (default float32)")  # fmt: skip
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                   help="replay CUDA graphs captured over (batch, length) buckets (default off)")  # fmt: skip
    p.add_argument("--graph-memory-gib", type=float, default=8.0, metavar="GIB",
                   help="most GPU memory the CUDA graphs may take (default 8)")  # fmt: skip


def load_decoder(args: argparse.Namespace, *, announce: bool = True):  # -> BiCodecDecoder
    """Build the decoder the command line asks for (imports torch); a ``GraphedDecoder`` with
    ``--cuda-graphs``. A device this torch cannot use is a one-line ``ValueError``."""
    import torch

    from ..model.bicodec.buckets import BucketGrid
    from ..model.bicodec.graphs import GraphedDecoder
    from ..model.devices import resolve_device
    from ..model.registry import codec_in, decoder_class

    device = resolve_device(args.device)
    dtype = getattr(args, "dtype", "float32")
    graphs = getattr(args, "cuda_graphs", False)
    if graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA --device, got {args.device!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    codec = getattr(args, "codec", "bicodec")
    preset = resolve_preset(codec, args.preset)
    if graphs and codec != "bicodec":
        raise ValueError(f"--cuda-graphs replays BiCodec only; serve {codec} without it")
    model = decoder_class(codec)
    if args.model_dir:
        # Another codec's folder is named as such before this codec's loader says what it misses.
        found = codec_in(args.model_dir)
        if found is not None and found != codec:
            raise ValueError(wrong_codec(args.model_dir, found, codec))
        decoder = model.from_pretrained(args.model_dir, device=device, dtype=dtype)
        loaded = getattr(decoder.config, "codec_name", "bicodec")
        if loaded != codec:
            raise ValueError(wrong_codec(args.model_dir, loaded, codec))
    else:
        if announce:
            print(
                f"bicodec-shm: no --model-dir given: serving the {preset} architecture with "
                f"RANDOM weights (seed {args.seed}); the audio is noise",
                file=sys.stderr,
            )
        decoder = model.from_config(preset, seed=args.seed, dtype=dtype).to(device)
    if graphs:
        # Buckets up to the batches this server forms: with max_batch 16 and the CUDA token
        # budget (batching.py), 16 x 50 and 8 x 300 are buckets, so they replay unpadded.
        grid = BucketGrid.for_max_batch(getattr(args, "max_batch", DEFAULT_MAX_BATCH))
        decoder = GraphedDecoder(decoder, grid=grid, memory_gib=args.graph_memory_gib, mode="graphs")
    return decoder


def import_model_code(args: argparse.Namespace) -> None:
    """Import, building nothing, the codec's decoder module and with ``--encode`` its encoder's:
    with them torch, and transformers for some encoders. What ``load_decoder`` imports besides
    is this package's own code over torch, imported once torch is.

    ``serve`` imports it with stop signals held back: torch's import runs Python inside C++
    callbacks, where the exception a signal handler raises cannot unwind, and the process ends
    in ``std::terminate`` (no ``finally`` runs: the name it reserved stays in /dev/shm)."""
    import importlib

    from ..model.registry import decoder_class

    codec = getattr(args, "codec", "bicodec")
    decoder_class(codec)
    if getattr(args, "encode", False):
        check_encodable(codec)
        importlib.import_module(ENCODERS[codec][0])


# Codecs `serve --encode` has an encoder for: codec -> (module, class), imported on demand.
ENCODERS = {
    "bicodec": ("bicodec_shm.model.bicodec.tokenizer", "BiCodecEncoder"),
    "qwen3-tts-12hz": ("bicodec_shm.model.qwen3_tts.encoder", "Qwen3TTSEncoder"),
}


def check_encodable(codec: str) -> None:
    """Refuse ``serve --encode`` for a codec without an encoder here, naming those with one."""
    if codec not in ENCODERS:
        raise ValueError(f"--encode: {codec} has no encoder here; the codecs that encode are "
                         f"{', '.join(ENCODERS)}")  # fmt: skip


def load_encoder(args: argparse.Namespace, *, announce: bool = True):  # -> BiCodecEncoder | Qwen3TTSEncoder
    """The encoder ``serve --encode`` asks for (imports torch and transformers; a server without
    ``--encode`` never calls this), from ``--model-dir`` (BiCodec: a Spark-TTS folder with
    ``BiCodec/`` and ``wav2vec2-large-xlsr-53/``; qwen3-tts-12hz: the speech tokenizer folder,
    or a Qwen3-TTS model folder holding it as ``speech_tokenizer/``), else random weights of
    ``--preset``."""
    import importlib

    from ..model.devices import resolve_device

    codec = getattr(args, "codec", "bicodec")
    check_encodable(codec)
    module, name = ENCODERS[codec]
    model = getattr(importlib.import_module(module), name)
    device = resolve_device(args.device)
    if args.model_dir:
        return model.from_pretrained(args.model_dir, device=device)
    preset = resolve_preset(codec, args.preset)
    if announce:
        print(f"bicodec-shm: encoding with the {preset} encoder's RANDOM weights (seed {args.seed}): "
              "the codes mean nothing", file=sys.stderr)  # fmt: skip
    return model.from_config(preset, seed=args.seed).to(device)


def wrong_codec(model_dir: str, found: str, codec: str) -> str:
    """The message for a ``--model-dir`` of codec ``found`` served as ``codec``."""
    fix = "leave --codec out (bicodec is the default)" if found == "bicodec" else f"pass --codec {found}"
    return f"--model-dir {model_dir} holds a {found} model, not a {codec} one: {fix}"


def resolve_preset(codec: str, preset: str | None) -> str:
    """The model preset of ``--codec`` and ``--preset``: None is the codec's full size, "tiny"
    its tiny one (tiny-24khz for snac-24khz); a preset of another codec is refused."""
    if codec == "bicodec":
        owners = [c for c in CODECS[1:] if preset in (c, f"tiny-{_rate(c)}")]
        if owners:
            raise ValueError(f"--preset {preset} is not a BiCodec model; add --codec {' or '.join(owners)}")
        return preset or "spark-tts-0.5b"
    rate = _rate(codec)
    if preset is None or preset == codec:
        return codec
    if preset in ("tiny", f"tiny-{rate}"):
        return f"tiny-{rate}"
    raise ValueError(f"--preset {preset} is not a {codec} model; use tiny, tiny-{rate} or {codec}")
