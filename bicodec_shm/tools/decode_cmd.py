"""``bicodec-shm decode``: token ids from files to a WAV, through a running server."""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import wave

from ..codecs.validation import as_utterance
from ..errors import BiCodecShmError
from ..protocol.names import ServerState, probe, validate_name
from ..protocol.served import describe_served

SAMPLE_RATE = 16_000


TOKENS_PER_SECOND = 50  # semantic tokens per second of 16 kHz audio (hop 320)


def _cmd_decode(args: argparse.Namespace) -> int:
    from ..client.decoder_client import DecoderClient

    # Everything that can refuse without the server is checked before it is asked to decode.
    validate_name(args.name)
    try:
        semantic = read_ids(args.semantic, what="--semantic")
        global_ids = read_ids(args.global_, what="--global")
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename}: {exc.strerror}") from None
    if args.output != "-":
        check_writable(args.output)
    state = probe(args.name)
    if state in (ServerState.ABSENT, ServerState.DEAD):
        raise BiCodecShmError(
            f"no bicodec-shm server is running under the name {args.name!r}; "
            f"{describe_served()} (start one with `bicodec-shm serve --name {args.name}`, "
            "or pass the name of a running one with --name)"
        )
    starting = state is ServerState.BUSY  # a server is starting (or stopping): wait for it
    with DecoderClient(args.name, timeout=args.timeout,
                       connect_timeout=args.timeout if starting else 0.0) as client:  # fmt: skip
        pcm = client.decode(semantic, global_ids)  # (320·T,) int16
    data = wav_bytes(pcm)
    if args.output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        try:
            with open(args.output, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise BiCodecShmError(f"cannot write {args.output}: {exc.strerror}") from None
    where = "standard output" if args.output == "-" else args.output
    print(f"wrote {where}: {len(semantic)} tokens, {len(pcm) / SAMPLE_RATE:.2f} s of 16 kHz mono int16",
          file=sys.stderr)  # fmt: skip
    return 0


def check_writable(path: str) -> None:
    """Refuse an output path that cannot be written, without creating anything."""
    if os.path.isdir(path):
        raise ValueError(f"-o {path} is a folder: name the WAV file to write")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"-o {path}: the folder {folder} does not exist")
    target = path if os.path.exists(path) else folder
    if not os.access(target, os.W_OK):
        raise ValueError(f"-o {path}: {target} is not writable by this user")


# A batch in a file: the CLI decodes one utterance per call.
_CLI_BATCH_HINT = "run `bicodec-shm decode` once per row, each row in its own file"


def read_ids(path: str, *, what: str):  # -> np.ndarray (N,) integer
    """Token ids from a ``.npy`` file (any integer dtype and the API's shape rule: leading
    dimensions of size 1, as in Spark-TTS's (1, T), are dropped) or a text file of integers
    separated by whitespace and/or commas (surrounding brackets allowed).

    The file's format and shape are checked here; ranges and lengths are the client's checks.
    """
    import numpy as np

    if path.endswith(".npy"):
        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"{what} {path}: not a numpy array file ({exc})") from None
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what} {path}: ids must be integers, the array is {arr.dtype}")
        return as_utterance(arr, what=f"{what} {path}", batch_hint=_CLI_BATCH_HINT)
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    words = [w for w in re.split(r"[\s,]+", text.strip().strip("[]")) if w]
    ids = []
    for i, word in enumerate(words):
        try:
            ids.append(int(word))
        except ValueError:
            raise ValueError(
                f"{what} {path}: item {i} is {word[:20]!r}, not an integer "
                "(expected ints separated by spaces or commas, or a .npy file)"
            ) from None
    return np.asarray(ids, dtype=np.int64)


def wav_bytes(pcm) -> bytes:
    """(N,) int16 samples -> a complete 16 kHz mono WAV file, written by ``wave``."""
    import numpy as np

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())
    return buf.getvalue()
