"""Spark-TTS's audio tokenizer for decoding, backed by a shared BiCodec server.

``SparkTTS.inference`` (Spark-TTS's ``cli/SparkTTS.py``) ends by calling
``self.audio_tokenizer.detokenize(global_tokens, semantic_tokens)`` with int64 tensors on the
model's device, of shapes (1, 32) and (1, T), and returns what it gets: a float32 numpy array of
shape (320·T,) at 16 kHz, the BiCodec decoder's output as it is (not scaled, not clipped). A
:class:`SharedAudioTokenizer` answers that call through the server, so Spark-TTS's own code runs
unchanged after one assignment::

    model = SparkTTS(model_dir, device)
    model.audio_tokenizer = SharedAudioTokenizer("spark-tts", tokenizer=model.audio_tokenizer)

``tokenizer=`` keeps the original for everything but decoding: voice cloning calls its
``tokenize`` (the encoder and wav2vec2 stay in the process). Without it, only ``detokenize``
exists, which is all that voice creation (``gender``/``pitch``/``speed``) needs.

Spark-TTS writes up to 3000 semantic tokens (60 s), and its own tokenizer decodes any length. A
row longer than the server's ``--max-tokens`` (1500 by default) is decoded as overlapping
windows with the model's whole receptive field as context (client/long_requests.py), sent
together so that they batch: the audio equals the whole decode up to float rounding.

torch is never imported here: tensors, on any device, are read with ``.detach().cpu().numpy()``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.client.long_requests import decode_any_length
from bicodec_shm.integrations.inputs import integer_array

N_GLOBAL = 32


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
