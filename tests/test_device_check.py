"""Tests of ``benchmarks/device_check.sh`` on a machine without a GPU: it skips cleanly, it
installs what the lent machine lacks from carried wheels and imports the package before its
first CUDA step (a simulation of that machine), and its dry run shows every step's command
with flags that the benchmarks' parsers accept."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
STEPS = ["env", "gpu_tests", "bench_model_float32", "bench_model_bfloat16", "fit_costs", "bench_throughput",
         "bench_standin", "bench_snac", "bench_dac", "bench_qwen3", "bench_model_float16"]  # fmt: skip

no_gpu = pytest.mark.skipif(
    torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
    reason="checks a machine without a GPU",
)


def run_script(out: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, **env}
    # The timeout only guards against a hang; the skip takes a few seconds (torch imports).
    return subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=240)  # fmt: skip


@no_gpu
def test_skips_when_torch_is_missing_and_there_is_no_gpu(tmp_path) -> None:
    done = run_script(tmp_path / "out", PYTHON="/bin/false", SCRATCH=str(tmp_path / "scratch"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch is not importable" in done.stdout


# -- a simulation of the lent machine: torch importable, posix_ipc not, wheels carried ----------


def wheel_of_installed(dist_name: str, folder: Path) -> Path:
    """A wheel of an installed distribution, rebuilt from its installed files (no network):
    what `pip download` would have put in .whl/ for this interpreter."""
    dist = importlib.metadata.distribution(dist_name)
    tag = next(line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines()
               if line.startswith("Tag: "))  # fmt: skip
    name = dist.metadata["Name"].replace("-", "_")
    info = f"{name}-{dist.version}.dist-info"
    path = folder / f"{name}-{dist.version}-{tag}.whl"
    records = []
    with zipfile.ZipFile(path, "w") as whl:
        for file in dist.files:
            rel = str(file)
            installer_only = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")
            if rel.startswith(info) and Path(rel).name in installer_only:
                continue
            data = Path(file.locate()).read_bytes()
            whl.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{rel},sha256={digest},{len(data)}")
        records.append(f"{info}/RECORD,,")
        whl.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return path


def python_without(hidden: str, root: Path) -> Path:
    """A fresh venv of this interpreter's base Python that sees this environment's packages
    (torch, numpy, pytest, pip...) except ``hidden``, as the lent machine's Python sees its own
    torch but has no posix_ipc."""
    venv = root / "venv"
    made = subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot make a venv here: {made.stderr.strip()[-200:]}")
    links = root / "packages"
    links.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.lower().startswith((hidden, "bicodec_shm", "__editable__")) or entry.suffix == ".pth":
            continue
        (links / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "packages.pth").write_text(f"{links}\n")
    return python


@no_gpu
def test_on_a_simulated_lent_machine_it_installs_the_wheels_and_reaches_its_cuda_check(tmp_path) -> None:
    python = python_without("posix_ipc", tmp_path)
    check = subprocess.run([str(python), "-c", "import torch, numpy, pytest\nimport posix_ipc"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
    assert check.returncode != 0 and "No module named 'posix_ipc'" in check.stderr  # as there
    wheels, site = tmp_path / "whl", tmp_path / "site"
    wheels.mkdir()
    # No wheels carried: it stops loudly before any step, rather than fail in every one.
    done = run_script(tmp_path / "out0", PYTHON=str(python), WHEELS=str(wheels), SITE=str(site),
                      SCRATCH=str(tmp_path / "scratch0"), PYTHONPATH="")  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "missing modules: posix_ipc, and no wheels in" in done.stdout
    assert "FAILED: 'import torch, posix_ipc, bicodec_shm' breaks" in done.stdout
    assert "FAILED" in (tmp_path / "out0" / "summary.txt").read_text()
    wheel_of_installed("posix_ipc", wheels)
    done = run_script(tmp_path / "out", PYTHON=str(python), WHEELS=str(wheels), SITE=str(site),
                      SCRATCH=str(tmp_path / "scratch"), PYTHONPATH="", STEPS="gpu_tests")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "missing modules: posix_ipc; installing posix_ipc-" in done.stdout
    assert f"posix_ipc 1.3.2 from {site}/" in done.stdout or f"from {site}/posix_ipc" in done.stdout
    assert f"bicodec_shm from {ROOT}/bicodec_shm/__init__.py" in done.stdout
    # Past the imports, the first CUDA question; torch here is CPU-only, so the clean skip.
    assert "skipped: no CUDA device" in done.stdout
    assert any(site.glob("posix_ipc*"))
    assert "skipped" in (tmp_path / "out" / "summary.txt").read_text()


# -- the steps ----------------------------------------------------------------------------------


def test_dry_run_runs_every_step_with_valid_flags(tmp_path) -> None:
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    # A real bench_model JSON (tiny, CPU) so that the summary code runs on one.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_model
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    tiny = ["--quick", "--preset", "tiny", "--threads", "1", "--no-progress", "--dtype", "bfloat16"]
    assert bench_model.main([*tiny, "--json", str(scratch / "bench_model_bfloat16.json")]) == 0
    done = run_script(out, DEVICE_CHECK_DRY_RUN="1", SCRATCH=str(scratch))
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text()
    starts = [line.split("] ")[1].split(":")[0] for line in summary.splitlines() if ": start (limit" in line]
    assert starts == STEPS
    # The whole run stays under 8 minutes: the deadline counts from the start (setup included)
    # and caps every step's limit; then a step's 10 s kill grace, the summary and the archive.
    deadline = int(summary.split("(deadline ")[1].split("s;")[0])
    assert deadline + 30 <= 480
    assert "bfloat16: SNR vs float32 T=25:" in summary  # the summary read the JSON
    # Only summary.txt and one archive come back (the device tool returns at most 8 files).
    assert sorted(p.name for p in out.iterdir()) == ["device_check.tar.gz", "summary.txt"]
    with tarfile.open(out / "device_check.tar.gz") as tar:
        archived = {Path(name).name for name in tar.getnames()}
    assert {f"{step}.log" for step in STEPS} <= archived
    commands = {step: (scratch / f"{step}.log").read_text().removeprefix("DRY RUN: ").split()
                for step in STEPS}  # fmt: skip
    for dtype in ("float32", "bfloat16", "float16"):
        argv = commands[f"bench_model_{dtype}"]
        args = bench_model.build_parser().parse_args(argv[argv.index("benchmarks/bench_model.py") + 1 :])
        assert (args.device, args.dtype, args.cuda_graphs, args.grid) == ("cuda:0", (dtype,), "both", True)
    from bicodec_shm.tools.cli import _parser

    bench = commands["bench_throughput"]
    args = _parser().parse_args(bench[bench.index("bicodec_shm") + 1 :])
    assert args.device == "cuda:0" and tuple(args.n) == (1, 4, 16, 32)
    assert args.per_process_max_n == 16 and args.memory_gib >= 100
    fit = commands["fit_costs"]
    assert fit[fit.index("benchmarks/fit_batch_costs.py") + 1 :] == [
        f"{scratch}/bench_model_bfloat16.json", "--json", f"{scratch}/fit_costs.json"]
    standin = commands["bench_standin"]
    args = _parser().parse_args(standin[standin.index("bicodec_shm") + 1 :])
    assert args.stand_in == (4.0, 0.006, True)  # the dry run fitted nothing: the modern preset
    assert args.dispatch == ("auto", "pipeline", "wait") and args.max_batch_tokens == 2400
    dac = commands["bench_dac"]
    args = _parser().parse_args(dac[dac.index("bicodec_shm") + 1 :])
    assert (args.codec, args.device, tuple(args.n)) == ("dac-44khz", "cuda:0", (4, 16))
    qwen3 = commands["bench_qwen3"]
    args = _parser().parse_args(qwen3[qwen3.index("bicodec_shm") + 1 :])
    assert (args.codec, args.device, tuple(args.n)) == ("qwen3-tts-12hz", "cuda:0", (4, 16))
    tests = commands["gpu_tests"]
    assert tests[tests.index("-m") + 1 :][:4] == ["pytest", "-m", "gpu", "tests"]
    assert f"--junitxml={scratch}/gpu_tests.xml" in tests
    assert "--continue-on-collection-errors" in tests


def test_the_gpu_marker_selects_the_cuda_tests_of_every_module() -> None:
    """What the gpu_tests step runs: every gpu-marked test under tests/, wherever it is."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "--collect-only", "-q",
         "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(selected) >= 13, done.stdout
    files = {line.split("::")[0] for line in selected}
    assert {"tests/test_precision.py", "tests/test_graphs.py"} <= files
    for name in ("test_cuda_two_lanes_share_the_graphs", "test_cuda_eager_decode_of_host_inputs",
                 "test_cuda_pipelined_lane_publishes", "test_cuda_a_runner_on_the_second_gpu"):  # fmt: skip
        assert any(name in line for line in selected), name


@no_gpu
def test_without_cuda_the_fit_and_the_fitted_stand_in_run_on_a_cpu(tmp_path) -> None:
    """The steps that need no GPU, asked for by name, run for real: the fit of a bench_model
    grid (here the tiny model's, on this CPU) and the stand-in bench with the fitted costs;
    the summary prints both."""
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_model
        import fit_batch_costs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    grid = ["--preset", "tiny", "--threads", "1", "--no-progress", "--no-quality", "--repeats", "1",
            "--batch-sizes", "1,2,4", "--lengths", "10,20"]  # fmt: skip
    assert bench_model.main([*grid, "--json", str(scratch / "bench_model_float32.json")]) == 0
    quick = ("--n 2 --window 1 --repeats 1 --timeout 60 --systems shm --dispatch auto,pipeline "
             "--no-plot --no-progress")
    done = run_script(out, SCRATCH=str(scratch), STEPS="fit_costs bench_standin", STANDIN_FLAGS=quick)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA device: running only the steps that need none (fit_costs bench_standin)" in done.stdout
    summary = (out / "summary.txt").read_text()
    assert "fit_costs: rc=0" in summary and "bench_standin: rc=0" in summary, summary
    fitted = json.loads((scratch / "fit_costs.json").read_text())
    (fit,) = fitted["fits"]
    assert (fit["dtype"], fit["graphs"], fit["points"]) == ("float32", False, 6)
    assert fit["a_ms"] >= 0 and fit["b_ms"] > 0
    assert fitted["stand_in"] == fit_batch_costs.stand_in_flag(fit)
    assert "batch cost fitted from bench_model's grid" in summary
    assert f"--stand-in {fitted['stand_in']}" in summary
    stand = json.loads((scratch / "bench_standin.json").read_text())
    assert stand["config"]["stand_in"]["a_ms"] == pytest.approx(fit["a_ms"], rel=1e-3)
    assert stand["config"]["stand_in"]["asynchronous"] is True
    systems = {r["system"] for r in stand["results"]}
    assert {"bicodec-shm (dispatch=auto)", "bicodec-shm (dispatch=pipeline)"} <= systems
    assert "N=2   stand-in: bicodec-shm (dispatch=auto)" in summary


@no_gpu
def test_without_cuda_a_gpu_step_among_the_asked_ones_skips_them_all(tmp_path) -> None:
    done = run_script(tmp_path / "out", SCRATCH=str(tmp_path / "scratch"), STEPS="fit_costs gpu_tests")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped: no CUDA device" in done.stdout and "fit_costs: start" not in done.stdout


def test_the_fit_recovers_a_planted_line_and_says_how_well_it_holds() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fit_batch_costs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = [{"dtype": dt, "graphs": g, "graphed": True, "batch": b, "tokens": t,
             "ms_batch": (a + k * b * t) * (1.1 if (b, t) == (32, 300) else 1.0)}
            for dt, g, a, k in (("float32", False, 4.0, 0.006), ("bfloat16", True, 0.5, 0.002))
            for b in (1, 2, 4, 8, 16, 32) for t in (25, 50, 100, 200, 300)]  # fmt: skip
    rows.append({"dtype": "bfloat16", "graphs": True, "graphed": False, "batch": 64, "tokens": 300,
                 "ms_batch": 1e6})  # no graph for this shape: left out  # fmt: skip
    fits = {(f["dtype"], f["graphs"]): f for f in fit_batch_costs.fits(rows)}
    f32, bf16 = fits["float32", False], fits["bfloat16", True]
    assert f32["a_ms"] == pytest.approx(4.0, rel=0.02) and f32["b_ms"] == pytest.approx(0.006, rel=0.05)
    assert bf16["points"] == 30 and bf16["a_ms"] == pytest.approx(0.5, rel=0.02)
    assert 0.05 < f32["max_rel_err"] < 0.12  # the one shape 10 % off the line
    assert fit_batch_costs.choose(list(fits.values()), "float32:off") is f32
    assert fit_batch_costs.stand_in_flag({"a_ms": 4.0, "b_ms": 0.006}) == "4,0.006,async"
