"""Prometheus metrics (``serve --metrics-port``): scraped over HTTP during and after real load,
checked against the requests sent and against ``bicodec-shm stats`` of the same header."""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import ROOT
from support import SteppedDecoder, listening_port, reference_model, wait_for

import bicodec_shm
from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.errors import MissingExtraError
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.layout import FREE, HEADER_DT, HIST_BINS, NO_BELL, TIME_BUCKETS, SlotState, Status
from bicodec_shm.protocol.names import ServerState, leftover_objects, probe
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.server.metrics import batch_size_histogram, metric_families
from bicodec_shm.server.server import DecoderServer
from bicodec_shm.tools.cli import main

NEEDS_EXTRA = 'the metrics tests need the [metrics] extra: pip install -e ".[metrics]"'
# Counters of a scrape and the `stats_from_header` key each one must equal.
COUNTER_STATS = {
    "bicodec_shm_requests_total": "requests",
    "bicodec_shm_batches_total": "batches",
    "bicodec_shm_decoded_tokens_total": "tokens",
    "bicodec_shm_padded_tokens_total": "padded_tokens",
    "bicodec_shm_reclaimed_slots_total": "reclaimed",
    "bicodec_shm_idle_slots_expired_total": "idle_slots_expired",
    "bicodec_shm_dropped_answers_total": "dropped_answers",
}
# Histograms and the header bins (and nanosecond sum) each one is made of.
TIME_HISTOGRAMS = {
    "bicodec_shm_request_queue_time_seconds": ("queue_hist", "queue_wait_ns"),
    "bicodec_shm_request_latency_seconds": ("latency_hist", "latency_ns"),
    "bicodec_shm_batch_decode_time_seconds": ("decode_hist", "decode_ns"),
}
BAD_REQUESTS = [  # (raw slot fields, the status the server must answer with)
    (dict(semantic=[1, 2, 9000]), Status.BAD_SEMANTIC_ID),
    (dict(n_tokens=0), Status.BAD_LENGTH),
    (dict(n_global=31), Status.BAD_GLOBAL),
    (dict(semantic=[8192]), Status.BAD_SEMANTIC_ID),
]


@pytest.fixture
def parser():
    pytest.importorskip("prometheus_client", reason=NEEDS_EXTRA)
    from prometheus_client.parser import text_string_to_metric_families

    return text_string_to_metric_families


def _scrape(parser, url: str) -> dict:
    """GET ``url`` and parse it: {(sample name, frozenset(labels)): value}, plus the types."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        body = response.read().decode()
    samples: dict = {}
    for family in parser(body):
        for s in family.samples:
            samples[s.name, frozenset(s.labels.items())] = s.value
        samples["TYPE", family.name] = family.type
    return samples


def _scrape_when_up(parser, url: str, timeout: float = 20.0) -> dict:
    # The endpoint starts just after the SERVING lock that start_server waits for.
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _scrape(parser, url)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _get(samples: dict, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def samples_type(samples: dict) -> dict:
    """{family name: type} of the bicodec_shm_ families of a scrape."""
    return {name: kind for (key, name), kind in samples.items()
            if key == "TYPE" and name.startswith("bicodec_shm")}  # fmt: skip


def _histogram(samples: dict, name: str, bounds) -> tuple[list[float], float, float]:
    """(cumulative bucket values incl. +Inf, _count, _sum); checks the shape of the family."""
    les = [repr(float(b)) for b in bounds] + ["+Inf"]
    buckets = [_get(samples, f"{name}_bucket", le=le) for le in les]
    assert buckets == sorted(buckets), (name, buckets)  # cumulative
    count = _get(samples, f"{name}_count")
    assert buckets[-1] == count, name
    assert samples["TYPE", name] == "histogram"
    return buckets, count, _get(samples, f"{name}_sum")


class _RawSlot:
    """Writes requests straight into one slot, as a buggy client could: the server must count
    what it refuses (a well-behaved client refuses bad ids before they reach the server)."""

    def __init__(self, name: str) -> None:
        self.seg = Segment.attach(name)
        free = np.flatnonzero(self.seg.slots["state"] == FREE).tolist()
        self.slot = next(i for i in free if self.seg.try_lock_slot(i))
        self.seg.slots["state"][self.slot] = SlotState.CLAIMED  # handle_id stays 0: no client

    def send(self, fields: dict) -> int:
        s, i = self.seg.slots, self.slot
        self.seg.tokens[i, :10] = 5
        self.seg.globals[i] = 5
        semantic = fields.get("semantic", [5] * 10)
        self.seg.tokens[i, : len(semantic)] = semantic
        values = dict(n_tokens=len(semantic), n_global=32, dtype=0, notify=NO_BELL, status=0,
                      req_generation=int(s["generation"][i]), request_seq=77)  # fmt: skip
        values.update((k, v) for k, v in fields.items() if k in values)
        for k, v in values.items():
            s[k][i] = v
        s["state"][i] = SlotState.READY
        self.seg.req(i).release()
        self.seg.ready.release()
        assert self.seg.done(i).acquire(20) is None
        assert int(s["result_seq"][i]) == 77
        s["state"][i] = SlotState.CLAIMED
        return int(s["status"][i])

    def close(self) -> None:
        self.seg.close()


def _client_that_dies(name: str) -> int:
    """A client process decodes one 20-token request, takes a slot for its next one and is
    SIGKILLed holding it (idle, it would have let its slot go: an expiry, not a reclaim)."""
    code = (
        "import os, signal; from bicodec_shm.client.decoder_client import DecoderClient; "
        f"c = DecoderClient({name!r}); c.decode([1] * 20, [0] * 32); "
        "c._att.take_slot(float('inf')); os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    return 20


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_scrapes_during_and_after_load_match_the_requests_and_stats(start_server, shm_name, parser):
    # Port 0: the server binds a free port itself (no race for a number chosen ahead); the
    # kernel tells which one.
    proc = start_server("--metrics-port", "0", "--metrics-host", "127.0.0.1")
    url = f"http://127.0.0.1:{listening_port(proc.pid, proc=proc)}/metrics"

    idle = _scrape_when_up(parser, url)
    assert _get(idle, "bicodec_shm_requests_total") == 0
    for status in Status:
        if status != Status.OK:  # every status is exported from the start, at 0
            assert _get(idle, "bicodec_shm_request_failures_total", status=status.name) == 0
    info = {k: v for (n, labels), _ in idle.items() if n == "bicodec_shm_server_info" for k, v in labels}
    assert info["name"] == shm_name and info["version"] == bicodec_shm.__version__
    assert samples_type(idle) == {
        "bicodec_shm_requests": "counter", "bicodec_shm_request_failures": "counter",
        "bicodec_shm_batches": "counter", "bicodec_shm_decoded_tokens": "counter",
        "bicodec_shm_padded_tokens": "counter", "bicodec_shm_reclaimed_slots": "counter",
        "bicodec_shm_idle_slots_expired": "counter", "bicodec_shm_dropped_answers": "counter",
        "bicodec_shm_lane_busy_seconds": "counter", "bicodec_shm_host_gap_seconds": "counter",
        "bicodec_shm_dispatch_wait_seconds": "counter",
        "bicodec_shm_request_queue_time_seconds": "histogram",
        "bicodec_shm_request_latency_seconds": "histogram",
        "bicodec_shm_batch_decode_time_seconds": "histogram", "bicodec_shm_batch_size": "histogram",
        "bicodec_shm_slots": "gauge", "bicodec_shm_slots_owned": "gauge", "bicodec_shm_slots_ready": "gauge",
        "bicodec_shm_slots_busy": "gauge", "bicodec_shm_attached_clients": "gauge",
        "bicodec_shm_lanes": "gauge", "bicodec_shm_lanes_busy": "gauge", "bicodec_shm_server_info": "gauge",
    }  # fmt: skip

    # One request from a client that is then killed: its slot must be reclaimed.
    died_tokens = _client_that_dies(shm_name)
    _wait_for(lambda: stats_from_header(read_header(shm_name))["reclaimed"] == 1)

    rng = np.random.default_rng(12)
    done: list[int] = []  # lengths of the requests decoded under load
    stop = threading.Event()
    client = DecoderClient(shm_name, timeout=60)
    raw = _RawSlot(shm_name)

    def load() -> None:
        while not stop.is_set():
            n = int(rng.integers(5, 60))
            client.decode(rng.integers(0, 8192, n), rng.integers(0, 4096, 32))
            done.append(n)

    threads = [threading.Thread(target=load) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        _wait_for(lambda: len(done) >= 10)
        for fields, status in BAD_REQUESTS:
            assert raw.send(fields) == status

        during = []
        for _ in range(2):
            # Each load thread may hold an answer that its lane has not counted yet (it rings
            # the clients first): up to 3 of those are not in the counters yet.
            decoded_before = len(done) - len(threads)
            raw0 = read_header(shm_name)
            scrape = _scrape(parser, url)
            raw1 = read_header(shm_name)
            during.append(scrape)
            # The scrape copied the header between these two reads. Reads are not paired with the
            # server's writes, so two fields of one copy may be a batch apart; but each field only
            # grows, so every counter and every bucket is sandwiched between the two reads.
            h0, h1 = stats_from_header(raw0), stats_from_header(raw1)
            for metric, key in COUNTER_STATS.items():
                assert h0[key] <= _get(scrape, metric) <= h1[key], metric
            assert h0["failed"] == h1["failed"] == len(BAD_REQUESTS)
            assert _get(scrape, "bicodec_shm_requests_total") >= decoded_before + 1 + len(BAD_REQUESTS)
            for name, (bins, _) in TIME_HISTOGRAMS.items():
                buckets, _, _ = _histogram(scrape, name, TIME_BUCKETS)
                low, high = np.cumsum(raw0[bins]), np.cumsum(raw1[bins])
                assert (low <= buckets).all() and (buckets <= high).all(), name
            _, batches, _ = _histogram(scrape, "bicodec_shm_batch_size", (1, 2, 4, 8, 16, 32, 64))
            assert raw0["batch_hist"].sum() <= batches <= raw1["batch_hist"].sum()
            assert _get(scrape, "bicodec_shm_attached_clients") == 1  # the raw slot has no client
            assert 2 <= _get(scrape, "bicodec_shm_slots_owned") <= 2 + 3
            assert 0 <= _get(scrape, "bicodec_shm_slots_busy") <= 3
            assert 0 <= _get(scrape, "bicodec_shm_lanes_busy") <= _get(scrape, "bicodec_shm_lanes")
            after_scrape = len(done)
            _wait_for(lambda n=after_scrape: len(done) > n)  # the load went on past the scrape
        for metric in COUNTER_STATS:
            assert _get(during[0], metric) <= _get(during[1], metric)
        assert _get(during[1], "bicodec_shm_requests_total") > _get(during[0], "bicodec_shm_requests_total")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        client.close()

    # After the load: exact equality with what was sent, and with `stats --json`. A lane rings
    # its clients before it counts the batch and marks itself finished: wait for both.
    settled = len(done) + 1 + len(BAD_REQUESTS)
    _wait_for(lambda: (lambda h: int(h["requests"]) == settled and int(h["busy_lanes"]) == 0)(
        read_header(shm_name)))
    try:
        after = _scrape(parser, url)
        out = subprocess.run([sys.executable, "-m", "bicodec_shm", "stats", shm_name, "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        stats = json.loads(out.stdout)
        header = read_header(shm_name)
        slot_states = raw.seg.slots["state"].copy()
    finally:
        raw.close()
    decoded = len(done) + 1
    # Nothing moved between the scrape and `stats`: the same header, read twice.
    slots = {k: stats.pop(k) for k in ("owned", "ready", "busy", "attached_clients")}
    expected = {**stats_from_header(header), "server_alive": True, "state": "serving"}
    assert stats == json.loads(json.dumps(expected))
    assert slots["owned"] == _get(after, "bicodec_shm_slots_owned")
    assert slots["attached_clients"] == _get(after, "bicodec_shm_attached_clients")
    assert _get(after, "bicodec_shm_requests_total") == stats["requests"] == decoded + len(BAD_REQUESTS)
    for status in Status:
        if status != Status.OK:
            expected = sum(s == status for _, s in BAD_REQUESTS)
            assert _get(after, "bicodec_shm_request_failures_total", status=status.name) == expected
            assert stats["failed_by_status"].get(status.name, 0) == expected
    assert _get(after, "bicodec_shm_decoded_tokens_total") == stats["tokens"] == sum(done) + died_tokens
    for metric, key in COUNTER_STATS.items():
        assert _get(after, metric) == stats[key], metric
    assert stats["reclaimed"] == 1
    for name, (bins, total_ns) in TIME_HISTOGRAMS.items():
        buckets, count, total = _histogram(after, name, TIME_BUCKETS)
        assert buckets == np.cumsum(header[bins]).tolist(), name
        assert count == (stats["batches"] if bins == "decode_hist" else decoded), name
        assert total == int(header[total_ns]) / 1e9, name
    sizes, batches, rows = _histogram(after, "bicodec_shm_batch_size", (1, 2, 4, 8, 16, 32, 64))
    assert batches == stats["batches"] and rows == decoded  # every decoded request was one row
    assert rows == pytest.approx(stats["avg_batch_size"] * stats["batches"])
    hist = stats["batch_size_histogram"]
    assert sizes[:3] == [hist.get("1", 0), hist.get("1", 0) + hist.get("2", 0),
                         sum(n for b, n in hist.items() if int(b) <= 4)]  # fmt: skip
    assert _get(after, "bicodec_shm_lane_busy_seconds_total") == int(header["lane_busy_ns"]) / 1e9
    # Gauges at rest: the client's warm slot was given back at close, the raw slot is still held.
    assert _get(after, "bicodec_shm_slots") == stats["slots"]
    assert _get(after, "bicodec_shm_slots_owned") == int((slot_states != FREE).sum()) == 1
    assert _get(after, "bicodec_shm_attached_clients") == 0
    assert _get(after, "bicodec_shm_slots_ready") == _get(after, "bicodec_shm_slots_busy") == 0
    assert _get(after, "bicodec_shm_lanes") == stats["lanes"]
    assert _get(after, "bicodec_shm_lanes_busy") == stats["busy_lanes"] == 0


def test_a_known_sequence_of_batches_gives_known_counters_and_buckets(thread_server, shm_name, parser):
    """Expected values from what the test did, not from the exporter's formulas: three batches
    of known rows and lengths, held at the decoder for known times.

    a (12 tokens) runs alone and is held HOLD s; b (7) runs alone and is released at once, after
    four more requests (5, 17, 30, 9 tokens) are queued behind it; those four then run as one
    batch, held HOLD s. So: padded tokens 12 + 7 + 4·30, batch sizes 1, 1, 4; every request
    queued well under 1 s; a and the four took over 1 s from submit to answer, b well under."""
    hold, bound = 1.05, "1.0"  # seconds held; the bucket bound that separates held from not
    decoder = SteppedDecoder()
    server = thread_server(decoder, max_batch=8, max_batch_tokens=None, min_fill=0.0, lanes=1,
                           max_wait_ms=0, rejoin_ms=0, metrics_port=0, metrics_host="127.0.0.1",
                           batching="static")  # fmt: skip
    lengths = {"a": 12, "b": 7, "c": 5, "d": 17, "e": 30, "f": 9}
    rng = np.random.default_rng(4)
    with DecoderClient(shm_name, slots=6) as client:

        def send(key: str) -> threading.Thread:
            ids = rng.integers(0, 8192, lengths[key]), rng.integers(0, 4096, 32)
            thread = threading.Thread(target=client.decode, args=ids)
            thread.start()
            return thread

        a = send("a")
        decoder.wait_entered(1)
        time.sleep(hold)  # how long a is held: a duration under test, not an ordering
        decoder.step()
        a.join(30)
        b = send("b")
        decoder.wait_entered(2)
        rest = [send(k) for k in "cdef"]
        states = server.segment.slots["state"]
        wait_for(lambda: int((states == SlotState.READY).sum()) == 4, what="four queued requests")
        decoder.step()
        decoder.wait_entered(3)
        time.sleep(hold)
        decoder.step()
        for t in [b, *rest]:
            t.join(30)
        assert not any(t.is_alive() for t in [a, b, *rest])
        samples = _scrape(parser, server.metrics.url)
    assert decoder.calls == [1, 1, 4]
    assert _get(samples, "bicodec_shm_requests_total") == 6
    assert _get(samples, "bicodec_shm_batches_total") == 3
    assert _get(samples, "bicodec_shm_decoded_tokens_total") == sum(lengths.values()) == 80
    assert _get(samples, "bicodec_shm_padded_tokens_total") == 12 + 7 + 4 * 30
    sizes, batches, rows = _histogram(samples, "bicodec_shm_batch_size", (1, 2, 4, 8, 16, 32, 64))
    assert (sizes, batches, rows) == ([2, 2, 3, 3, 3, 3, 3, 3], 3, 6)

    def under(name: str) -> float:  # how many fell at or under the bound
        return _get(samples, f"{name}_bucket", le=bound)

    assert under("bicodec_shm_request_queue_time_seconds") == 6
    assert under("bicodec_shm_request_latency_seconds") == 1  # b
    assert under("bicodec_shm_batch_decode_time_seconds") == 1  # b's batch
    assert _get(samples, "bicodec_shm_request_latency_seconds_sum") > 5 * hold
    assert _get(samples, "bicodec_shm_request_queue_time_seconds_sum") < 6 * 1.0


def test_port_zero_picks_a_free_port_that_close_releases(thread_server, shm_name, parser):
    server = thread_server(metrics_port=0, metrics_host="127.0.0.1")
    port = server.metrics.port
    assert port > 0 and server.metrics.url == f"http://127.0.0.1:{port}/metrics"
    with DecoderClient(shm_name) as client:
        client.decode([3] * 30, [1] * 32)
        samples = _scrape(parser, server.metrics.url)
        assert _get(samples, "bicodec_shm_requests_total") == 1
        assert _get(samples, "bicodec_shm_decoded_tokens_total") == 30
        assert _get(samples, "bicodec_shm_attached_clients") == 1
        assert _get(samples, "bicodec_shm_slots_owned") == 1
        assert any(n == "process_resident_memory_bytes" for n, _ in samples)  # the standard ones too
    server.close()
    assert server.metrics is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_an_idle_handles_expired_warm_slot_is_exported_apart_from_reclaimed_slots(thread_server, shm_name,
                                                                                  parser):  # fmt: skip
    server = thread_server(metrics_port=0, metrics_host="127.0.0.1", reap_interval=0.1)
    seg = server.segment
    with DecoderClient(shm_name) as client:
        client.decode([3] * 30, [1] * 32)  # then idle: its one slot let go of, warm
        wait_for(lambda: (seg.slots["state"] == FREE).all(), 10, "the warm slot to expire")
        samples = _scrape(parser, server.metrics.url)
    assert _get(samples, "bicodec_shm_idle_slots_expired_total") == 1
    assert _get(samples, "bicodec_shm_reclaimed_slots_total") == 0
    assert _get(samples, "bicodec_shm_attached_clients") == 0  # expired: the handle holds nothing


def test_a_port_in_use_is_a_clear_error_and_leaves_nothing_behind(shm_name, parser):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            DecoderServer(reference_model(), shm_name, metrics_port=port, metrics_host="127.0.0.1")
    assert probe(shm_name) is ServerState.ABSENT and leftover_objects(shm_name) == []
    with pytest.raises(ValueError, match="0..65535"):
        DecoderServer(reference_model(), shm_name, metrics_port=70000)
    assert leftover_objects(shm_name) == []


def test_without_prometheus_client_the_error_says_what_to_install(shm_name, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # `import prometheus_client` fails
    with pytest.raises(MissingExtraError, match=r'pip install "bicodec-shm\[metrics\]"') as info:
        DecoderServer(reference_model(), shm_name, metrics_port=0)
    assert isinstance(info.value, ImportError)
    assert probe(shm_name) is ServerState.ABSENT and leftover_objects(shm_name) == []

    code = main(["serve", "--preset", "tiny", "--seed", "0", "--threads", "1", "--name", shm_name,
                 "--metrics-port", "0"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    # One line, before any model is loaded.
    assert err == ('bicodec-shm: error: metrics need prometheus_client, the [metrics] extra: '
                   'pip install "bicodec-shm[metrics]"\n')  # fmt: skip
    assert leftover_objects(shm_name) == []


def test_batch_size_buckets_are_cumulative_and_the_last_bin_is_honest(parser):
    bins = np.zeros(HIST_BINS, np.uint64)
    bins[1], bins[3], bins[16], bins[40], bins[64] = 5, 2, 1, 1, 3  # batches of 1, 3, 16, 40, >=64 rows

    def buckets(max_batch):
        (family,) = [batch_size_histogram(bins, max_batch=max_batch)]
        le = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
        (total,) = [s.value for s in family.samples if s.name.endswith("_sum")]
        return [le[k] for k in ("1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "64.0", "+Inf")], total

    # max_batch <= 64: the last bin is exactly 64 rows.
    assert buckets(64) == ([5, 5, 7, 7, 8, 8, 12, 12], 5 + 6 + 16 + 40 + 3 * 64)
    # max_batch > 64: batches in the last bin may be larger, so only +Inf counts them.
    assert buckets(128)[0] == [5, 5, 7, 7, 8, 8, 9, 12]


def test_unknown_status_codes_are_exported_not_dropped(parser):
    header = np.zeros((), HEADER_DT)
    header["failed_by_status"][Status.BAD_DTYPE] = 2
    header["failed_by_status"][15] = 1  # the catch-all bin of codes this version does not know
    header["failed"] = 3
    state = np.array([FREE, SlotState.READY, SlotState.BUSY, SlotState.DONE], np.uint32)
    handles = np.array([0, 7, 7, 9], np.uint64)
    families = {f.name: f for f in metric_families(header, state, handles, name="x", version="v")}
    failures = {s.labels["status"]: s.value for s in families["bicodec_shm_request_failures"].samples}
    assert failures["BAD_DTYPE"] == 2 and failures["CODE_15"] == 1 and "OK" not in failures
    assert sum(failures.values()) == header["failed"]
    assert families["bicodec_shm_attached_clients"].samples[0].value == 2  # handles 7 and 9
    assert families["bicodec_shm_slots_owned"].samples[0].value == 3
    assert families["bicodec_shm_slots_ready"].samples[0].value == 1
    assert families["bicodec_shm_slots_busy"].samples[0].value == 1


def test_importing_the_package_does_not_import_prometheus_client():
    out = subprocess.run([sys.executable, "-c", "import sys, bicodec_shm.server.metrics, "
                          "bicodec_shm.tools.cli, "
                          "bicodec_shm.server.server; print('prometheus_client' in sys.modules)"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr


def test_the_endpoint_binds_the_loopback_unless_told_otherwise(thread_server, shm_name, parser):
    import psutil

    from bicodec_shm.server.metrics import MetricsExporter
    from bicodec_shm.tools.cli import _parser

    def bound_addresses(port: int) -> list[str]:
        return [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port]  # fmt: skip

    server = thread_server(metrics_port=0)
    port = server.metrics.port
    assert bound_addresses(port) == ["127.0.0.1"]
    assert server.metrics.url == f"http://127.0.0.1:{port}/metrics"
    assert _get(_scrape(parser, server.metrics.url), "bicodec_shm_requests_total") == 0
    with MetricsExporter(server.segment, port=0) as exporter:  # the class's own default too
        assert bound_addresses(exporter.port) == ["127.0.0.1"]
    assert _parser().parse_args(["serve"]).metrics_host == "127.0.0.1"


# The endpoint's documented bounds (docs/metrics.md): a request must arrive whole within 5 s, and
# at most 64 connections are open at once.
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset), without waiting."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionError:
        return True


def test_half_sent_requests_cost_no_thread_time_out_and_leave_room_for_a_scrape(thread_server, parser):
    server = thread_server(metrics_port=0)
    url, port = server.metrics.url, server.metrics.port
    _scrape(parser, url)
    baseline = threading.active_count()
    flood = []
    try:
        for _ in range(80):  # raw sockets to the loopback only
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: half-sent
            flood.append(sock)
        # The oldest beyond the bound are closed at once; the rest cost a socket each, no thread.
        wait_for(lambda: sum(map(_closed_by_peer, flood)) >= len(flood) - MAX_CONNECTIONS, 3,
                 "the oldest idle connections to be closed")  # fmt: skip
        assert threading.active_count() <= baseline
        started = time.monotonic()
        assert _get(_scrape(parser, url), "bicodec_shm_slots") > 0  # answered during the flood
        assert time.monotonic() - started < 2
        # Every half-sent request is dropped once its time is up, and no thread stays behind.
        deadline = time.monotonic() + REQUEST_TIMEOUT_S + 5
        while not all(map(_closed_by_peer, flood)):
            still_open = len(flood) - sum(map(_closed_by_peer, flood))
            assert time.monotonic() < deadline, f"{still_open} half-sent requests still open"
            time.sleep(0.05)
        wait_for(lambda: threading.active_count() <= baseline + 1, 3, "the thread count to return")
    finally:
        for sock in flood:
            sock.close()


def test_a_request_sent_a_byte_at_a_time_cannot_stretch_its_timeout(thread_server, parser):
    server = thread_server(metrics_port=0)
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", server.metrics.port), timeout=5) as sock:
        started, closed = time.monotonic(), False
        for byte in request:  # 24 s of drip, unless the server ends it
            try:
                sock.sendall(bytes([byte]))
            except ConnectionError:
                closed = True
            closed = closed or _closed_by_peer(sock)
            if closed:
                break
            time.sleep(0.1)  # 1 byte per 0.1 s: each well inside any idle timeout
        assert closed, "the server let a dripping request run past its timeout"
        assert time.monotonic() - started < REQUEST_TIMEOUT_S + 3
    assert _get(_scrape(parser, server.metrics.url), "bicodec_shm_slots") > 0
