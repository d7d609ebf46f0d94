"""Tests of ``benchmarks/device_check.sh`` on a machine without a GPU: it skips cleanly, and its
dry run shows every step's command with flags that the benchmarks' parsers accept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
STEPS = ["env", "gpu_tests", "bench_model_float32", "bench_model_bfloat16", "bench_throughput",
         "bench_model_float16"]  # fmt: skip

no_gpu = pytest.mark.skipif(
    torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
    reason="checks a machine without a GPU",
)


def run_script(out: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, **env}
    # The timeout only guards against a hang; the skip takes a few seconds (one torch import).
    return subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=180)  # fmt: skip


@no_gpu
def test_skips_cleanly_without_a_gpu(tmp_path) -> None:
    done = run_script(tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA device" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["summary.txt"]
    assert "skipped" in (tmp_path / "out" / "summary.txt").read_text()


@no_gpu
def test_skips_when_torch_is_missing_and_there_is_no_gpu(tmp_path) -> None:
    done = run_script(tmp_path / "out", PYTHON="/bin/false")
    assert done.returncode == 0, done.stderr
    assert "torch is not importable" in done.stdout


def test_dry_run_runs_every_step_with_valid_flags(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # A real bench_model JSON (tiny, CPU) so that the summary code runs on one.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_model
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    tiny = ["--quick", "--preset", "tiny", "--threads", "1", "--no-progress", "--dtype", "bfloat16"]
    assert bench_model.main([*tiny, "--json", str(out / "bench_model_bfloat16.json")]) == 0
    done = run_script(out, DEVICE_CHECK_DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    summary = (out / "summary.txt").read_text()
    starts = [line.split("] ")[1].split(":")[0] for line in summary.splitlines() if ": start (limit" in line]
    assert starts == STEPS
    assert "bfloat16: SNR vs float32 T=25:" in summary  # the summary read the JSON
    commands = {step: (out / f"{step}.log").read_text().removeprefix("DRY RUN: ").split() for step in STEPS}
    for dtype in ("float32", "bfloat16", "float16"):
        argv = commands[f"bench_model_{dtype}"]
        args = bench_model.build_parser().parse_args(argv[argv.index("benchmarks/bench_model.py") + 1 :])
        assert (args.device, args.dtype, args.cuda_graphs, args.grid) == ("cuda:0", (dtype,), "both", True)
    from bicodec_shm.cli import _parser

    bench = commands["bench_throughput"]
    args = _parser().parse_args(bench[bench.index("bicodec_shm") + 1 :])
    assert args.device == "cuda:0" and tuple(args.n) == (1, 4, 16, 32)
    tests = commands["gpu_tests"]
    assert tests[tests.index("-m") + 1 :][:2] == ["pytest", "-m"] and "gpu" in tests
    assert f"--junitxml={out}/gpu_tests.xml" in tests


def test_the_gpu_marker_selects_the_cuda_tests() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_precision.py", "tests/test_graphs.py",
         "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    selected = [line for line in done.stdout.splitlines() if "::test_cuda_" in line]
    assert len(selected) >= 8, done.stdout
    assert all("::test_cuda_" in line for line in done.stdout.splitlines() if "::" in line)
