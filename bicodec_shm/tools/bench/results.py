"""What one run of one system measured (``RunResult``), built from the records its processes
sent back: only those completed by the end of the window count."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ...codecs.layout import BICODEC, CodecLayout
from .config import Policy
from .sampling import _Sampler
from .workers import Record
from .workload import audio_seconds


@dataclass
class RunResult:
    """One system at one N in one repeat (absolute numbers; ratios come from ``compare``)."""

    system: str
    n_clients: int
    requests: int
    failed: int
    tokens: int  # frames of the codec (BiCodec: semantic tokens)
    audio_seconds: float
    wall_seconds: float
    audio_s_per_s: float
    requests_per_s: float
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    avg_batch_size: float
    batch_size_histogram: dict
    peak_rss_mib: float | None  # the peak of the sum over processes (None: nothing ran)
    cpu_seconds: float
    others_cpu_share: float | None
    threads: str
    policy: dict
    largest_process_rss_mib: float = 0.0  # the largest single process's own peak
    padding_overhead: float | None = None  # padded tokens / tokens - 1
    note: str = ""
    repeat: int = 0
    window_s: float | None = None  # None: a fixed request count
    cut_at_edge: int = 0  # requests (the limit: batches) completed after the window, left out
    batches: list = field(default_factory=list, repr=False)  # bicodec-shm's, for the limit
    # bicodec-shm: the lane counts that took batches in the window ([]: not known, or not a server
    # with lanes), and the seconds of it the lane tuner spent exploring (None: no tuner ran).
    lanes: list = field(default_factory=list)
    tuner_exploring_s: float | None = None
    replays: str = ""  # the limit: the bicodec-shm configuration whose batches it replays

    @property
    def cpu_per_audio_s(self) -> float | None:
        """CPU seconds per audio second: the cost of the work, much less noisy than wall time."""
        return self.cpu_seconds / self.audio_seconds if self.audio_seconds and self.cpu_seconds else None


def _summarize(system: str, n: int, records: list[Record], t0: float, t_end: float,
               sampler: _Sampler, *, window: float | None, threads: str, policy: Policy | None,
               failed: int = 0, latencies: bool = True,
               layout: CodecLayout = BICODEC) -> RunResult:  # fmt: skip
    """Numbers from the records that completed in [t0, t_end]; the rest were cut at the edge.
    ``layout``: the codec, whose frames the records count."""
    counted = [r for r in records if r[3] <= t_end]
    wall = max(t_end - t0, 1e-9)
    tokens = sum(r[1] for r in counted)
    requests = sum(r[2] for r in counted)
    lat_ms = np.array([r[0] for r in counted]) * 1000
    return RunResult(
        system=system, n_clients=n, requests=requests, failed=failed, tokens=tokens,
        audio_seconds=audio_seconds(tokens, layout), wall_seconds=wall,
        audio_s_per_s=audio_seconds(tokens, layout) / wall, requests_per_s=requests / wall,
        latency_p50_ms=float(np.percentile(lat_ms, 50)) if latencies and len(lat_ms) else None,
        latency_p99_ms=float(np.percentile(lat_ms, 99)) if latencies and len(lat_ms) else None,
        avg_batch_size=1.0, batch_size_histogram={}, peak_rss_mib=sampler.peak_rss / 2**20,
        cpu_seconds=sampler.cpu_seconds, others_cpu_share=sampler.others_cpu_share,
        threads=threads, policy=asdict(policy) if policy else {},
        largest_process_rss_mib=max(sampler.peak_rss_by_pid.values(), default=0) / 2**20,
        window_s=window, cut_at_edge=len(records) - len(counted),
    )  # fmt: skip


def _batch_stats(result: RunResult, batches: list[list[int]]) -> None:
    sizes = [len(b) for b in batches]
    result.avg_batch_size = float(np.mean(sizes)) if sizes else 0.0
    result.batch_size_histogram = {s: sizes.count(s) for s in sorted(set(sizes))}
    tokens = sum(map(sum, batches))
    if tokens:
        result.padding_overhead = sum(len(b) * max(b) for b in batches) / tokens - 1


def _skipped(system: str, n: int, note: str) -> RunResult:
    return RunResult(system=system, n_clients=n, requests=0, failed=0, tokens=0,
                     audio_seconds=0.0, wall_seconds=0.0, audio_s_per_s=0.0, requests_per_s=0.0,
                     latency_p50_ms=None, latency_p99_ms=None, avg_batch_size=0.0,
                     batch_size_histogram={}, peak_rss_mib=0.0, cpu_seconds=0.0,
                     others_cpu_share=None, threads="", policy={}, note=note)  # fmt: skip


def lane_phases_in_window(phases: list[tuple[float, int, bool]], t0: float,
                          t_end: float) -> tuple[list[int], float]:  # fmt: skip
    """What the lane tuner did in the window [t0, t_end], from its state changes ``phases``
    ((perf_counter, lanes, exploring), in order, the first at the server's start): the lane
    counts that ran in it, sorted, and the seconds of it spent exploring. ([], 0.0) without
    phases (no tuner)."""
    lanes: set[int] = set()
    exploring_s = 0.0
    for k, (t, n, exploring) in enumerate(phases):
        until = phases[k + 1][0] if k + 1 < len(phases) else t_end
        lo, hi = max(t, t0), min(until, t_end)
        if hi > lo:
            lanes.add(n)
            if exploring:
                exploring_s += max(0.0, hi - lo)
    return sorted(lanes), exploring_s
