"""Correctness across real processes: many clients, one server, each result vs its lone decode."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from support import seed_int16, single_decode, worker_command

from bicodec_shm.protocol.header import read_header, stats_from_header


def _load(path: str):
    data = np.load(path)
    n = len([k for k in data.files if k.startswith("pcm_")])
    return [(data[f"sem_{i}"], data[f"glb_{i}"], data[f"pcm_{i}"]) for i in range(n)]


@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_eight_clients_get_their_own_exact_audio(start_server, shm_name, tmp_path, lanes):
    """Mixed lengths from 8 processes; with 2 and 4 lanes too: no cross-talk between lanes."""
    start_server("--slots", "48", "--max-batch", "16", "--lanes", str(lanes), "--min-fill", "0")
    n_clients, n_requests = 8, 20
    outs = [str(tmp_path / f"c{i}.npz") for i in range(n_clients)]
    procs = [
        subprocess.Popen(worker_command(shm_name, str(100 + i), str(n_requests), outs[i],
                                        "--concurrent", "3", "--slots", "3"))  # fmt: skip
        for i in range(n_clients)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0

    stats = stats_from_header(read_header(shm_name))
    worst = 0
    for out in outs:
        results = _load(out)
        assert len(results) == n_requests
        for sem, glb, pcm in results:
            expected = seed_int16(single_decode(sem, glb))
            assert pcm.dtype == np.int16 and pcm.shape == expected.shape
            worst = max(worst, int(np.abs(pcm.astype(np.int32) - expected).max()))
    assert worst <= 1, f"int16 results differ from lone decodes by up to {worst} LSB"
    assert stats["requests"] == n_clients * n_requests
    assert stats["failed"] == 0
    assert max(stats["batch_size_histogram"]) > 1, stats["batch_size_histogram"]
    assert stats["avg_batch_size"] > 1.0


def test_float32_results_match_lone_decodes(start_server, shm_name, tmp_path):
    start_server()
    outs = [str(tmp_path / f"f{i}.npz") for i in range(3)]
    procs = [subprocess.Popen(worker_command(shm_name, str(7 + i), "8", outs[i], "--dtype", "float32",
                                             "--concurrent", "4"))  # fmt: skip
             for i in range(3)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    for out in outs:
        for sem, glb, pcm in _load(out):
            assert pcm.dtype == np.float32
            np.testing.assert_allclose(pcm, single_decode(sem, glb), rtol=0, atol=1e-5)
