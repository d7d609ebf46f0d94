"""Smoke test of benchmarks/bench_ipc.py: a few round trips of each transport, nothing left over."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from bicodec_shm.protocol.names import leftover_objects

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_ipc.py")


def _load_module():
    spec = importlib.util.spec_from_file_location("bench_ipc_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_bench_ipc_runs_end_to_end(tmp_path):
    out = tmp_path / "bench_ipc.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--iterations", "20", "--warmup", "2", "--rounds", "2",
         "--no-progress", "--clients", "4", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for row in ("semaphore floor", "bicodec-shm", "multiprocessing.Pipe", "multiprocessing.Queue ",
                "multiprocessing.Queue get(timeout) "):  # fmt: skip
        assert any(line.startswith(row) for line in lines), row
    for text in ("bicodec-shm median <=",
                 "fastest Queue round trip / bicodec-shm round trip at batch 1 >= 3x (multiprocessing.Queue",
                 "server CPU per request at batch 1 <= 30 us (1 client, avg batch",
                 "server CPU per request at batch 16 <= 20 us (16 clients, avg batch",
                 "x multiprocessing.Pipe's (", "plainly:"):  # fmt: skip
        assert text in proc.stdout, text
    report = json.loads(out.read_text())
    assert set(report["results"]) == {
        "semaphore floor", "bicodec-shm", "multiprocessing.Pipe", "multiprocessing.Queue",
        "multiprocessing.Queue get(timeout)"}  # fmt: skip
    for stats in report["results"].values():
        assert stats["n"] == 20
        assert 0 < stats["p10_us"] <= stats["median_us"] <= stats["p90_us"]
    comparison = report["comparison"]
    assert set(comparison["targets"]) == {"bicodec_shm_within_floor", "faster_than_queue",
                                          "server_cpu_at_batch_1", "server_cpu_at_batch_16"}  # fmt: skip
    # The Queue target is against the faster of the two Queue rows.
    med = {t: s["median_us"] for t, s in report["results"].items()}
    fastest = min(("multiprocessing.Queue", "multiprocessing.Queue get(timeout)"), key=med.get)
    assert comparison["fastest_queue"] == comparison["targets"]["faster_than_queue"]["queue"] == fastest
    assert set(comparison["plain"]) == {"vs_pipe", "vs_fastest_queue"}
    assert comparison["plain"]["vs_pipe"]["other"] == "multiprocessing.Pipe"
    assert report["bicodec_shm_server"]["avg_batch_size"] >= 1
    # The server's CPU per request at batch 1 and 16: in every run, even with --clients 4.
    cpu = report["server_cpu_per_request"]
    assert set(cpu) == {"batch_1", "batch_16"}
    assert cpu["batch_1"]["goal_us"] == 30 and cpu["batch_16"]["goal_us"] == 20
    for key in cpu:
        assert cpu[key]["server_cpu_us"] > 0 and cpu[key]["met"] in (True, False)
    assert cpu["batch_1"]["avg_batch_size"] == 1
    # The concurrent rows: every client's round trips, served in batches of up to K.
    rows = {r["clients"]: r for r in report["concurrent"]}
    assert set(rows) == {1, 4, 16}
    table_rows = {line.split()[0] for line in lines if line[:1].isdigit()}
    assert {"1", "4", "16"} <= table_rows
    for k, r in rows.items():
        assert r["n"] == k * max(1, 20 // k)
        assert r["server_requests"] >= r["n"] and 1 <= r["avg_batch_size"] <= k
        assert r["server_cpu_us"] > 0 and r["client_cpu_us"] > 0 and r["requests_per_s"] > 0
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]
    assert len(report["child_exitcodes"]["16 clients"]) == 17  # 16 clients and their server
    assert all(code == 0 for codes in report["child_exitcodes"].values() for code in codes)
    assert report["client_imported_torch"] is False
    assert len(report["loadavg_start"]) == len(report["loadavg_end"]) == 3
    assert "load average (1 min)" in proc.stdout
    assert report["shm_names"]
    for name in report["shm_names"]:
        assert leftover_objects(name) == []


def test_table_and_targets_from_numbers():
    bench = _load_module()
    stats = {
        bench.FLOOR: bench.summarize({"samples": [10e-6] * 5, "client_cpu_s": 5e-5}),
        bench.SHM: bench.summarize({"samples": [14e-6] * 5}),
        bench.PIPE: bench.summarize({"samples": [7e-6] * 5}),
        bench.QUEUE: bench.summarize({"samples": [60e-6] * 5}),
        bench.QUEUE_TIMEOUT: bench.summarize({"samples": [50e-6] * 5}),
    }
    concurrent = [
        bench.summarize_concurrent({"clients": 1, "samples": [1e-4] * 8, "wall_s": 0.0008,
                                    "client_cpu_s": 8e-5, "server_cpu_s": 8 * 35e-6,
                                    "server": {"requests": 8, "batches": 8}}),
        bench.summarize_concurrent({"clients": 16, "samples": [1e-3] * 32, "wall_s": 0.016,
                                    "client_cpu_s": 32e-5, "server_cpu_s": 32 * 18e-6,
                                    "server": {"requests": 32, "batches": 2}}),
    ]  # fmt: skip
    assert concurrent[1]["server_cpu_us"] == 18.0 and concurrent[1]["avg_batch_size"] == 16
    assert concurrent[1]["requests_per_s"] == 2000 and concurrent[1]["client_cpu_us"] == 10.0
    comparison = bench.compare(stats, concurrent)
    targets = comparison["targets"]
    assert targets["bicodec_shm_within_floor"]["met"] is True  # 1.4x <= 1.5x
    # Against the faster Queue row, whichever it is (here the one with a timeout).
    assert comparison["fastest_queue"] == bench.QUEUE_TIMEOUT
    assert abs(targets["faster_than_queue"]["measured"] - 50 / 14) < 1e-9
    assert targets["faster_than_queue"]["met"] is True
    assert targets["server_cpu_at_batch_16"]["measured"] == 18.0
    assert targets["server_cpu_at_batch_16"]["met"] is True  # 18 us <= 20 us
    assert abs(targets["server_cpu_at_batch_1"]["measured"] - 35.0) < 1e-9
    assert targets["server_cpu_at_batch_1"]["met"] is False  # 35 us > 30 us
    assert abs(comparison["plain"]["vs_pipe"]["shm_over_other"] - 2.0) < 1e-9
    table = bench.format_table(stats, comparison, concurrent=concurrent)
    assert "1.40x" in table and "18.00 us  met" in table and "35.00 us  NOT MET" in table
    assert "is 2.00x multiprocessing.Pipe's (7 us): multiprocessing.Pipe is faster" in table
    assert stats[bench.FLOOR]["client_cpu_us"] == 10.0
    summary = bench.server_cpu_summary(concurrent)
    assert summary["batch_1"]["met"] is False and summary["batch_16"]["met"] is True
    # Without the 1- and 16-client rows there are no lines for those targets.
    assert not {"server_cpu_at_batch_1", "server_cpu_at_batch_16"} & set(
        bench.compare(stats, concurrent=[])["targets"])
    assert bench.server_cpu_summary([])["batch_16"]["server_cpu_us"] is None


def test_queue_row_without_timeout_ends_when_its_child_dies():
    """The bare-get() Queue row has no timeout: a dead echo child must raise, not hang."""
    import multiprocessing as mp
    import threading

    bench = _load_module()
    requests = bench.make_requests(2)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            with bench.queue_peer(mp.get_context("spawn")) as peer:
                bench._check_reply(bench.QUEUE, peer.roundtrip(requests[0]))
                peer.children[0].kill()
                peer.children[0].join()
                peer.roundtrip(requests[1])  # the request may go nowhere: the marker answers
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "a bare get() hung after its child died"
    assert isinstance(outcome[0], RuntimeError) and "exited" in str(outcome[0])
