"""How the bench's model processes decode without a server: the server's own codec adapter
(``adapters.codec_adapter``) on a batch built as the server gathers one, so that the limit, the
decoder per process and the queue server run the very model call bicodec-shm's server runs, for
any codec. Importing it imports no torch (the stand-in's processes never do); building a real
model does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...codecs.layout import CodecLayout, get_layout
from ...protocol.slot_io import Batch, local_requests
from .config import ModelSpec
from .standin import StandInDecoder
from .workload import Request, zero_request

DEVICE_ENV = "BICODEC_SHM_BENCH_DEVICE"


def load_model(spec: ModelSpec, threads: int) -> Any:
    """Build, then warm up, a decoder (the first calls pay for lazy initialisation)."""
    if spec.stand_in:
        # no torch, nothing to warm up
        return StandInDecoder(a_ms=spec.a_ms, b_ms=spec.b_ms, asynchronous=spec.asynchronous)
    import torch

    torch.set_num_threads(threads)
    from ...model.devices import exact_cuda_math
    from ...model.registry import decoder_class
    from ...server.adapters import codec_adapter

    # Spawned workers inherit the device through the environment (set by --device).
    device = torch.device(os.environ.get(DEVICE_ENV, "cpu"))
    if device.type == "cuda":
        # Every system, not only bicodec-shm's DecoderServer, runs with the server's math: a
        # baseline left at cuDNN's TF32 default would be faster for that alone.
        exact_cuda_math()
    model = decoder_class(spec.codec).from_config(spec.preset, seed=spec.seed).to(device)
    adapter = codec_adapter(model)
    layout = get_layout(spec.codec)
    # A padded (masked) batch and a lone request: the two paths a server takes.
    adapter.detokenize(as_batch([zero_request(layout, 25), zero_request(layout, 20)], layout))
    adapter.detokenize(as_batch([zero_request(layout, 25)], layout))
    return model


def as_batch(requests: Sequence[Request], layout: CodecLayout) -> Batch:
    """Requests -> the ``slot_io.Batch`` a server would gather from them: every level right-
    padded with 0 to the longest, (B, r_i·T) int64; global ids (B, n_global) int64; the default
    noise seed, noise on, start frame 0."""
    b = len(requests)
    lengths = np.array([r.frames for r in requests], np.int64)
    t = int(lengths.max())
    levels = []
    for i, rate in enumerate(layout.level_rates):
        padded = np.zeros((b, rate * t), np.int64)
        for j, r in enumerate(requests):
            padded[j, : len(r.levels[i])] = r.levels[i]
        levels.append(padded)
    glob = np.zeros((b, layout.n_global), np.int64)
    for j, r in enumerate(requests):
        if r.global_ids is not None:
            glob[j] = r.global_ids
    return Batch(local_requests(lengths), levels[0], glob, 0, tuple(levels[1:]))


def decode_rows(adapter: Any, batch: Batch) -> np.ndarray:
    """The adapter's decode of ``batch`` as (B, layout.decoded_samples(T)) float32 numpy on the
    host (at least that wide)."""
    return adapter.detokenize(batch).float().cpu().numpy()
