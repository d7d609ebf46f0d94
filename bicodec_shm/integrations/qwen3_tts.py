"""Qwen3-TTS's speech tokenizer, backed by a shared ``qwen3-tts-12hz`` server: decoding, and
encoding for voice cloning.

``Qwen3TTSModel``'s ``generate_custom_voice``, ``generate_voice_design`` and
``generate_voice_clone`` (qwen-tts, ``qwen_tts/inference/qwen3_tts_model.py``) end with
``self.model.speech_tokenizer.decode([{"audio_codes": c}, ...])``, one ``(T, 16)`` code tensor
per utterance, and return its ``(wavs, sample_rate)``; voice cloning from reference audio first
calls ``self.model.speech_tokenizer.encode(wavs, sr=sr)`` and reads its ``audio_codes``. A
:class:`SharedSpeechTokenizer` answers both calls through the server: every row of a call is
sent at once, so the rows batch with each other and with every other process's. One line after
loading::

    model = Qwen3TTSModel.from_pretrained("Qwen/Qwen3-TTS-12Hz-1.7B-Base", device_map="cuda:0")
    install(model, name="qwen3-tts", keep_tokenizer=False)  # decode and encode on the server

or one before, so that the worker never loads the tokenizer at all (:func:`install_loader`)::

    install_loader("qwen3-tts")
    model = Qwen3TTSModel.from_pretrained("Qwen/Qwen3-TTS-12Hz-1.7B-Base", device_map="cuda:0")

The server: ``bicodec-shm serve --codec qwen3-tts-12hz --model-dir <the model's speech_tokenizer
folder> --name qwen3-tts``, plus ``--encode`` for voice cloning from reference audio.
:func:`install` keeps the original tokenizer by default (``keep_tokenizer=True``): ``encode``
then runs it in this process, as before (it also reads audio files, which the server's encode
does not), and its other attributes are read from it. ``keep_tokenizer=False`` lets it
go, and with it every weight of the speech tokenizer in the worker (its encoder, decoder and
feature extractor): ``encode`` then goes to the server too.

``decode`` takes every form qwen-tts's ``Qwen3TTSTokenizer.decode`` takes for the 12 Hz tokenizer,
and returns what it returns: a list of 1-D float32 numpy arrays, ``1920·n`` samples for a row of
``n`` frames, and the sample rate, 24000. The forms:

- a list of dicts ``{"audio_codes": codes}``, one row each (what ``Qwen3TTSModel`` passes);
- a dict ``{"audio_codes": codes}``, and ``encode``'s output (its ``audio_codes``: one tensor per
  row);

where ``codes`` is a ``(T, 16)`` tensor or array (one row), a ``(B, T, 16)`` one (B rows), or a
list of ``(T, 16)`` rows; tensors on any device, numpy arrays, nested lists. As upstream, a row
ends where codebook 0 holds a negative code: ``-1`` pads a row to its batch's length (qwen-tts's
``pad_sequence(padding_value=-1)``), and what the padding holds in other codebooks is ignored.
Unlike upstream, a ``(T, 16)`` numpy array given as a dict's codes is one row (qwen-tts fails on
it), codes after the padding, codes outside ``0..2047`` and non-integer dtypes are refused with
a ``ValueError`` naming the row, frame and codebook (qwen-tts clamps, or fails inside the model),
and a row longer than the server's ``--max-tokens`` frames is refused before any row is sent. A
row of 0 frames gives an empty array, as upstream.

Without a kept tokenizer, ``encode`` takes numpy waveforms as qwen-tts's
``Qwen3TTSTokenizer.encode`` takes them, resampling those at another rate than 24 kHz as it does
(librosa's default, soxr "HQ", in this process), and returns what it returns, the codes computed
on the server (:meth:`SharedSpeechTokenizer.encode`).

torch is never imported here: tensors are read with ``.detach().cpu().numpy()``, and ``encode``'s
code tensors are made by the torch the process has loaded already (qwen-tts's).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.client.long_requests import all_in_threads
from bicodec_shm.codecs import QWEN3_TTS_12HZ
from bicodec_shm.codecs.audio import as_audio, at_codec_rate, check_audio_length, check_sample_rate
from bicodec_shm.integrations.inputs import integer_array, shared_client

N_CODEBOOKS = QWEN3_TTS_12HZ.n_levels  # 16: 1 semantic + 15 acoustic
CODEBOOK_SIZE = QWEN3_TTS_12HZ.level_vocab[0]  # 2048
SAMPLE_RATE = QWEN3_TTS_12HZ.sample_rate  # 24000
SAMPLES_PER_FRAME = QWEN3_TTS_12HZ.samples_per_frame  # 1920
MODEL_TYPE = "qwen3_tts_tokenizer_12hz"  # what qwen-tts's get_model_type() answers for it


class EncodeOutput(dict):
    """What :meth:`SharedSpeechTokenizer.encode` returns, read as qwen-tts's
    ``Qwen3TTSTokenizerV2EncoderOutput`` is: ``.audio_codes``, ``["audio_codes"]`` or ``[0]``,
    one ``(T, 16)`` int64 code tensor per clip."""

    def __init__(self, audio_codes: list[Any]) -> None:
        super().__init__(audio_codes=audio_codes)

    @property
    def audio_codes(self) -> list[Any]:
        return dict.__getitem__(self, "audio_codes")

    def __getitem__(self, key: Any) -> Any:
        return self.to_tuple()[key] if isinstance(key, int) else dict.__getitem__(self, key)

    def to_tuple(self) -> tuple[list[Any]]:
        return (self.audio_codes,)


class SharedSpeechTokenizer:
    """``Qwen3TTSTokenizer.decode`` and ``encode`` (12 Hz) through the server ``name``.

    Args:
        name: the server's segment name (``bicodec-shm serve --name``); ignored with ``client``.
        client: a ``DecoderClient`` to use (default: this process's shared one for ``name``).
        tokenizer: qwen-tts's ``Qwen3TTSTokenizer`` that ``encode`` runs and every other
            attribute (``config``, ``feature_extractor``, ...) is read from; None: ``encode``
            goes to the server, and there are no other attributes.
        timeout: seconds one row's decode or one clip's encode may take (None: the client's
            default).

    Thread-safe: calls from many threads share the client, and the server batches them.
    """

    def __init__(self, name: str = "bicodec-shm", *, client: DecoderClient | None = None,
                 tokenizer: Any = None, timeout: float | None = None) -> None:  # fmt: skip
        self.name = client.name if client is not None else name
        self.tokenizer = tokenizer
        self.timeout = timeout
        self._client = client

    @property
    def client(self) -> DecoderClient:
        """The client decodes go through (connected on first use)."""
        if self._client is None:
            self._client = shared_client(self.name)
        return self._client

    def decode(self, encoded: Any) -> tuple[list[np.ndarray], int]:
        """Decode as qwen-tts's ``Qwen3TTSTokenizer.decode`` does for the 12 Hz tokenizer.

        Args:
            encoded: a list of dicts with ``"audio_codes"``, one such dict, or ``encode``'s
                output (the module's docstring lists the forms of the codes).
        Returns:
            ``(wavs, sample_rate)``: one (1920·n,) float32 numpy array per row of n frames, in
            order, and 24000. All rows are decoded concurrently, so they batch on the server.
        Raises:
            ValueError: before any row is sent: a form other than these, a row that is not
                (T, 16), a non-integer dtype, a code outside 0..2047 (or after a row's padding),
                no rows, a row longer than the server takes, or a server of another codec.
        """
        rows = _rows_of(encoded)
        client = self.client
        limit = client.max_tokens
        for i, row in enumerate(rows):
            if len(row) > limit:
                raise ValueError(
                    f"row {i} has {len(row)} frames ({len(row) / QWEN3_TTS_12HZ.frame_rate:.1f} s), more "
                    f"than the server {client.name!r} takes ({limit}): restart it with a larger "
                    "--max-tokens"
                )
        calls = [_decode_call(client, row, self.timeout) for row in rows if len(row)]
        decoded = iter(all_in_threads(calls))
        wavs = [next(decoded) if len(row) else np.zeros(0, np.float32) for row in rows]
        return wavs, SAMPLE_RATE

    def encode(self, audios: Any, sr: int | None = None, return_dict: bool = True) -> Any:
        """Encode as qwen-tts's ``Qwen3TTSTokenizer.encode`` does for the 12 Hz tokenizer: with a
        kept ``tokenizer``, its own ``encode`` in this process (every input it takes); without
        one, on the server (started with ``--encode``), every clip sent at once, so that they
        batch there. What follows is the server's.

        Args:
            audios: one numpy waveform or a list of them; as upstream, an array of more than
                one dimension is mixed down by its mean over the last axis (channels last), the
                samples are cast to float32 as they are (upstream scales nothing: pass int16
                PCM divided by 32768), and a clip at another rate than 24 kHz is resampled to
                it as ``librosa.resample``'s default does (soxr "HQ", padded to
                ``ceil(n · 24000 / sr)`` samples), in this process. Paths, URLs and base64
                strings, which qwen-tts reads with librosa and soundfile, are refused: nothing
                here reads files the way it does, and a clip read another way would give other
                codes.
            sr: the waveforms' sample rate, required as upstream: an int in [1, 1 000 000].
            return_dict: True: an :class:`EncodeOutput` (``.audio_codes``); False: the tuple
                ``(audio_codes,)``, as upstream.
        Returns:
            ``audio_codes``: one ``(ceil(n / 1920), 16)`` int64 tensor per clip of ``n``
            samples, in order, on the CPU (upstream's are on its tokenizer's device: both go
            through ``.to(device)`` in ``generate_voice_clone``): the codes qwen-tts's encoder
            gives the clip alone, with the server's weights. Tensors of the torch this process
            has loaded; numpy arrays in a process without torch.
        Raises:
            ValueError: before any clip is sent: a path or string, no clip, an array of another
                type or dtype, ``sr`` missing or not a sample rate, an empty clip, a sample that
                is not finite, a clip longer than the server takes (at 24 kHz, after
                resampling), or a server of another codec.
            NoEncoderError: the server was started without ``--encode``.
        """
        if self.tokenizer is not None:
            more = {} if return_dict else {"return_dict": False}  # what the caller passed
            return self.tokenizer.encode(audios, sr=sr, **more)
        wavs, lengths = _waveforms(audios, sr)
        client = self.client
        limit = client.max_tokens * SAMPLES_PER_FRAME
        codec = client.codec.name
        if codec != QWEN3_TTS_12HZ.name:
            raise ValueError(f"the server {client.name!r} serves {codec}, not {QWEN3_TTS_12HZ.name}: "
                             "encode on a `serve --codec qwen3-tts-12hz --encode` server")  # fmt: skip
        for i, (wav, n) in enumerate(zip(wavs, lengths)):
            try:
                check_audio_length(len(wav), min_samples=1, max_samples=limit, sample_rate=SAMPLE_RATE,
                                   name=client.name, resampled_from=None if sr == SAMPLE_RATE else (n, sr))
            except ValueError as exc:
                raise ValueError(f"clip {i}: {exc}") from None
        calls = [_encode_call(client, wav, self.timeout) for wav in wavs]
        results = all_in_threads(calls)
        codes = [_as_tensor(np.stack(result.codes, axis=1).astype(np.int64)) for result in results]
        return EncodeOutput(codes) if return_dict else (codes,)

    def get_model_type(self) -> str:
        """``"qwen3_tts_tokenizer_12hz"``, as qwen-tts's tokenizer answers."""
        return MODEL_TYPE

    def get_output_sample_rate(self) -> int:
        """24000: the sample rate of the decoded audio."""
        return SAMPLE_RATE

    def get_decode_upsample_rate(self) -> int:
        """1920: samples per frame of codes."""
        return SAMPLES_PER_FRAME

    def __getattr__(self, attr: str) -> Any:
        # Only reached for names this class does not define: Qwen3TTSTokenizer's others.
        tokenizer = self.__dict__.get("tokenizer")
        if attr.startswith("__") or tokenizer is None:
            raise AttributeError(
                f"SharedSpeechTokenizer has no {attr!r}: it decodes and encodes only; keep "
                "qwen-tts's tokenizer loaded (install(model) keeps it; "
                "SharedSpeechTokenizer(tokenizer=...)) for its other attributes"
            )
        return getattr(tokenizer, attr)

    def __repr__(self) -> str:
        return f"<SharedSpeechTokenizer name={self.name!r} tokenizer={type(self.tokenizer).__name__}>"


def install(model: Any, *, name: str | None = None, client: DecoderClient | None = None,
            timeout: float | None = None, keep_tokenizer: bool = True) -> SharedSpeechTokenizer:  # fmt: skip
    """Make ``model``'s speech tokenizer decode on the server; returns the stand-in.

    Args:
        model: a ``Qwen3TTSModel`` (its ``model.speech_tokenizer`` is replaced), or the
            ``Qwen3TTSForConditionalGeneration`` it holds (its ``speech_tokenizer``).
        name, client, timeout: as :class:`SharedSpeechTokenizer` (``name`` default
            ``"bicodec-shm"``).
        keep_tokenizer: keep the original for ``encode`` (voice cloning from reference audio,
            in this process) and its other attributes; False drops this reference to it, so that
            the worker can free every weight of it: encoding goes to the server too (started
            with ``--encode``).
    Raises:
        ValueError: an object without a speech tokenizer, or one of another type than the 12 Hz
            tokenizer (qwen-tts's 25 Hz tokenizer is not served).
    """
    holder = _holder(model)
    original = holder.speech_tokenizer
    if isinstance(original, SharedSpeechTokenizer):  # installed before: wrap what it wraps
        original = original.tokenizer
    kind = original.get_model_type() if hasattr(original, "get_model_type") else MODEL_TYPE
    if kind != MODEL_TYPE:
        raise ValueError(
            f"this model's speech tokenizer is {kind!r}; the server decodes {MODEL_TYPE!r} "
            "(`serve --codec qwen3-tts-12hz`): use a Qwen3-TTS-12Hz model"
        )
    shared = SharedSpeechTokenizer(name or "bicodec-shm", client=client, timeout=timeout,
                                   tokenizer=original if keep_tokenizer else None)  # fmt: skip
    holder.speech_tokenizer = shared
    return shared


def install_loader(name: str = "bicodec-shm", *, module: str | types.ModuleType | None = None,
                   client: DecoderClient | None = None, timeout: float | None = None) -> None:  # fmt: skip
    """Make ``Qwen3TTSModel.from_pretrained`` load no speech tokenizer: where it would build
    qwen-tts's ``Qwen3TTSTokenizer`` from the model's ``speech_tokenizer/`` folder, it gets a
    :class:`SharedSpeechTokenizer` of the server ``name`` (no tokenizer kept: decode and encode
    go to the server, which must run ``--encode`` for voice cloning). Call it before loading::

        qwen3_tts.install_loader("qwen3-tts")
        model = Qwen3TTSModel.from_pretrained("Qwen/Qwen3-TTS-12Hz-1.7B-Base", device_map="cuda:0")

    The worker then never reads the tokenizer's weights (``install(model, keep_tokenizer=False)``
    after loading frees them, but the worker held them once). The folder's ``config.json`` is
    read, to refuse a tokenizer the server does not serve.

    Args:
        name: the server's segment name (``bicodec-shm serve --name``).
        module: the module whose ``from_pretrained`` builds the tokenizer (a name or the
            module); default ``qwen_tts.core.models.modeling_qwen3_tts``, qwen-tts's.
        client, timeout: as :class:`SharedSpeechTokenizer`.
    Raises:
        ImportError: the module does not import (qwen-tts not installed).
        ValueError: the module has no ``Qwen3TTSTokenizer`` to replace.
    """
    if not isinstance(module, types.ModuleType):
        module = importlib.import_module(module or UPSTREAM_MODULE)
    target = module
    installed = _loaders.get(target.__name__)
    original = installed[1] if installed else getattr(target, "Qwen3TTSTokenizer", None)
    if original is None:
        raise ValueError(f"{target.__name__} has no Qwen3TTSTokenizer: pass module= the module whose "
                         "from_pretrained builds the speech tokenizer")  # fmt: skip

    class SharedTokenizerLoader:
        """Stands in for ``Qwen3TTSTokenizer`` while :func:`install_loader` is in effect."""

        @staticmethod
        def from_pretrained(path: Any, *args: Any, **kwargs: Any) -> SharedSpeechTokenizer:
            _check_tokenizer_folder(path)
            return SharedSpeechTokenizer(name, client=client, timeout=timeout)

    # Recorded before the rebinding: an exception between the two leaves uninstall able to undo it.
    _loaders[target.__name__] = (target, original)
    target.Qwen3TTSTokenizer = SharedTokenizerLoader


def uninstall_loader() -> None:
    """Undo :func:`install_loader`: ``from_pretrained`` loads qwen-tts's own tokenizer again."""
    for key, (target, original) in list(_loaders.items()):
        target.Qwen3TTSTokenizer = original  # restored before forgotten, so never lost midway
        del _loaders[key]


def uninstall(model: Any) -> None:
    """Give ``model`` back the tokenizer :func:`install` kept (ValueError if none was kept)."""
    holder = _holder(model)
    shared = holder.speech_tokenizer
    if not isinstance(shared, SharedSpeechTokenizer):
        return
    if shared.tokenizer is None:
        raise ValueError("install(keep_tokenizer=False) kept no tokenizer to give back")
    holder.speech_tokenizer = shared.tokenizer


# -- helpers ------------------------------------------------------------------------------------

UPSTREAM_MODULE = "qwen_tts.core.models.modeling_qwen3_tts"  # its from_pretrained builds the tokenizer
_loaders: dict[str, tuple[types.ModuleType, Any]] = {}  # module name -> (module, its own class)


def _check_tokenizer_folder(path: Any) -> None:
    """Refuse a speech tokenizer folder whose ``config.json`` names another tokenizer than the
    12 Hz one (qwen-tts's 25 Hz tokenizer is not served); a folder without one passes (a hub
    name, say: the server checks what it serves)."""
    config = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config):
        return
    with open(config, encoding="utf-8") as f:
        kind = json.load(f).get("model_type", MODEL_TYPE)
    if kind != MODEL_TYPE:
        raise ValueError(
            f"{path}: this model's speech tokenizer is {kind!r}; the server decodes {MODEL_TYPE!r} "
            "(`serve --codec qwen3-tts-12hz`): use a Qwen3-TTS-12Hz model"
        )



def _holder(model: Any) -> Any:
    """The object whose ``speech_tokenizer`` ``Qwen3TTSModel``'s generate functions read."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "speech_tokenizer"):
        return inner
    if hasattr(model, "speech_tokenizer"):
        return model
    raise ValueError(
        f"{type(model).__name__} has no speech tokenizer: pass a Qwen3TTSModel (its "
        "model.speech_tokenizer is replaced) or the model it holds"
    )


def _rows_of(encoded: Any) -> list[np.ndarray]:
    """Every row of ``encoded``, trimmed at its padding and checked: (n_i, 16) int64 arrays."""
    if hasattr(encoded, "audio_codes"):  # encode()'s output (a ModelOutput, also a dict)
        rows = _rows_of_codes(encoded.audio_codes, "audio_codes")
    elif isinstance(encoded, dict):
        if "audio_codes" not in encoded:
            raise ValueError(f"a dict to decode needs 'audio_codes'; it has {sorted(map(str, encoded))}")
        rows = _rows_of_codes(encoded["audio_codes"], "audio_codes")
    elif isinstance(encoded, (list, tuple)):
        rows = []
        for i, item in enumerate(encoded):
            if not isinstance(item, dict) or "audio_codes" not in item:
                raise ValueError(
                    f"item {i} to decode must be a dict with 'audio_codes' (Qwen3TTSModel passes "
                    f"[{{'audio_codes': codes}}, ...]), got {type(item).__name__}"
                )
            rows.append(_array(item["audio_codes"], f"item {i}'s audio_codes", ndim=2))
    else:
        raise ValueError(
            f"decode takes encode()'s output, a dict or a list of dicts with 'audio_codes', "
            f"got {type(encoded).__name__}"
        )
    if not rows:
        raise ValueError("nothing to decode: no rows of codes")
    return [_trimmed(row, i) for i, row in enumerate(rows)]


def _rows_of_codes(codes: Any, what: str) -> list[np.ndarray]:
    """A dict's codes: one (T, 16) row, a (B, T, 16) batch, or a list of (T, 16) rows."""
    if isinstance(codes, (list, tuple)):
        return [_array(c, f"{what}[{i}]", ndim=2) for i, c in enumerate(codes)]
    arr = _array(codes, what, ndim=None)
    if arr.ndim == 2:
        return [arr]
    if arr.ndim == 3:
        return list(arr)
    raise ValueError(f"{what} must be (T, 16) or (B, T, 16), got shape {arr.shape}")


def _array(values: Any, what: str, *, ndim: int | None) -> np.ndarray:
    """An integer numpy array from a tensor (any device), numpy array or nested list."""
    arr = integer_array(values, what, "integer codes (qwen-tts passes torch.long)", empty_float_ok=True)
    if arr.ndim >= 2 and arr.shape[-1] != N_CODEBOOKS:
        hint = " (codebooks last: transpose a (16, T) array)" if arr.shape[-2] == N_CODEBOOKS else ""
        raise ValueError(
            f"{what} must have {N_CODEBOOKS} codes per frame, one per codebook, (T, 16); got shape "
            f"{arr.shape}{hint}"
        )
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{what} must be (T, 16), one row, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _trimmed(row: np.ndarray, i: int) -> np.ndarray:
    """Row ``i``'s frames: those before the first negative code in codebook 0 (qwen-tts counts
    codebook 0's codes above -1), every one of them checked to be in 0..2047."""
    padding = np.flatnonzero(row[:, 0] < 0)
    n = int(padding[0]) if len(padding) else len(row)
    after = np.flatnonzero(row[n:, 0] >= 0)
    if len(after):
        raise ValueError(
            f"row {i}: frame {n + int(after[0])} has codes after the padding that starts at frame "
            f"{n}; -1 in codebook 0 pads only the end of a row"
        )
    frames = row[:n]
    bad = np.argwhere((frames < 0) | (frames >= CODEBOOK_SIZE))
    if len(bad):
        frame, book = (int(v) for v in bad[0])
        raise ValueError(
            f"row {i}: frame {frame}, codebook {book} holds code {int(frames[frame, book])}, "
            f"outside 0..{CODEBOOK_SIZE - 1}"
        )
    return frames


def _decode_call(client: DecoderClient, row: np.ndarray, timeout: float | None) -> Callable[[], np.ndarray]:
    levels = np.ascontiguousarray(row.T)  # (n, 16) -> (16, n): one level per codebook
    return lambda: client.decode_codes(levels, dtype="float32", codec=QWEN3_TTS_12HZ.name, timeout=timeout)


def _waveforms(audios: Any, sr: Any) -> tuple[list[np.ndarray], list[int]]:
    """``encode``'s clips as qwen-tts's ``_normalize_audio_inputs`` makes them from numpy
    arrays (mean over the last axis of a multi-dimensional one, float32, resampled to 24 kHz
    by ``librosa.resample``'s default where ``sr`` is another rate), each checked first: 1-D,
    not empty, every sample finite; and the clips' lengths before resampling."""
    if isinstance(audios, (str, bytes)) or (isinstance(audios, (list, tuple)) and audios
                                            and isinstance(audios[0], (str, bytes))):  # fmt: skip
        raise ValueError(
            "encode takes numpy waveforms; audio paths, URLs and base64 strings are not read here "
            "(qwen-tts reads them with librosa and soundfile): load the clip, mix it to mono and "
            "pass the array with its rate, sr=..."
        )
    clips = [audios] if isinstance(audios, np.ndarray) else audios
    if not isinstance(clips, (list, tuple)):
        raise ValueError(f"encode takes a numpy waveform or a list of them, got {type(audios).__name__}"
                         + (" (a torch tensor: pass .cpu().numpy())" if hasattr(audios, "detach") else ""))
    if not clips:
        raise ValueError("nothing to encode: no clips")
    if sr is None:
        raise ValueError("For numpy waveform input, you must provide `sr` (original sampling rate)")
    try:
        sr = check_sample_rate(sr)
    except ValueError as exc:
        raise ValueError(str(exc).replace("sample_rate", "sr", 1)) from None
    wavs, lengths = [], []
    for i, clip in enumerate(clips):
        if not isinstance(clip, np.ndarray):
            raise ValueError(f"clip {i} must be a numpy array, got {type(clip).__name__}")
        if clip.dtype.kind not in "fiu":
            raise ValueError(f"clip {i} must hold real samples, got dtype {clip.dtype}")
        if clip.ndim > 1 and clip.size:
            clip = np.mean(clip, axis=-1)  # as upstream: channels last
        try:
            wav = as_audio(clip.astype(np.float32))
        except ValueError as exc:
            raise ValueError(f"clip {i}: {exc}") from None
        wavs.append(at_codec_rate(wav, sr, QWEN3_TTS_12HZ))
        lengths.append(len(wav))
    return wavs, lengths


def _encode_call(client: DecoderClient, wav: np.ndarray, timeout: float | None) -> Callable[[], Any]:
    return lambda: client.encode(wav, sample_rate=SAMPLE_RATE, timeout=timeout)


def _as_tensor(codes: np.ndarray) -> Any:
    """``codes`` as a tensor of the torch this process loaded (never importing it), else as is."""
    torch = sys.modules.get("torch")
    return codes if torch is None else torch.from_numpy(codes)
