"""The CLI, called in-process: serve, stats --json, demo, cleanup."""

from __future__ import annotations

import json
import os
import signal
import threading

import numpy as np
import pytest
from conftest import wait_until_serving
from support import seed_int16, single_decode

from bicodec_shm.cli import main
from bicodec_shm.client import DecoderClient
from bicodec_shm.transport import Segment, leftover_objects


def test_serve_then_stats_json_then_sigterm(shm_name, capsys):
    seen = {}

    def drive():
        try:
            wait_until_serving(shm_name, timeout=60)
            sem, glb = list(range(40)), list(range(32))
            with DecoderClient(shm_name) as client:
                seen["pcm"] = client.decode(sem, glb)
            seen["stats_rc"] = main(["stats", shm_name, "--json"])
            seen["table_rc"] = main(["stats", shm_name])
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # serve's handler stops it cleanly

    t = threading.Thread(target=drive)
    t.start()
    rc = main(["serve", "--preset", "tiny", "--seed", "0", "--name", shm_name, "--slots", "8",
               "--max-batch", "4", "--max-tokens", "200", "--threads", "1"])  # fmt: skip
    t.join(30)
    assert rc == 0
    assert seen["stats_rc"] == 0 and seen["table_rc"] == 0
    out = capsys.readouterr()
    assert "RANDOM weights" in out.err
    stats = json.loads(out.out[: out.out.index("}\n") + 1])
    assert stats["requests"] == 1 and stats["slots"] == 8 and stats["max_tokens"] == 200
    assert stats["server_alive"] is True
    assert "avg batch size" in out.out
    expected = seed_int16(single_decode(list(range(40)), list(range(32))))
    assert np.abs(seen["pcm"].astype(np.int32) - expected).max() <= 1
    assert leftover_objects(shm_name) == []


def test_serve_refuses_a_name_with_a_live_server(start_server, shm_name, capsys):
    start_server()
    rc = main(["serve", "--preset", "tiny", "--name", shm_name])
    assert rc == 1
    assert "already serving" in capsys.readouterr().err


def test_stats_of_a_missing_name_fails_clearly(shm_name, capsys):
    assert main(["stats", shm_name]) == 1
    assert "no bicodec-shm segment" in capsys.readouterr().err


def test_cleanup_removes_a_dead_servers_leftovers(shm_name, capsys):
    seg = Segment.create(shm_name, n_slots=2, max_tokens=10)
    seg.header["server_pid"] = 2**31  # no such process
    seg.close()
    assert leftover_objects(shm_name)
    assert main(["cleanup", shm_name]) == 0
    assert leftover_objects(shm_name) == []


def test_cleanup_refuses_while_the_server_lives(start_server, shm_name, capsys):
    start_server()
    assert main(["cleanup", shm_name]) == 1
    assert "alive" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--mode", "0o1777"], ["serve", "--mode", "abc"]])
def test_bad_mode_is_rejected(argv):
    with pytest.raises(SystemExit):
        main(argv)


def test_demo_runs_checks_results_and_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--preset", "tiny", "--clients", "3", "--requests", "4", "--check", "3",
               "--min-len", "5", "--max-len", "40", "--threads", "1", "--json", str(out)])  # fmt: skip
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["requests"] == 12 and summary["failed"] == 0
    assert summary["checked"] == 3 and summary["max_lsb_error"] <= 1
    assert summary["shm_left_behind"] == []
    printed = capsys.readouterr().out
    for words in ("throughput", "avg batch size", "latency p50 / p99", "wall time"):
        assert words in printed
