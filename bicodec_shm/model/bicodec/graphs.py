"""``GraphedDecoder``: BiCodec decodes replayed from CUDA graphs captured over shape buckets.

A full-size float32 decode runs 445 aten operations that compute (61 addmm, 50 convolutions,
59 add, 53 mul, 42 addcmul, 37 in-place mask multiplies, 29 x sin, pow and reciprocal for the
Snakes, 22 layer norms, 16 GELU, ...; counted with a TorchDispatchMode around
``StaticBucket.forward`` at 2 x 25 on CPU, views excluded). On CUDA each launches at least one
kernel, and a cuDNN convolution often two or three (bias, layout), so about 450-550 kernels per
decode, whatever the batch: at small batches the host spends longer launching them than the
GPU spends running them. A CUDA graph replays the whole decode with
one launch, but only at the shape it was captured at. So each batch is padded up to a bucket
(``buckets.py``) and masked as usual, which keeps every real row equal to its lone decode:

- a padded row of a real item (frames ``T..T_bucket``) is masked like any padding;
- an extra row (rows ``B..B_bucket``) holds valid ids and length 1, and its audio is dropped.

Inside the captured region nothing reads a tensor on the host: the mask is built on the device
from static ``arange`` buffers and the lengths buffer (:class:`StaticTimeMask`), where the eager
``TimeMask`` reads ``lengths.min()``. The inputs are copied into static buffers before a replay
and the output is cloned out of the graph's static buffer after it. A lock makes load, replay and
clone one step: two server lanes sharing the decoder would otherwise overwrite each other's
static inputs, or a replay the output that the other lane is about to clone.

Graphs are captured at start, largest bucket first, into one shared memory pool, and capturing
stops adding graphs once the next would take the pool past ``memory_gib``. Shapes without a
graph, and every decode when CUDA is not in use, run eagerly on the wrapped decoder.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import torch

from ..devices import exact_cuda_math
from ..modules import TimeMask
from .buckets import Bucket, BucketGrid
from .config import BiCodecConfig
from .decoder import BiCodecDecoder, IdsLike, _check_inputs

log = logging.getLogger(__name__)

MODES = ("auto", "graphs", "eager", "padded")
GIB = 1024**3


class StaticTimeMask(TimeMask):
    """A :class:`TimeMask` built without reading any tensor on the host (CUDA-graph safe).

    It masks every frame from 0 on: multiplying a valid frame by exactly 1 leaves it bit for bit
    unchanged, so the result equals the eager mask's, which skips the frames before the shortest
    row's length only to save work.

    Args:
        lengths: (B,) valid frames of each row, on the device.
        steps: ``{f: arange(T·f)}`` for every upsampling factor f, on the device.
        dtype: dtype of the activations to mask.
    """

    def __init__(self, lengths: torch.Tensor, steps: dict[int, torch.Tensor], *, dtype: torch.dtype) -> None:
        self._masks = {}
        for f, frames in steps.items():
            valid = frames[None, :] < lengths[:, None] * f  # (B, T·f)
            self._masks[frames.numel()] = (0, valid.to(dtype)[:, None, :])  # (B, 1, T·f)


class StaticBucket:
    """Static input, mask and output buffers of one bucket, and the decode that reads them.

    :meth:`load` copies a batch in; :meth:`run` decodes the whole bucket, replaying the graph
    once :meth:`capture` has recorded one and running eagerly before that; :attr:`output` holds
    float32 audio (B_bucket, hop·T_bucket), zero past each row's length.

    Args:
        decoder: the model; its device and dtype decide the buffers'.
        bucket: the padded shape.
    """

    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None

    def __init__(self, decoder: BiCodecDecoder, bucket: Bucket) -> None:
        self.decoder, self.bucket = decoder, bucket
        device, cfg = decoder.device, decoder.config
        b, t = bucket.batch, bucket.frames
        # Zero ids and length 1 are valid for the extra rows, whatever batch comes first.
        self.semantic = torch.zeros(b, t, dtype=torch.long, device=device)
        self.global_ids = torch.zeros(b, cfg.n_global, dtype=torch.long, device=device)
        self.lengths = torch.ones(b, dtype=torch.long, device=device)
        self.steps = {f: torch.arange(t * f, device=device) for f in decoder.decoder.time_factors}
        self.hop = cfg.hop_length
        self.inputs = (self.semantic, self.global_ids, self.lengths)
        # Pinned host copies, so that a batch on the host reaches the device in one async copy
        # per tensor; _copied marks when that copy is done and the host copies are free again.
        self._host: tuple[torch.Tensor, ...] | None = None
        self._copied: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._host = tuple(torch.zeros_like(v, device="cpu").pin_memory() for v in self.inputs)
            self._copied = torch.cuda.Event()

    def load(self, semantic: torch.Tensor, global_ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copy a validated batch into the static inputs: (b, t), (b, n_global), (b,) int64, with
        ``b <= B_bucket`` and ``t <= T_bucket``; the rest of the bucket is zeros and length 1."""
        if self._host is None or semantic.device.type != "cpu":  # a CPU bucket, or on the device
            _fill(self.inputs, (semantic, global_ids, lengths))
            return
        self._copied.synchronize()  # the last batch's async copy has left the host buffers
        _fill(self._host, (semantic, global_ids, lengths))
        for static, staged in zip(self.inputs, self._host):
            static.copy_(staged, non_blocking=True)
        self._copied.record()

    def forward(self) -> torch.Tensor:
        """The decode of the static inputs -> float32 audio (B_bucket, hop·T_bucket); no host
        reads, so it can be captured."""
        mask = StaticTimeMask(self.lengths, self.steps, dtype=self.decoder.dtype)
        audio = self.decoder(self.semantic, self.global_ids, mask)[:, 0].float()  # (B, 1, N) -> (B, N)
        ends = self.lengths[:, None] * self.hop  # (B, 1)
        return audio.masked_fill_(self.steps[self.hop] >= ends, 0.0)

    def run(self) -> torch.Tensor:
        """Decode what :meth:`load` put in; returns :attr:`output`."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.output = self.forward()
        return self.output

    def warm_up(self, runs: int = 1) -> int:
        """Run :meth:`forward` eagerly on a side stream, as torch asks before a capture (lazy
        initialisation must not be captured). Returns the peak bytes it allocated beyond what
        was allocated before: what the bucket's activations need."""
        device = self.decoder.device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(runs):
                self.forward()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before

    def capture(self, pool: tuple[int, int]) -> None:
        """Record :meth:`forward` into a CUDA graph whose memory comes from ``pool``."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.output = self.forward()
        self.graph = graph

    @property
    def static_bytes(self) -> int:
        """Bytes held by the static inputs, output and masks' step buffers."""
        tensors = [self.semantic, self.global_ids, self.lengths, *self.steps.values()]
        if self.output is not None:
            tensors.append(self.output)
        return sum(t.numel() * t.element_size() for t in tensors)


class GraphedDecoder:
    """A :class:`BiCodecDecoder` whose batches replay CUDA graphs captured over shape buckets.

    Same decode protocol as the decoder (``detokenize``, ``device``, ``dtype``, ``config``), so a
    ``DecoderServer`` takes either.

    Args:
        decoder: the model; graphs need it on a CUDA device.
        grid: the buckets to capture (default :class:`BucketGrid`'s 6 x 7).
        memory_gib: capture no graph that would take the graphs' memory past this.
        mode: ``"auto"`` captures graphs on CUDA and decodes eagerly elsewhere; ``"graphs"``
            requires CUDA; ``"eager"`` never pads (the plain decoder); ``"padded"`` pads to the
            buckets and runs them eagerly, without graphs (to check the padding on any device).
        warmup: eager runs of each bucket before its capture.

    Raises:
        ValueError: an unknown mode, ``"graphs"`` without CUDA, or a negative budget.
    """

    def __init__(
        self,
        decoder: BiCodecDecoder,
        *,
        grid: BucketGrid | None = None,
        memory_gib: float = 8.0,
        mode: str = "auto",
        warmup: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if memory_gib < 0:
            raise ValueError(f"memory_gib must be >= 0, got {memory_gib}")
        on_cuda = decoder.device.type == "cuda"
        if mode == "graphs" and not on_cuda:
            raise ValueError(f"CUDA graphs need the decoder on a CUDA device, it is on {decoder.device}")
        self.decoder = decoder
        self.grid = grid or BucketGrid()
        self.memory_gib = memory_gib
        self.mode = ("graphs" if on_cuda else "eager") if mode == "auto" else mode
        self.buckets: dict[Bucket, StaticBucket] = {}
        self.skipped: list[Bucket] = []  # over the memory budget: these shapes run eagerly
        self.graph_bytes = 0  # device memory the graphs and their buffers hold, measured
        self.activation_bytes: dict[Bucket, int] = {}  # each bucket's eager peak, measured
        self.capture_seconds = 0.0
        # Load + replay + clone of a bucket is one step (see the module docstring). The three
        # are only queued under the lock, on the device's current stream, in order.
        self._lock = threading.Lock()
        with torch.inference_mode(), _on(decoder.device):
            if self.mode == "padded":
                self.buckets = {k: StaticBucket(decoder, k) for k in self.grid.buckets()}
            elif self.mode == "graphs":
                self._capture_all(warmup)

    @property
    def device(self) -> torch.device:
        """The wrapped decoder's device (the server sends batches there)."""
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        """The wrapped decoder's compute dtype."""
        return self.decoder.dtype

    @property
    def config(self) -> BiCodecConfig:
        """The wrapped decoder's config."""
        return self.decoder.config

    @torch.inference_mode()
    def detokenize(
        self,
        semantic_ids: IdsLike,
        global_ids: IdsLike,
        lengths: IdsLike | Sequence[int] | None = None,
        *,
        mask: bool = True,
    ) -> torch.Tensor:
        """Decode a right-padded batch, as :meth:`BiCodecDecoder.detokenize` does.

        Args:
            semantic_ids: (B, T) integer ids.
            global_ids: (B, n_global) integer ids.
            lengths: (B,) valid tokens per row, each in ``[1, T]``; None means all T.
            mask: False runs the decoder's unmasked eager path (benchmarks only).

        Returns:
            float32 audio (B, hop·T) on the model's device; row i is 0 from ``hop·lengths[i]``.
        """
        semantic, glob, lens = _check_inputs(self.config, semantic_ids, global_ids, lengths)
        batch, frames = semantic.shape
        bucket = self.grid.choose(batch, frames) if mask else None
        static = self.buckets.get(bucket) if bucket is not None else None
        if static is None:
            return self.decoder.detokenize(semantic, glob, lens, mask=mask)
        if lens is None:
            lens = torch.full((batch,), frames, dtype=torch.long, device=semantic.device)
        with self._lock, _on(self.device):  # on the model's GPU's stream, one lane at a time
            static.load(semantic, glob, lens)
            # Cloned: the next replay overwrites the graph's output buffer.
            return static.run()[:batch, : self.config.hop_length * frames].clone()

    def _capture_all(self, warmup: int) -> None:
        """Capture every bucket, largest first, into one pool, within the memory budget."""
        device = self.decoder.device
        # The graphs keep the math mode they are captured with: set the server's before.
        exact_cuda_math()
        budget = int(self.memory_gib * GIB)
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        pool_need = 0  # the largest activations captured so far: the pool holds that much
        order = self.grid.buckets()
        for i, bucket in enumerate(order):
            t0 = time.perf_counter()
            try:
                static = StaticBucket(self.decoder, bucket)
                need = self.activation_bytes[bucket] = static.warm_up(warmup)
                # The pool keeps what earlier (larger) captures freed, so a bucket adds only
                # the part of its activations beyond that, and its static buffers.
                estimate = max(0, need - pool_need) + static.static_bytes
                if self.graph_bytes + estimate > budget:
                    log.info("CUDA graph %s skipped: ~%.0f MiB more would pass the %.1f GiB budget",
                             bucket, estimate / 2**20, self.memory_gib)  # fmt: skip
                    self.skipped.append(bucket)
                    continue
                static.capture(pool)
            except torch.cuda.OutOfMemoryError as exc:  # a smaller bucket may still fit
                log.warning("CUDA graph %s skipped: out of memory (%s)", bucket, exc)
                self.skipped.append(bucket)
                continue
            pool_need = max(pool_need, need)
            torch.cuda.empty_cache()  # the warm-up's cached blocks are not the graphs' memory
            total = torch.cuda.memory_reserved(device) - base
            log.info("CUDA graph %s captured in %.0f ms: +%.0f MiB, graphs hold %.0f MiB of %.1f GiB",
                     bucket, 1e3 * (time.perf_counter() - t0), (total - self.graph_bytes) / 2**20,
                     total / 2**20, self.memory_gib)  # fmt: skip
            self.graph_bytes = total
            self.buckets[bucket] = static
            if total > budget:  # the estimate fell short; a shared pool cannot give memory back
                log.warning("CUDA graphs hold %.0f MiB, past the %.1f GiB budget: capturing stops",
                            total / 2**20, self.memory_gib)  # fmt: skip
                self.skipped.extend(order[i + 1 :])
                break
        self.capture_seconds = time.perf_counter() - start
        log.info("CUDA graphs: %d of %d buckets captured in %.1f s, %.0f MiB; %d skipped (%s)",
                 len(self.buckets), len(self.grid), self.capture_seconds, self.graph_bytes / 2**20,
                 len(self.skipped), ", ".join(map(str, self.skipped)) or "none")  # fmt: skip

    def __repr__(self) -> str:
        return (f"<GraphedDecoder mode={self.mode} device={self.device} dtype={self.dtype} "
                f"graphs={len(self.buckets) if self.mode == 'graphs' else 0}/{len(self.grid)} "
                f"{self.graph_bytes / 2**20:.0f} MiB>")  # fmt: skip


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current CUDA device (streams and events are per device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _fill(buffers: Sequence[torch.Tensor], batch: Sequence[torch.Tensor]) -> None:
    """Write a batch (b, t), (b, n_global), (b,) into bucket buffers (B, T), (B, n_global), (B,);
    zero ids and length 1 elsewhere, so the buffers hold the same whatever batch came before."""
    (semantic, global_ids, lengths), (new_semantic, new_global, new_lengths) = buffers, batch
    b, t = new_semantic.shape
    semantic.zero_()
    semantic[:b, :t].copy_(new_semantic)
    global_ids[:b].copy_(new_global)
    global_ids[b:].zero_()
    lengths[:b].copy_(new_lengths)
    lengths[b:].fill_(1)
