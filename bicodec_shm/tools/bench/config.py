"""Names, defaults and the shared settings of one ``bicodec-shm bench`` invocation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...codecs.layout import CodecLayout, get_layout
from ...server.batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_WAIT_MS
from .standin import DEFAULT_A_MS, DEFAULT_B_MS
from .workload import DEFAULT_MIX, Band

NAME_PREFIX = "bcshm-tput"  # segment names: NAME_PREFIX-<random hex>

SHM = "bicodec-shm"
LIMIT = "limit (no IPC)"
PER_PROCESS = "decoder per process"
QUEUE = "queue server"
IDEAL = "ideal batcher (computed)"  # the stand-in only; see standin.py
PIPELINED_IDEAL = "pipelined ideal (computed)"  # an asynchronous stand-in only; see standin.py
COMPUTED = (IDEAL, PIPELINED_IDEAL)  # not run: listed after the measured systems of their N
SYSTEMS = (SHM, LIMIT, PER_PROCESS, QUEUE)  # run order: the limit replays bicodec-shm's batches
SYSTEM_KEYS = {"shm": SHM, "limit": LIMIT, "per-process": PER_PROCESS, "queue": QUEUE}

STAND_IN = "stand-in"
PRESETS = ("spark-tts-0.5b", "tiny")
MODELS = (*PRESETS, STAND_IN)

DEFAULT_NS = (1, 2, 4, 8, 16)
DEFAULT_WINDOW_S = 60.0  # per system, N and repeat
DEFAULT_REPEATS = 3
QUICK_NS = (1, 2)
# Tiny model, 8 runs of ~2-4 s start-up each on 2 busy cores: ~40 s in all.
QUICK_WINDOW_S = 2.0
# OpenMP threads spin between parallel regions; when other processes share the cores, a
# spinning thread waits for a descheduled peer. Measured here under load (2 busy neighbours):
# full-size, 50 tokens, 2 threads: 6.7 s spinning vs 2.3 s with PASSIVE (1 thread: 2.1 s); the
# tiny model ran ~50x slower. PASSIVE changes nothing for 1-thread processes: the fair default.
DEFAULT_OMP_WAIT_POLICY = "PASSIVE"
SWEEP_WAITS = (0.0, 2.0, 5.0, 10.0)
SWEEP_TOKENS = (512, 1024, 2048, 4096)
SWEEP_N = 8
# Peak RSS of one full-size decoder process is ~0.9 GiB (B=8 x 50 tokens); refuse to start N
# of them unless that much memory is free, rather than push a shared machine into the OOM killer.
# A stand-in process imports numpy, not torch.
PROCESS_GIB = {"spark-tts-0.5b": 1.0, "tiny": 0.35, STAND_IN: 0.1,
               **{f"{size}-{rate}": 0.6 if size == "snac" else 0.35
                  for size in ("snac", "tiny") for rate in ("24khz", "32khz", "44khz")}}  # fmt: skip
START_TIMEOUT = 900.0  # seconds for every process to import torch, build its model and warm up
REQUEST_TIMEOUT = 900.0  # seconds; a 16 x 300-token batch of the full model on 2 busy cores
# DecoderServer keywords the benchmark sets itself: the policy also drives the queue server,
# so it has its own options (--max-batch, --max-wait-ms, --max-batch-tokens).
RESERVED_SERVER_ARGS = ("decoder", "name", "max_batch", "max_wait_ms", "max_batch_tokens")


@dataclass(frozen=True)
class Target:
    """A goal set for bicodec-shm at ``n`` clients, judged on the median ratio."""

    key: str  # a ratio of report.compare, e.g. "vs_per_process"
    goal: str
    n: int
    bound: float
    op: str  # ">=" or "<="
    stand_in: bool  # True: only for the stand-in; False: only for a real model
    mix: str | None = None  # only for this request mix (None: any)


TARGETS = (  # the CPU ones were set for the full-size model on a 2-core CPU
    Target("vs_per_process", "throughput >= 1.0x decoder per process", 8, 1.0, ">=", False,
           DEFAULT_MIX),
    Target("memory_vs_per_process", "total peak RSS <= 0.3x decoder per process", 8, 0.3, "<=",
           False, DEFAULT_MIX),
    Target("vs_limit", "throughput >= 0.9x the limit (no IPC)", 8, 0.9, ">=", False, DEFAULT_MIX),
    Target("vs_per_process", "25-token chunks: throughput >= 1.3x decoder per process", 4, 1.3,
           ">=", False, "25"),
    Target("vs_ideal", "throughput >= 0.9x the ideal batcher", 16, 0.9, ">=", True),
)  # fmt: skip


@dataclass(frozen=True)
class Policy:
    """The batching knobs shared by bicodec-shm and the queue server."""

    max_batch: int = DEFAULT_MAX_BATCH
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    max_batch_tokens: int | None = DEFAULT_MAX_BATCH_TOKENS


@dataclass(frozen=True)
class ModelSpec:
    """What a child process builds: a preset of ``codec`` with random weights, or the stand-in
    (BiCodec-shaped)."""

    preset: str
    seed: int = 0
    a_ms: float = DEFAULT_A_MS  # the stand-in's costs (standin.py)
    b_ms: float = DEFAULT_B_MS
    asynchronous: bool = False  # the stand-in plays an asynchronous device (standin.py)
    codec: str = "bicodec"

    @property
    def stand_in(self) -> bool:
        return self.preset == STAND_IN


@dataclass(frozen=True)
class ShmVariant:
    """One bicodec-shm configuration: its row label and extra ``DecoderServer`` keywords."""

    label: str = SHM
    server_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Setup:
    """What every system of one invocation shares.

    ``window``: seconds each system runs at each N (clients send until it closes); None for
    the fixed request count of ``--requests``. ``shm``: the bicodec-shm configurations to run
    (several with ``--lanes``); the limit replays the first one's batches. ``codec``: whose
    layout the requests are drawn with (the mix counts its frames) and whose model ``preset`` is.
    """

    preset: str
    seed: int
    mix: tuple[Band, ...]
    cores: int
    policy: Policy
    sample_interval: float
    timeout: float
    window: float | None = None
    stand_in_ms: tuple[float, float] = (DEFAULT_A_MS, DEFAULT_B_MS)
    stand_in_async: bool = False  # the stand-in plays an asynchronous device (--stand-in modern)
    shm: tuple[ShmVariant, ...] = (ShmVariant(),)
    lock_trace: str | None = None  # tests: the stand-in's per-process lock logs entry and exit
    per_process_max_n: int | None = None  # run the decoder per process only at N <= this
    memory_gib: float | None = None  # the machine's memory for the per-process check (None: ask)
    codec: str = "bicodec"

    @property
    def model(self) -> ModelSpec:
        return ModelSpec(self.preset, self.seed, *self.stand_in_ms, codec=self.codec,
                         asynchronous=self.stand_in_async)

    @property
    def layout(self) -> CodecLayout:
        return get_layout(self.codec)

    @property
    def stand_in(self) -> bool:
        return self.preset == STAND_IN
