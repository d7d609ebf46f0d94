"""Prometheus metrics of a running server, read from its segment at scrape time.

``DecoderServer(..., metrics_port=P)`` (``bicodec-shm serve --metrics-port P``) starts a
``MetricsExporter``: an HTTP endpoint ``/metrics`` on the loopback address unless told another
(``--metrics-host``), rendered by ``prometheus_client`` (the ``[metrics]`` extra) and served by
``metrics_http.MetricsEndpoint`` from one daemon thread of the server process (an idle or slow
connection costs no thread, and times out). Nothing is counted twice: a
custom collector copies the segment header once per scrape (the same header ``bicodec-shm
stats`` reads) and turns it into metric families, so the numbers agree with ``stats`` exactly.
Those reads are not paired with the server's writes (protocol/segment.py, "Memory ordering"): fine for
monotonic statistics, and one copy per scrape keeps a scrape consistent with itself, but during
load two counters of one scrape may be a few requests apart.

Metrics (Triton's and vLLM's conventions: counters end in ``_total``, times are in seconds)::

    counters
      bicodec_shm_requests_total                      requests answered, decoded or failed
      bicodec_shm_request_failures_total{status}      failed requests by protocol.layout.Status name
      bicodec_shm_batches_total                       forward passes published
      bicodec_shm_decoded_tokens_total                semantic tokens decoded (no padding)
      bicodec_shm_padded_tokens_total                 token positions computed (rows x longest)
      bicodec_shm_reclaimed_slots_total               slots taken back from clients that died or gave up
      bicodec_shm_idle_slots_expired_total            idle handles' warm slots freed (routine)
      bicodec_shm_dropped_answers_total               decoded rows whose client freed the slot meanwhile
      bicodec_shm_lane_busy_seconds_total             lanes' time inside the decoder, summed
      bicodec_shm_host_gap_seconds_total              a lane idle while work waited for the host
      bicodec_shm_dispatch_wait_seconds_total         a lane holding ready work back on purpose
    histograms
      bicodec_shm_request_queue_time_seconds          per decoded request: submit -> batch start
      bicodec_shm_request_latency_seconds             per decoded request: submit -> result
      bicodec_shm_batch_decode_time_seconds           per batch: time inside the decoder
      bicodec_shm_batch_size                          per batch: rows (le 1, 2, 4, ..., 64)
    gauges
      bicodec_shm_slots                               slots in the segment
      bicodec_shm_slots_owned / _ready / _busy        slots not FREE / READY / BUSY right now
      bicodec_shm_attached_clients                    client handles holding at least one slot
      bicodec_shm_lanes / bicodec_shm_lanes_busy      decode lanes / lanes running a batch
    info
      bicodec_shm_server_info{name,version,codec,max_batch,max_tokens}   1

The time histograms use ``protocol.layout.TIME_BUCKETS`` (the header's bins) and count decoded
requests only: their ``_count`` is ``requests - failed``. Slots are claimed on demand (a quiet
handle keeps one warm slot), so ``attached_clients`` counts clients that hold a slot, not every
process that has attached. The registry also holds prometheus_client's standard ``process_*``,
``python_*`` collectors of the server process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import MissingExtraError
from ..protocol.header import codec_name
from ..protocol.layout import BUSY, FREE, HIST_BINS, N_STATUS, READY, TIME_BUCKETS, Status
from ..protocol.segment import Segment
from .metrics_http import MetricsEndpoint

log = logging.getLogger("bicodec_shm.metrics")

METRICS_EXTRA = 'pip install "bicodec-shm[metrics]"'
# Only this host may scrape unless the operator names another address (--metrics-host).
DEFAULT_HOST = "127.0.0.1"
# Upper bounds (rows) of the batch-size histogram; the header's bin b counts batches of b rows,
# and its last bin (HIST_BINS - 1 = 64) batches of 64 rows *or more*.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_NS = 1e9


def require_prometheus_client() -> Any:
    """The ``prometheus_client`` module, or a one-line ``MissingExtraError`` saying what to install."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401  (the metric families)
    except ImportError:
        raise MissingExtraError(
            f"metrics need prometheus_client, the [metrics] extra: {METRICS_EXTRA}"
        ) from None
    return prometheus_client


def metric_families(header: np.ndarray, state: np.ndarray, handle_id: np.ndarray, *,
                    name: str, version: str) -> list[Any]:  # fmt: skip
    """The metric families of one snapshot.

    Args:
        header: a copy of the segment header (``HEADER_DT``, 0-d or a void).
        state: (n_slots,) slot states; handle_id: (n_slots,) the owners' handle ids.
        name, version: the server's segment name and the package version (info labels).
    """
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
    )

    h = header
    seconds = {k: int(h[k]) / _NS for k in ("queue_wait_ns", "latency_ns", "decode_ns", "lane_busy_ns",
                                             "host_gap_ns", "waited_ns")}  # fmt: skip
    out: list[Any] = []

    def counter(metric: str, doc: str, value: float) -> None:
        out.append(CounterMetricFamily(metric, doc, value=value))

    def gauge(metric: str, doc: str, value: float) -> None:
        out.append(GaugeMetricFamily(metric, doc, value=value))

    counter("bicodec_shm_requests_total", "Requests the server answered, decoded or failed.",
            int(h["requests"]))  # fmt: skip
    failures = CounterMetricFamily("bicodec_shm_request_failures_total",
                                   "Requests the server answered with an error, by status.",
                                   labels=["status"])  # fmt: skip
    by_status = h["failed_by_status"]
    for code in range(N_STATUS):
        if code in Status._value2member_map_:
            if code != Status.OK:  # every known status, at 0 too: rate() needs the series
                failures.add_metric([Status(code).name], int(by_status[code]))
        elif by_status[code]:  # a code this version does not know (the last bin: any >= 15)
            failures.add_metric([f"CODE_{code}"], int(by_status[code]))
    out.append(failures)
    counter("bicodec_shm_batches_total", "Batches decoded and published (one forward pass each).",
            int(h["batches"]))  # fmt: skip
    counter("bicodec_shm_decoded_tokens_total", "Semantic tokens decoded, padding excluded.",
            int(h["tokens"]))  # fmt: skip
    counter("bicodec_shm_padded_tokens_total",
            "Token positions the decoder computed (rows x longest row per batch), padding included.",
            int(h["padded_tokens"]))  # fmt: skip
    counter("bicodec_shm_reclaimed_slots_total", "Slots taken back from clients that died or gave up "
            "on a request (a timeout, a cancelled coroutine, Ctrl-C).", int(h["reclaimed"]))  # fmt: skip
    counter("bicodec_shm_idle_slots_expired_total",
            "Idle handles' warm slots freed after the reap interval (routine; not a leak).",
            int(h["expired"]))  # fmt: skip
    counter("bicodec_shm_dropped_answers_total",
            "Decoded rows left unanswered because their client freed the slot while it was being "
            "decoded (a client bug).", int(h["dropped"]))  # fmt: skip
    counter("bicodec_shm_lane_busy_seconds_total", "Time the decode lanes spent in the decoder, summed "
            "over lanes.", seconds["lane_busy_ns"])  # fmt: skip
    counter("bicodec_shm_host_gap_seconds_total", "Time a lane sat idle while decodable work waited "
            "for the host (gathering, planning, publishing).", seconds["host_gap_ns"])  # fmt: skip
    counter("bicodec_shm_dispatch_wait_seconds_total", "Time a lane held ready requests back on "
            "purpose, for its clients to come back or the batch to grow (not host gap).",
            seconds["waited_ns"])  # fmt: skip

    def time_histogram(metric: str, doc: str, bins: np.ndarray, total_s: float) -> None:
        cumulative = np.cumsum(np.asarray(bins, np.uint64)).tolist()
        buckets = [(_le(b), c) for b, c in zip(TIME_BUCKETS, cumulative[:-1])]
        buckets.append(("+Inf", cumulative[-1]))
        out.append(HistogramMetricFamily(metric, doc, buckets=buckets, sum_value=total_s))

    time_histogram("bicodec_shm_request_queue_time_seconds",
                   "Per decoded request: time from submission until its batch started.",
                   h["queue_hist"], seconds["queue_wait_ns"])  # fmt: skip
    time_histogram("bicodec_shm_request_latency_seconds",
                   "Per decoded request: time from submission until its result was published.",
                   h["latency_hist"], seconds["latency_ns"])  # fmt: skip
    time_histogram("bicodec_shm_batch_decode_time_seconds", "Per batch: time inside the decoder.",
                   h["decode_hist"], seconds["decode_ns"])  # fmt: skip
    out.append(batch_size_histogram(h["batch_hist"], max_batch=int(h["max_batch"])))

    owned = state != FREE
    gauge("bicodec_shm_slots", "Request slots in the segment.", int(h["n_slots"]))
    gauge("bicodec_shm_slots_owned", "Slots a client holds (every state but FREE).", int(owned.sum()))
    gauge("bicodec_shm_slots_ready", "Slots with a request waiting for a batch (READY).",
          int((state == READY).sum()))  # fmt: skip
    gauge("bicodec_shm_slots_busy", "Slots in a batch being decoded (BUSY).", int((state == BUSY).sum()))
    holders = handle_id[owned]
    gauge("bicodec_shm_attached_clients", "Client handles holding at least one slot (slots are claimed "
          "on demand; a quiet handle keeps one).", len(np.unique(holders[holders != 0])))  # fmt: skip
    gauge("bicodec_shm_lanes", "Decode lanes of the server.", int(h["lanes"]))
    gauge("bicodec_shm_lanes_busy", "Decode lanes running a batch right now.", int(h["busy_lanes"]))
    info = {"name": name, "version": version, "codec": codec_name(h), "max_batch": str(int(h["max_batch"])),
            "max_tokens": str(int(h["max_tokens"]))}  # fmt: skip
    out.append(InfoMetricFamily("bicodec_shm_server", "The server: segment name, package version, limits.",
                                value=info))  # fmt: skip
    return out


def batch_size_histogram(batch_hist: np.ndarray, *, max_batch: int) -> Any:
    """``bicodec_shm_batch_size`` from the header's ``batch_hist`` ((HIST_BINS,): bin b counts
    batches of b rows; the last bin, 64 rows or more).

    The last bin is exactly 64 rows when ``max_batch`` <= 64 and then counts toward le="64";
    with a larger ``max_batch`` its batches are only known to have 64 rows or more, so they
    count toward +Inf alone, and the ``_sum`` (total rows) counts each of them as 64 rows.
    """
    from prometheus_client.core import HistogramMetricFamily

    bins = np.asarray(batch_hist, np.uint64).astype(object)  # Python ints: no overflow, exact
    last = HIST_BINS - 1
    exact_last = max_batch <= last
    buckets = []
    for bound in BATCH_SIZE_BUCKETS:
        upto = min(bound, last) + 1 if (bound < last or exact_last) else last
        buckets.append((_le(bound), int(sum(bins[:upto]))))
    buckets.append(("+Inf", int(sum(bins))))
    rows = int(sum(b * n for b, n in enumerate(bins)))
    return HistogramMetricFamily("bicodec_shm_batch_size", "Per batch: rows decoded together.",
                                 buckets=buckets, sum_value=rows)  # fmt: skip


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client's own histograms write it (``1.0``, ``0.0025``)."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


class SegmentCollector:
    """A prometheus_client collector over a live ``Segment``: one snapshot per ``collect()``.

    ``close()`` guarantees that no scrape reads the segment afterwards (the server unmaps it).
    """

    def __init__(self, segment: Segment, *, version: str) -> None:
        self._segment = segment
        self._version = version
        self._lock = threading.Lock()
        self._closed = False

    def collect(self) -> Iterator[Any]:
        with self._lock:
            if self._closed:
                return
            seg = self._segment
            name = seg.name
            header = seg.header.copy()  # once: every number of this scrape comes from this copy
            state = seg.field["state"].copy()
            handle_id = seg.field["handle_id"].copy()
        yield from metric_families(header, state, handle_id, name=name, version=self._version)

    def close(self) -> None:
        with self._lock:
            self._closed = True


class MetricsExporter:
    """Serve ``/metrics`` for ``segment`` on ``host:port`` until ``close()``.

    Args:
        segment: the server's own segment (the live header and slot table are read from it).
        port: TCP port; 0 picks a free one (then read ``.port``).
        host: address to bind: "127.0.0.1" (the default) lets only this host scrape; "0.0.0.0"
            (every IPv4 interface) or "::" exposes the counters to the network, on purpose.

    Raises ``MissingExtraError`` without prometheus_client, and ``ValueError`` for a port out
    of range or one that cannot be bound (in use, or a bad host).
    """

    def __init__(self, segment: Segment, *, port: int, host: str = DEFAULT_HOST) -> None:
        prometheus_client = require_prometheus_client()
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be an integer in 0..65535 (0: any free port), got {port!r}")
        from prometheus_client.gc_collector import GCCollector
        from prometheus_client.platform_collector import PlatformCollector
        from prometheus_client.process_collector import ProcessCollector

        from .._version import __version__

        self.host = host
        self._collector = SegmentCollector(segment, version=__version__)
        # A registry of our own: the process-wide default one may hold an embedding app's metrics.
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(self._collector)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        from prometheus_client.exposition import choose_encoder

        def render(accept: str) -> tuple[bytes, str]:
            encoder, content_type = choose_encoder(accept)  # text, or OpenMetrics if asked
            return encoder(self.registry), content_type

        try:
            self._endpoint: MetricsEndpoint | None = MetricsEndpoint(host, port, render)
        except OSError as e:  # in use, not permitted, or an address this host does not have
            raise ValueError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
        self.port: int = self._endpoint.port
        log.info("metrics of %r on http://%s:%d/metrics", segment.name, host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop the endpoint and release the port (idempotent); the segment is not read after."""
        endpoint, self._endpoint = getattr(self, "_endpoint", None), None
        if endpoint is not None:
            endpoint.close()  # releases the port
        self._collector.close()  # a scrape already being answered finishes before this returns

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<MetricsExporter {self.url}>"
