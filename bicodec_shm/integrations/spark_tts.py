"""Spark-TTS's audio tokenizer, backed by a shared BiCodec server.

``SparkTTS.inference`` (Spark-TTS's ``cli/SparkTTS.py``) ends by calling
``self.audio_tokenizer.detokenize(global_tokens, semantic_tokens)`` with int64 tensors on the
model's device, of shapes (1, 32) and (1, T), and returns what it gets: a float32 numpy array of
shape (320·T,) at 16 kHz, the BiCodec decoder's output as it is (not scaled, not clipped). For
voice cloning it first calls ``self.audio_tokenizer.tokenize(prompt_speech_path)``, which
returns ``(global_tokens, semantic_tokens)``: (1, 1, 32) int32 and (1, T) int64 tensors.

Workers that hold only their language model: one call before the model is built::

    from bicodec_shm.integrations import spark_tts
    spark_tts.install("spark-tts")          # the server: bicodec-shm serve --encode ...
    model = SparkTTS(model_dir, device)     # builds its LLM and a SharedBiCodecTokenizer

``install`` makes the name ``BiCodecTokenizer`` in Spark-TTS's ``cli.SparkTTS`` module (or in
``spark_tts_lib.SparkTTS``, or a module given) a :class:`SharedBiCodecTokenizer`, so
``SparkTTS.__init__`` loads neither BiCodec nor wav2vec2 (no file under ``BiCodec/`` or
``wav2vec2-large-xlsr-53/`` is opened). Its ``tokenize`` reads the prompt wav as Spark-TTS's
``load_audio`` does (soundfile, the first channel, soxr's "VHQ" resampling to 16 kHz) and has the
server encode it (``serve --encode``): the server applies the volume normalisation and the
reference clip of the model folder's ``config.yaml``, as ``BiCodecTokenizer`` does in process.
Its ``detokenize`` decodes through the server. Voice creation (``gender``/``pitch``/``speed``)
and voice cloning run through Spark-TTS's own ``inference`` unchanged. :func:`uninstall` puts
``BiCodecTokenizer`` back.

The clip crosses shared memory as float32 and is normalised in the server from those samples;
Spark-TTS normalises the float64 samples it read and rounds afterwards. For 16-bit and float
wav files at 16 kHz both round nothing, and the ids are Spark-TTS's; a resampled prompt may
differ at float rounding. In process, Spark-TTS's wav2vec2 draws from torch's global random
generator (one ``torch.rand`` per layer, in eval mode too); the shared tokenizer draws nothing,
so under one ``torch.manual_seed`` voice cloning samples other speech than an in-process run.

What a worker needs for ``tokenize``: ``soundfile`` (reading the wav) and, for prompts not at
16 kHz, ``soxr`` (resampling); both come with Spark-TTS's own requirements.

Or, for a model built already, one assignment::

    model = SparkTTS(model_dir, device)
    model.audio_tokenizer = SharedAudioTokenizer("spark-tts", tokenizer=model.audio_tokenizer)

``tokenizer=`` keeps the original for everything but decoding: voice cloning calls its
``tokenize`` (the encoder and wav2vec2 stay in the process). Without it, only ``detokenize``
exists, which is all that voice creation (``gender``/``pitch``/``speed``) needs.

Spark-TTS writes up to 3000 semantic tokens (60 s), and its own tokenizer decodes any length. A
row longer than the server's ``--max-tokens`` (1500 by default) is decoded as overlapping
windows with the model's whole receptive field as context (client/long_requests.py), sent
together so that they batch: the audio equals the whole decode up to float rounding.

torch is never imported here: tensors, on any device, are read with ``.detach().cpu().numpy()``;
``tokenize`` returns torch tensors where the process has imported torch (a Spark-TTS worker
has), numpy arrays otherwise.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import types
from typing import Any

import numpy as np

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.client.long_requests import decode_any_length
from bicodec_shm.integrations.inputs import integer_array

N_GLOBAL = 32
# Where Spark-TTS's SparkTTS class looks up BiCodecTokenizer: its repository's cli/SparkTTS.py,
# and the same file as PyPI's spark-tts-lib packages it.
SPARK_TTS_MODULES = ("cli.SparkTTS", "spark_tts_lib.SparkTTS")


class SharedAudioTokenizer:
    """``BiCodecTokenizer.detokenize`` through the server ``name``.

    Args:
        name: the server's segment name (``bicodec-shm serve --name``); ignored with ``client``.
        client: a ``DecoderClient`` to use (default: a new one for ``name``, made on first use).
        tokenizer: the ``BiCodecTokenizer`` that any other attribute (``tokenize``, ``config``,
            ``device``, ...) is read from; None: there are none.
        timeout: seconds one decode may take (None: the client's default, 30 s).
    """

    def __init__(self, name: str = "bicodec-shm", *, client: DecoderClient | None = None,
                 tokenizer: Any = None, timeout: float | None = None) -> None:  # fmt: skip
        self.name = client.name if client is not None else name
        self.tokenizer = tokenizer
        self.timeout = timeout
        self._client = client
        self._owns_client = client is None
        self._lock = threading.Lock()

    @property
    def client(self) -> DecoderClient:
        """The client decodes go through (connected on first use)."""
        with self._lock:  # threads of one process share one client
            if self._client is None:
                self._client = DecoderClient(self.name)
            return self._client

    def detokenize(self, global_tokens: Any, semantic_tokens: Any) -> np.ndarray:
        """Decode as Spark-TTS's ``BiCodecTokenizer.detokenize`` does.

        Args:
            global_tokens: (B, 32) ints in [0, 4096): tensor (any device), numpy array or list.
            semantic_tokens: (B, T) ints in [0, 8192).
        Returns:
            float32 numpy, (320·T,) for B = 1 and (B, 320·T) otherwise (Spark-TTS squeezes its
            (B, 1, 320·T) result), 16 kHz, the decoder's own scale. Rows are decoded one after
            another, a row longer than the server's slots as windows sent together; concurrent
            callers (threads, processes) are batched by the server.
        Raises:
            ValueError: shapes other than these, a dtype other than an integer one (float,
                bfloat16, bool, ...), ids out of range, or more tokens than any server takes.
        """
        globals_ = _rows(global_tokens, "global_tokens")
        semantic = _rows(semantic_tokens, "semantic_tokens")
        if globals_.shape[1] != N_GLOBAL:
            raise ValueError(
                f"global_tokens must be (B, {N_GLOBAL}), got shape {globals_.shape}: Spark-TTS "
                "passes global_token_ids.squeeze(0), shape (1, 32)"
            )
        if globals_.shape[0] != semantic.shape[0]:
            raise ValueError(
                f"global_tokens has {globals_.shape[0]} row(s) and semantic_tokens "
                f"{semantic.shape[0]}: one row of each per utterance"
            )
        client = self.client
        wavs = [decode_any_length(client, s, g, dtype="float32", timeout=self.timeout)
                for s, g in zip(semantic, globals_)]  # fmt: skip
        return wavs[0] if len(wavs) == 1 else np.stack(wavs)

    def close(self) -> None:
        """Close the client if this object made it (a later decode makes a new one)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None and self._owns_client:
            client.close()
        self._owns_client = True

    def __getattr__(self, attr: str) -> Any:
        # Only reached for names this class does not define: BiCodecTokenizer's others.
        tokenizer = self.__dict__.get("tokenizer")
        if attr.startswith("__") or tokenizer is None:
            raise AttributeError(
                f"SharedAudioTokenizer has no {attr!r}: it decodes only; pass "
                "tokenizer=model.audio_tokenizer to keep BiCodecTokenizer's other methods "
                "(voice cloning calls tokenize)"
            )
        return getattr(tokenizer, attr)

    def __repr__(self) -> str:
        return f"<SharedAudioTokenizer name={self.name!r} tokenizer={type(self.tokenizer).__name__}>"


def _rows(values: Any, what: str) -> np.ndarray:
    """A (B, N) integer array from a tensor (any device), numpy array or nested list."""
    arr = integer_array(values, what, "integer ids (Spark-TTS passes torch.long)")
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{what} must be 2-D, (B, N) with B, N >= 1, got shape {arr.shape}")
    return arr


class SharedBiCodecTokenizer(SharedAudioTokenizer):
    """Spark-TTS's ``BiCodecTokenizer`` (``tokenize`` and ``detokenize``) through the server
    ``name``, loading no model: what :func:`install` makes ``SparkTTS`` build.

    Args:
        model_dir: the Spark-TTS model folder, kept as ``model_dir`` and never read (the server
            loaded it: ``bicodec-shm serve --encode --model-dir``).
        device: where ``tokenize``'s tensors are put (Spark-TTS passes its model's device).
        name, client, timeout: as for :class:`SharedAudioTokenizer`.
    """

    def __init__(self, model_dir: Any = None, device: Any = None, *, name: str = "bicodec-shm",
                 client: DecoderClient | None = None, timeout: float | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(name, client=client, timeout=timeout)
        self.model_dir = model_dir
        self.device = device

    def tokenize(self, audio_path: Any) -> tuple[Any, Any]:
        """Encode a prompt wav as ``BiCodecTokenizer.tokenize`` does.

        Args:
            audio_path: a path (str or ``os.PathLike``) or an open file soundfile reads.
        Returns:
            ``(global_tokens, semantic_tokens)``: (1, 1, 32) int32 and (1, T) int64, T = 50 per
            second of 16 kHz audio; torch tensors on ``device`` where the process has imported
            torch, numpy arrays otherwise.
        Raises:
            ValueError: a file soundfile cannot read, no samples, a NaN or infinite sample, or a
                clip shorter than the encoder takes or longer than the server's slots hold.
            NoEncoderError: the server was started without ``--encode``.
        """
        wav, sr = read_prompt(audio_path)  # resampled to 16 kHz by encode, as Spark-TTS resamples
        encoded = self.client.encode(wav, sample_rate=sr, timeout=self.timeout)
        global_ids = np.asarray(encoded.global_ids, dtype=np.int32).reshape(1, 1, N_GLOBAL)
        semantic = np.asarray(encoded.semantic_ids, dtype=np.int64).reshape(1, -1)
        torch = sys.modules.get("torch")
        if torch is None:
            return global_ids, semantic
        out = (torch.from_numpy(global_ids), torch.from_numpy(semantic))
        return out if self.device is None else tuple(t.to(self.device) for t in out)

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(
            f"SharedBiCodecTokenizer has no {attr!r}: it loads no model and answers tokenize "
            "and detokenize through the server"
        )

    def __repr__(self) -> str:
        return f"<SharedBiCodecTokenizer name={self.name!r} model_dir={self.model_dir!r}>"


def read_prompt(audio_path: Any) -> tuple[np.ndarray, int]:
    """A prompt wav as Spark-TTS's ``load_audio`` reads it, before resampling and volume
    normalisation: float64 samples of the first channel, and the file's rate (``encode`` resamples
    them to 16 kHz as ``load_audio`` does, soxr "VHQ": ``BICODEC.resampling``). ValueError for a
    file it cannot read, no samples or a non-finite sample."""
    try:
        import soundfile
    except ImportError:
        raise ImportError(
            "SharedBiCodecTokenizer.tokenize reads the prompt wav with soundfile: "
            "pip install soundfile"
        ) from None
    where = os.fspath(audio_path) if isinstance(audio_path, (str, os.PathLike)) else "the prompt"
    try:
        audio, sr = soundfile.read(audio_path)
    except Exception as err:  # soundfile's LibsndfileError, TypeError, OSError: all "unreadable"
        raise ValueError(f"cannot read {where!r} as audio: {err}") from None
    audio = np.asarray(audio, dtype=np.float64)
    if audio.ndim > 1:
        audio = audio[:, 0]  # Spark-TTS keeps the first channel
    if audio.size == 0:
        raise ValueError(f"{where!r} holds no audio samples")
    if not np.isfinite(audio).all():
        raise ValueError(f"{where!r} holds a NaN or infinite sample")
    return audio, int(sr)


_installed: dict[str, tuple[types.ModuleType, Any]] = {}


def install(name: str = "bicodec-shm", *, module: str | types.ModuleType | None = None,
            client: DecoderClient | None = None, timeout: float | None = None) -> None:  # fmt: skip
    """Make ``SparkTTS(model_dir, device)`` build a :class:`SharedBiCodecTokenizer` on the
    server ``name`` in place of ``BiCodecTokenizer``: its constructor loads no model.

    Args:
        name: the server's segment name (``bicodec-shm serve --encode --name``).
        module: the module ``SparkTTS`` is defined in (a name or the module); default: the
            first of ``cli.SparkTTS`` (Spark-TTS's repository) and ``spark_tts_lib.SparkTTS``
            (PyPI's spark-tts-lib) that imports.
        client: one ``DecoderClient`` for every tokenizer built (default: each makes its own).
        timeout: seconds one encode or decode may take.
    Raises:
        ImportError: no such module imports.
        ValueError: the module has no ``BiCodecTokenizer`` to replace.
    """
    target = _spark_module(module)
    original = _installed[target.__name__][1] if target.__name__ in _installed else None
    if original is None:
        original = getattr(target, "BiCodecTokenizer", None)
        if original is None:
            raise ValueError(
                f"{target.__name__} has no BiCodecTokenizer: pass module= the module that "
                "defines SparkTTS"
            )

    def shared_tokenizer(model_dir: Any = None, device: Any = None, **kwargs: Any):
        return SharedBiCodecTokenizer(model_dir, device, name=name, client=client,
                                      timeout=timeout, **kwargs)  # fmt: skip

    shared_tokenizer.__doc__ = SharedBiCodecTokenizer.__doc__
    # Recorded before the rebinding: an exception between the two leaves uninstall able to undo it.
    _installed[target.__name__] = (target, original)
    target.BiCodecTokenizer = shared_tokenizer


def uninstall() -> None:
    """Undo :func:`install`: ``SparkTTS`` builds Spark-TTS's own ``BiCodecTokenizer`` again."""
    for key, (target, original) in list(_installed.items()):
        target.BiCodecTokenizer = original  # restored before forgotten, so never lost midway
        del _installed[key]


def _spark_module(module: str | types.ModuleType | None) -> types.ModuleType:
    if isinstance(module, types.ModuleType):
        return module
    names = SPARK_TTS_MODULES if module is None else (module,)
    errors = []
    for candidate in names:
        try:
            return importlib.import_module(candidate)
        except ImportError as err:
            errors.append(f"{candidate}: {err}")
    raise ImportError(
        "cannot import Spark-TTS's SparkTTS module (" + "; ".join(errors) + "): run from "
        "Spark-TTS's repository, or pass module="
    )
