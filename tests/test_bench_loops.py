"""benchmarks/bench_loops.py: the example loops side by side, each shared row with its ratios to
the own-decoder row of the same worker count, one table and JSON; a short real run of one loop
(real worker processes and a real server) and the ratio arithmetic on given rows."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_loops.py")
_spec = importlib.util.spec_from_file_location("bench_loops", SCRIPT)
bench_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_loops)


def _row(mode: str, streams: int, audio: float, p95: float, late: int = 0) -> dict:
    return {"mode": mode, "streams": streams, "threads": 1, "utterances": 2, "ttfa_p50_ms": p95 / 2,
            "ttfa_p95_ms": p95, "ttfa_max_ms": p95, "audio_s_per_s": audio, "late_chunks": late,
            "chunks": 4}  # fmt: skip


def test_each_shared_row_is_divided_by_the_own_row_of_its_worker_count():
    rows = bench_loops.ratios([_row("own", 1, 2.0, 100), _row("shared", 1, 1.0, 400),
                               _row("own", 4, 4.0, 200), _row("shared", 4, 6.0, 100)])  # fmt: skip
    assert "vs_own" not in rows[0] and "vs_own" not in rows[2]
    assert rows[1]["vs_own"] == {"audio_s_per_s": 0.5, "ttfa_p95": 4.0}
    assert rows[3]["vs_own"] == {"audio_s_per_s": 1.5, "ttfa_p95": 0.5}
    text = bench_loops.table([{"loop": "qwen3_tts", "size": "tiny", "rows": rows}])
    assert "0.50x" in text and "1.50x" in text and "4.00x" in text


@pytest.mark.parametrize("streams, own, shared, met", [
    (16, (10.0, 100, 3), (10.0, 100, 3), True),   # level on all three
    (16, (10.0, 100, 3), (9.9, 90, 0), False),    # less audio per second
    (16, (10.0, 100, 3), (11.0, 101, 0), False),  # a longer TTFA p95
    (16, (10.0, 100, 3), (11.0, 90, 4), False),   # one more late chunk
    (1, (10.0, 100, 0), (9.6, 104, 0), True),     # one worker: within 5 %
    (1, (10.0, 100, 0), (9.4, 100, 0), False),
    (1, (10.0, 100, 0), (10.0, 106, 0), False),
])  # fmt: skip
def test_a_paired_run_meets_the_criterion_only_on_every_count(streams, own, shared, met):
    rows = bench_loops.ratios([_row("own", streams, *own), _row("shared", streams, *shared)])
    assert bench_loops.meets(rows[1], rows[0]) is met


def test_repeats_are_summarised_per_loop_and_worker_count_as_medians_and_ranges():
    runs = [  # three paired runs at 16 workers; the second misses on late chunks
        [_row("own", 16, 10.0, 100, 3), _row("shared", 16, 11.0, 90, 2)],
        [_row("own", 16, 10.0, 100, 3), _row("shared", 16, 12.0, 80, 9)],
        [_row("own", 16, 10.0, 100, 5), _row("shared", 16, 10.0, 100, 5)],
    ]
    cells = [{"loop": "orpheus_tts", "size": "tiny", "repeat": i, "rows": bench_loops.ratios(rows)}
             for i, rows in enumerate(runs)]  # fmt: skip
    group, = bench_loops.repeated(cells)
    assert (group["loop"], group["streams"], group["runs"], group["meets"]) == ("orpheus_tts", 16, 3, 2)
    assert group["audio_vs_own"] == {"median": 1.1, "min": 1.0, "max": 1.2}
    assert group["p95_vs_own"] == {"median": 0.9, "min": 0.8, "max": 1.0}
    assert (group["late_own"], group["late_shared"]) == (3, 5)
    text = bench_loops.repeated_table([group])
    assert "1.10x (1.00-1.20)" in text and "0.90x (0.80-1.00)" in text and "2/3" in text


def test_the_second_own_row_of_a_worker_count_is_its_control_judged_like_the_shared_one():
    rows = bench_loops.label_controls([_row("own", 4, 10.0, 100), _row("shared", 4, 10.0, 99),
                                       _row("own", 4, 9.9, 101), _row("own", 16, 5.0, 80)])  # fmt: skip
    assert [r["mode"] for r in rows] == ["own", "shared", "control", "own"]
    rows = bench_loops.ratios(rows)
    assert rows[2]["vs_own"] == {"audio_s_per_s": pytest.approx(0.99), "ttfa_p95": pytest.approx(1.01)}
    assert bench_loops.meets(rows[1], rows[0]) and not bench_loops.meets(rows[2], rows[0])


def test_repeats_count_how_often_the_control_met_the_criterion_beside_the_shared_server():
    runs = [  # the control (own again) meets by chance in the second run only
        [_row("own", 4, 10.0, 100), _row("shared", 4, 10.0, 99), _row("own", 4, 9.9, 100)],
        [_row("own", 4, 10.0, 100), _row("shared", 4, 10.1, 98), _row("own", 4, 10.0, 100)],
        [_row("own", 4, 10.0, 100), _row("shared", 4, 10.0, 101), _row("own", 4, 10.0, 102)],
    ]
    cells = [{"loop": "orpheus_tts", "size": "tiny", "repeat": i,
              "rows": bench_loops.ratios(bench_loops.label_controls(rows))}
             for i, rows in enumerate(runs)]  # fmt: skip
    group, = bench_loops.repeated(cells)
    assert (group["meets"], group["control_meets"], group["control_runs"]) == (2, 1, 3)
    assert group["p95_vs_own"]["max"] == pytest.approx(1.01)  # the controls are not the shared rows
    header, _, line = bench_loops.repeated_table([group]).splitlines()
    assert header.endswith("control meets") and line.split()[-2:] == ["2/3", "1/3"]
    plain = {**group, "control_runs": 0, "control_meets": 0}
    assert "control" not in bench_loops.repeated_table([plain])


@pytest.mark.parametrize("workers, utterances, min_samples, each", [
    (1, 3, 32, 32), (4, 3, 32, 8), (16, 3, 32, 3), (32, 3, 32, 3), (5, 1, 32, 7), (2, 4, 0, 4),
])  # fmt: skip
def test_fewer_workers_run_more_utterances_so_that_every_cell_has_enough_first_chunks(
        workers, utterances, min_samples, each):  # fmt: skip
    assert bench_loops.utterances_for(workers, utterances, min_samples) == each
    assert workers * each >= min_samples


@pytest.mark.parametrize("ratio, shown",
                         [(1.04, "~1.04x"), (0.96, "~0.96x"), (1.06, "1.06x"), (0.5, "0.50x")])  # fmt: skip
def test_a_ratio_within_the_noise_of_one_is_marked(ratio, shown):
    assert bench_loops.ratio_text(ratio) == shown


def test_a_short_run_of_one_loop_gives_both_modes_with_every_core_and_the_control(tmp_path):
    out = tmp_path / "loops.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--loops", "qwen3_tts", "--workers", "2",
                           "--utterances", "1", "--min-samples", "4", "--control",
                           "--example-args", "--rate 2000 --frames 8",
                           "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "qwen3_tts tiny: workers [2], 2 utterances each" in proc.stderr and "audio vs own" in proc.stdout
    cell, = json.loads(out.read_text())["cells"]
    own, shared, control = cell["rows"]
    assert control["mode"] == "control"
    assert (control["threads"], control["audio_s"]) == (own["threads"], own["audio_s"])
    assert control["vs_own"]["ttfa_p95"] == pytest.approx(control["ttfa_p95_ms"] / own["ttfa_p95_ms"])
    cores = os.cpu_count()
    assert (own["mode"], own["threads"]) == ("own", max(1, cores // 2))
    assert (shared["mode"], shared["threads"]) == ("shared", cores)
    assert own["utterances"] == shared["utterances"] == 4  # 2 workers x 2: the 4 samples asked for
    assert own["audio_s"] == shared["audio_s"] == pytest.approx(4 * 8 * 1920 / 24000)
    assert shared["vs_own"]["audio_s_per_s"] == pytest.approx(shared["audio_s_per_s"] / own["audio_s_per_s"])
