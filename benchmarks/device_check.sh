#!/usr/bin/env bash
# Every GPU check of bicodec-shm in one call, in under 8 minutes on an H200; all results land in
# one folder. Without a GPU it prints that it skipped and exits 0.
#
#   bash benchmarks/device_check.sh [OUT_DIR]     # default: $OUT, else benchmarks/out/device_check
#
# Steps, in order of importance; each has its own timeout and the whole run a deadline
# (DEADLINE_S), so one hung step cannot eat the budget:
#   env          GPU name, memory, driver (nvidia-smi); torch, CUDA, cuDNN versions -> env.txt, env.json
#   gpu_tests    pytest -m gpu: float32 exact batched vs lone (TF32 off), bfloat16/float16 vs
#                float32 SNR, graphs vs eager byte for byte -> gpu_tests.log/.xml, gpu_measurements.json
#   bench_model_<dtype>  benchmarks/bench_model.py on cuda:0: B 1-32 x T 25-300, graphs off and on,
#                TFLOPS and % of peak, SNR vs float32, batched vs lone -> bench_model_<dtype>.log/.json
#                (the JSON is rewritten after every shape, so a step cut short keeps its small shapes)
#   bench_throughput     python -m bicodec_shm bench --device cuda:0, N = 1, 4, 16, 32 (BENCH_FLAGS)
#                -> bench_throughput.log/.json
#   summary.txt  each step's exit code and seconds, then the numbers the issue's targets ask for
#
# Assumes a bare machine with a CUDA build of torch importable by $PYTHON (default python3) and no
# network. The package is used from this checkout through PYTHONPATH (no build step needed). If
# numpy, posix_ipc, safetensors, PyYAML, tqdm, psutil, pytest or pytest-timeout are missing, they
# are installed into a venv that sees the system's torch: from a wheelhouse in $WHEELS if given
# (pip download -d wheels <those packages>, on a machine with the same Python), else from the index.
#
# Knobs (environment): PYTHON, WHEELS, DTYPES ("float32 bfloat16 float16"), DEADLINE_S (450),
# BENCH_FLAGS (below), DEVICE_CHECK_DRY_RUN=1 (write
# each step's command to its log instead of running it: tests/test_device_check.py checks them).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/benchmarks/out/device_check}}"
PY="${PYTHON:-python3}"
DTYPES="${DTYPES:-float32 bfloat16 float16}"
DEADLINE_S="${DEADLINE_S:-450}"
# `bicodec-shm bench` flags: N clients; one 6 s window per system and N (the GPU decodes in ms,
# so 6 s holds thousands of requests); a 60 s per-request timeout (a hang should fail fast); no
# plot (no matplotlib needed); no queue-server system, which the targets do not use.
BENCH_FLAGS="${BENCH_FLAGS:---n 1,4,16,32 --window 6 --repeats 1 --timeout 60 --systems shm,limit,per-process --no-plot --no-progress}"
REQUIRED_MODULES="numpy posix_ipc safetensors yaml tqdm psutil pytest pytest_timeout"

mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
START=$SECONDS
say() { echo "[device_check $((SECONDS - START))s] $*" | tee -a "$SUMMARY"; }
: >"$SUMMARY"

# --- is there a GPU we can use? ----------------------------------------------------------------
gpu_listed=0
if command -v nvidia-smi >/dev/null 2>&1 && timeout 30 nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
    gpu_listed=1
fi
torch_state=$(timeout 120 "$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'nocuda', torch.__version__, torch.version.cuda)" 2>/dev/null || echo "notorch")
if [ -n "${DEVICE_CHECK_DRY_RUN:-}" ]; then
    say "dry run: every step prints its command instead of running it (torch: $torch_state)"
elif [ "${torch_state%% *}" = notorch ]; then
    if [ "$gpu_listed" = 1 ]; then
        say "FAILED: '$PY -c \"import torch\"' fails on a machine with a GPU; install a CUDA build of torch"
        exit 1
    fi
    say "skipped: no GPU here (no nvidia-smi GPU) and torch is not importable by $PY"
    exit 0
elif [ "${torch_state%% *}" = nocuda ]; then
    if [ "$gpu_listed" = 1 ]; then
        say "FAILED: nvidia-smi lists a GPU but torch (version, CUDA: ${torch_state#* }) cannot use it"
        exit 1
    fi
    say "skipped: no CUDA device (torch ${torch_state#* } sees none); nothing to check on this machine"
    exit 0
fi
[ -z "${DEVICE_CHECK_DRY_RUN:-}" ] && say "GPU found (torch, CUDA: ${torch_state#* })"
say "results go to $OUT_DIR (deadline ${DEADLINE_S}s)"

# run_step NAME LIMIT_S COMMAND...: run with a timeout capped by the time left; log to NAME.log.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE_S - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then
        say "$name: not run (deadline)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name: start (limit ${limit}s)"
    local t0=$SECONDS rc=0
    if [ -n "${DEVICE_CHECK_DRY_RUN:-}" ]; then
        echo "DRY RUN: $*" >"$OUT_DIR/$name.log"
    else
        timeout -k 10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
        rc=$?
    fi
    local note=""
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" TIMED OUT"
    say "$name: rc=$rc in $((SECONDS - t0))s$note"
}

# --- dependencies -------------------------------------------------------------------------------
missing=$("$PY" - "$REQUIRED_MODULES" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1].split() if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ] && [ -n "${DEVICE_CHECK_DRY_RUN:-}" ]; then
    say "missing modules: $missing (dry run: not installed)"
elif [ -n "$missing" ]; then
    say "missing modules: $missing; installing into a venv that sees the system torch"
    VENV="${VENV:-/tmp/bicodec-shm-device-venv}"
    user=""
    if timeout 60 "$PY" -m venv --system-site-packages "$VENV"; then
        PY="$VENV/bin/python"
    else
        say "no venv module; installing with pip --user instead"
        user="--user"
    fi
    pkgs="numpy posix_ipc safetensors PyYAML tqdm psutil pytest pytest-timeout"
    if [ -n "${WHEELS:-}" ]; then
        run_step deps 90 "$PY" -m pip install $user --no-index --find-links "$WHEELS" $pkgs
    else
        run_step deps 90 "$PY" -m pip install $user $pkgs
    fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 1

# --- env ----------------------------------------------------------------------------------------
{
    timeout 30 nvidia-smi
    timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
} >"$OUT_DIR/env.txt" 2>&1
run_step env 60 "$PY" - "$OUT_DIR/env.json" <<'EOF'
import json, os, platform, sys
import torch
p = torch.cuda.get_device_properties(0)
env = {
    "gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
    "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
    "gpus": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
    "cpus": os.cpu_count(),
}
print(json.dumps(env, indent=2))
json.dump(env, open(sys.argv[1], "w"), indent=2)
EOF
cat "$OUT_DIR/env.log" >>"$OUT_DIR/env.txt"

# --- the GPU-marked tests -----------------------------------------------------------------------
run_step gpu_tests 150 "$PY" -m pytest -m gpu tests/test_precision.py tests/test_graphs.py -v -rA \
    -p no:cacheprovider -o junit_family=xunit1 --junitxml="$OUT_DIR/gpu_tests.xml"

# --- the decoder: grid x dtypes x graphs; then the whole server -----------------------------
bench_model() {
    run_step "bench_model_$1" "$2" "$PY" benchmarks/bench_model.py --device cuda:0 --dtype "$1" \
        --grid --cuda-graphs both --no-mask-ab --repeats 3 --no-progress \
        --json "$OUT_DIR/bench_model_$1.json"
}
first=${DTYPES%% *}
bench_model "$first" 100
for dt in $DTYPES; do
    [ "$dt" = "$first" ] || [ "$dt" = float16 ] || bench_model "$dt" 70
done
# shellcheck disable=SC2086  # BENCH_FLAGS is a list of words
run_step bench_throughput 200 "$PY" -m bicodec_shm bench --device cuda:0 $BENCH_FLAGS \
    --json "$OUT_DIR/bench_throughput.json"
case " $DTYPES " in *" float16 "*) [ "$first" = float16 ] || bench_model float16 70 ;; esac

# --- summary ------------------------------------------------------------------------------------
"$PY" - "$OUT_DIR" 2>&1 <<'EOF' | tee -a "$SUMMARY"
import glob, json, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
print("\n== gpu tests ==")
try:
    suite = ET.parse(os.path.join(out, "gpu_tests.xml")).getroot()
    measured = {}
    for case in suite.iter("testcase"):
        state = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        print(f"{state:8} {case.get('name')}")
        for prop in case.iter("property"):
            measured[prop.get("name")] = prop.get("value")
    json.dump(measured, open(os.path.join(out, "gpu_measurements.json"), "w"), indent=2)
    for key, value in measured.items():
        print(f"  {key} = {value}")
except (OSError, ET.ParseError) as exc:
    print(f"no test results: {exc}")
for path in sorted(glob.glob(os.path.join(out, "bench_model_*.json"))):
    data = json.load(open(path))
    print(f"\n== {os.path.basename(path)}: {data['meta'].get('device_name')}, "
          f"{data['meta']['gflop_per_token']:.3f} GFLOP/token ==")
    rows = {(r["dtype"], r["graphs"], r["tokens"], r["batch"]): r for r in data["results"]}
    for (dtype, graphs, t, b), r in sorted(rows.items()):
        if graphs and b <= 4 and t <= 50:
            print(f"  {dtype} graphs vs eager B={b} T={t}: {r['ms_batch']:.2f} ms, "
                  f"speedup {r['speedup'] or float('nan'):.2f}x{'' if r['graphed'] else ' (no graph)'}")
        if (b, t) == (16, 50):
            print(f"  {dtype} graphs={'on' if graphs else 'off'} B=16 T=50: {r['ms_batch']:.2f} ms, "
                  f"{r['tflops']:.1f} TFLOPS, {r['peak_pct'] or float('nan'):.1f} % of peak")
    for q in data.get("quality", []):
        snr = ", ".join(f"T={t}: {v:.1f} dB" for t, v in q["snr_db"].items())
        print(f"  {q['dtype']}: SNR vs float32 {snr or '-'}; batched vs lone "
              f"{q['batched_vs_lone_max_abs']:.2e}; graphs vs lone {q.get('graphs_vs_lone_max_abs')}")
try:
    bench = json.load(open(os.path.join(out, "bench_throughput.json")))
    print("\n== bench_throughput: see bench_throughput.log for the table ==")
    print(json.dumps(bench.get("summary", bench.get("targets", "")), indent=1)[:3000])
except (OSError, ValueError) as exc:
    print(f"\nno bench_throughput.json: {exc}")
EOF
say "done in $((SECONDS - START))s; results in $OUT_DIR"
