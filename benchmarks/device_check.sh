#!/usr/bin/env bash
# Every GPU check of bicodec-shm in one run of under 8 minutes on the lent H200 (16 cores).
# Without a GPU it says that it skipped and exits 0.
#
# HOW TO RUN IT ON THE LENT MACHINE (/work/.library/device/README.md; no network there, no
# posix_ipc, Python 3.12 at /opt/torch/.venv/bin/python3 with a CUDA torch):
#
#   1. Once, here, in the repository root (a machine with network), fetch the wheels into the
#      ignored folder .whl/ (.gitignore lists /.whl/):
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#          --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#          --platform manylinux1_x86_64 -d .whl posix_ipc==1.3.2
#        python3 -m pip download --no-deps -d .whl descript-audio-codec==1.0.0 \
#          descript-audiotools==0.7.2 einops
#      (posix_ipc is the only package the image lacks that the server needs; the three pure-Python
#      wheels are the reference the DAC gpu tests compare with, installed without their
#      dependencies as in CI; starlette/uvicorn are only for examples/, whose tests are not
#      gpu-marked.)
#   2. The device tool's `run`, from the checkout whose tree travels:
#        command:   bash benchmarks/device_check.sh
#        carry:     [".whl"]
#        timeout_s: 540        (the script's own DEADLINE_S is 420 s; 540 leaves the tar and the
#                              transfer room, and ~5 min of the 15-minute lease for a rerun of
#                              one step: STEPS="gpu_tests" bash benchmarks/device_check.sh)
#      It writes $OUT/summary.txt and $OUT/device_check.tar.gz (every log, JSON and junit XML),
#      both rewritten after every step, so that a run cut short still brings back what ended.
#
#   bash benchmarks/device_check.sh [OUT_DIR]     # default: $OUT, else benchmarks/out/device_check
#
# Setup, before any step: modules the image lacks are installed from the wheels in $WHEELS
# (default .whl/) with `pip install --no-index --no-deps --target $SITE` and put on PYTHONPATH
# (never a venv: one made from the image's venv Python does not see its torch); then
# `import torch, posix_ipc, bicodec_shm` must work, or the script stops with exit code 2.
#
# Steps, in order of importance; each has its own time limit and the whole run a deadline
# (DEADLINE_S), so one hung step cannot eat the budget:
#   env          GPU name, memory, driver (nvidia-smi); torch, CUDA, cuDNN versions -> env.txt/.json
#   gpu_tests    pytest -m gpu over all of tests/ (so gpu tests added later run too): float32
#                batched vs lone, reduced precision vs float32, graphs vs eager, the pipelined
#                lane, the member on its own GPU -> gpu_tests.log/.xml, gpu_measurements.json
#   bench_model_<dtype>  benchmarks/bench_model.py on cuda:0: B 1-32 x T 25-300, graphs off and on,
#                TFLOPS and % of peak, SNR vs float32, batched vs lone -> bench_model_<dtype>.json
#                (rewritten after every shape, so a step cut short keeps its small shapes)
#   fit_costs    benchmarks/fit_batch_costs.py on the bench_model JSONs: each dtype's batch cost,
#                graphs off and on, as a + b x rows x longest ms, and the stand-in that plays it
#                (float32, no graphs: the server's default) -> fit_costs.json (needs no GPU)
#   bench_throughput     python -m bicodec_shm bench --device cuda:0 (BENCH_FLAGS): N = 1, 4, 16,
#                32; the decoder per process only up to N = 16 -> bench_throughput.json
#                (rewritten after every run)
#   bench_standin        the stand-in bench with the fitted costs (--stand-in A,B,async,
#                STANDIN_FLAGS): dispatch auto, pipeline and wait at N = 4 and 16, next to the real
#                decoder's run in the summary -> bench_standin.json (needs no GPU, only fit_costs)
#   bench_snac   benchmarks/bench_snac_model.py --variant snac-24khz on cuda:0 (Orpheus's codec):
#                cost per frame at B 1 and 16, batched vs lone, FLOPs -> bench_snac.json
#   bench_dac    python -m bicodec_shm bench --codec dac-44khz --device cuda:0 (Dia's and
#                Parler-TTS's codec, full size): N = 4, 16 against a decoder per process
#                -> bench_dac.json
#   bench_qwen3  python -m bicodec_shm bench --codec qwen3-tts-12hz --device cuda:0 (Qwen3-TTS's
#                12 Hz decoder, full size): N = 4, 16 against a decoder per process
#                -> bench_qwen3.json
#   summary.txt  each step's exit code and seconds, then the numbers the targets ask for, the
#                fitted costs, and the real decoder's throughput next to the fitted stand-in's
#
# Without CUDA it skips, unless STEPS names only steps that need no GPU (fit_costs,
# bench_standin): those run (on the JSONs already in $SCRATCH), so that they are checked on a CPU.
#
# Files: every step writes into a scratch folder ($SCRATCH, default a fresh /tmp folder); after
# each step summary.txt and one archive of the scratch folder are (re)written to OUT_DIR, since
# the device tool brings back at most 8 files.
#
# Knobs (environment): PYTHON (default /opt/torch/.venv/bin/python3 if it exists, else python3),
# WHEELS (.whl), SITE (/tmp/site), SCRATCH, STEPS (default all, in the order above), DTYPES
# ("float32 bfloat16 float16"), DEADLINE_S (420), BENCH_FLAGS and STANDIN_FLAGS (below), DEVICE_CHECK_DRY_RUN=1
# (write each step's command to its log instead of running it: tests/test_device_check.py).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/benchmarks/out/device_check}}"
if [ -z "${PYTHON:-}" ] && [ -x /opt/torch/.venv/bin/python3 ]; then
    PYTHON=/opt/torch/.venv/bin/python3
fi
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
SITE="${SITE:-/tmp/site}"
DTYPES="${DTYPES:-float32 bfloat16 float16}"
DEADLINE_S="${DEADLINE_S:-420}"
ALL_STEPS="env gpu_tests bench_model_float32 bench_model_bfloat16 fit_costs bench_throughput bench_standin"
ALL_STEPS+=" bench_snac bench_dac bench_qwen3 bench_model_float16"
CPU_STEPS="fit_costs bench_standin"  # they need no GPU
STEPS_GIVEN="${STEPS:-}"
STEPS="${STEPS:-$ALL_STEPS}"
# `bicodec-shm bench` flags: N clients; one 5 s window per system and N (the GPU decodes in ms,
# so 5 s holds thousands of requests); the decoder per process only up to N = 16 (32 processes
# each starting CUDA and a model took most of the old 200 s step); a 60 s per-request timeout (a
# hang should fail fast); the machine's RAM is 128 GiB but starts small and grows, so the memory
# check is told so; no plot; no queue-server system, which the targets do not use.
DEFAULT_BENCH_FLAGS="--n 1,4,16,32 --window 5 --repeats 1 --timeout 60 --per-process-max-n 16"
DEFAULT_BENCH_FLAGS+=" --memory-gib 120 --systems shm,limit,per-process --no-plot --no-progress"
BENCH_FLAGS="${BENCH_FLAGS:-$DEFAULT_BENCH_FLAGS}"
# The stand-in with the fitted costs: the same mix and the CUDA server's token budget (the stand-in
# runs on the host, whose default budget is the CPU's); each dispatch policy; 3 s windows.
DEFAULT_STANDIN_FLAGS="--n 4,16 --window 3 --repeats 1 --timeout 60 --systems shm --max-batch-tokens 2400"
DEFAULT_STANDIN_FLAGS+=" --dispatch auto,pipeline,wait --no-plot --no-progress"
STANDIN_FLAGS="${STANDIN_FLAGS:-$DEFAULT_STANDIN_FLAGS}"
REQUIRED_MODULES="numpy posix_ipc safetensors yaml tqdm psutil pytest pytest_timeout"

mkdir -p "$OUT_DIR" || exit 2
SCRATCH="${SCRATCH:-$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")}"
mkdir -p "$SCRATCH" || exit 2
LOG="$SCRATCH/summary.txt"
START=$SECONDS
: >"$LOG"

# collect: summary.txt and one archive of the scratch folder into OUT_DIR (atomically).
collect() {
    cp "$LOG" "$OUT_DIR/summary.txt.part" && mv "$OUT_DIR/summary.txt.part" "$OUT_DIR/summary.txt"
    local n
    n=$(find "$SCRATCH" -type f ! -name summary.txt | wc -l)
    if [ "$n" -gt 0 ]; then
        tar -czf "$OUT_DIR/device_check.tar.gz.part" -C "$SCRATCH" . 2>/dev/null &&
            mv "$OUT_DIR/device_check.tar.gz.part" "$OUT_DIR/device_check.tar.gz"
    fi
}
say() { echo "[device_check $((SECONDS - START))s] $*" | tee -a "$LOG"; }
finish() { collect; exit "$1"; }
wanted() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

# --- modules the image lacks: from the carried wheels, into $SITE, on PYTHONPATH ------------------
missing_modules() {
    "$PY" - "$REQUIRED_MODULES" 2>/dev/null <<'EOF'
import importlib.util, sys
def absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except Exception:
        return True
print(" ".join(m for m in sys.argv[1].split() if absent(m)))
EOF
}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "" 2>/dev/null; then
    missing="(no python: $PY)"
else
    missing=$(missing_modules)
fi
if [ -n "$missing" ] && [ "$missing" != "(no python: $PY)" ]; then
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        say "missing modules: $missing; installing $(cd "$WHEELS" && echo *.whl) into $SITE"
        if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --disable-pip-version-check --target "$SITE" "$WHEELS"/*.whl >"$SCRATCH/deps.log" 2>&1; then
            cat "$SCRATCH/deps.log" | tee -a "$LOG"
            say "FAILED: pip install of the wheels in $WHEELS into $SITE"
            finish 2
        fi
        export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
        missing=$(missing_modules)
        [ -n "$missing" ] && say "still missing after the install: $missing"
    else
        say "missing modules: $missing, and no wheels in $WHEELS (see the top of this script)"
    fi
fi

# --- is there a GPU we can use? ----------------------------------------------------------------
gpu_listed=0
if command -v nvidia-smi >/dev/null 2>&1 && timeout 30 nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
    gpu_listed=1
fi
torch_state=$(timeout 120 "$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'nocuda', torch.__version__, torch.version.cuda)" 2>/dev/null || echo "notorch")
if [ "${torch_state%% *}" = notorch ]; then
    if [ "$gpu_listed" = 1 ]; then
        say "FAILED: '$PY -c \"import torch\"' fails on a machine with a GPU; install a CUDA build of torch"
        finish 2
    fi
    say "skipped: no GPU here (no nvidia-smi GPU) and torch is not importable by $PY"
    finish 0
fi
# The package and its shared memory must import before anything runs: fail loudly, not later.
if ! imports=$(timeout 120 "$PY" -c "
import torch, posix_ipc, bicodec_shm
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), posix_ipc {posix_ipc.VERSION} from '
      f'{posix_ipc.__file__}, bicodec_shm from {bicodec_shm.__file__}')" 2>&1); then
    echo "$imports" | tee -a "$LOG"
    say "FAILED: 'import torch, posix_ipc, bicodec_shm' breaks with $PY (PYTHONPATH=$PYTHONPATH)"
    finish 2
fi
say "imports ok: $imports"
if [ -n "${DEVICE_CHECK_DRY_RUN:-}" ]; then
    say "dry run: every step prints its command instead of running it (torch: $torch_state)"
elif [ "${torch_state%% *}" = nocuda ]; then
    if [ "$gpu_listed" = 1 ]; then
        say "FAILED: nvidia-smi lists a GPU but torch (version, CUDA: ${torch_state#* }) cannot use it"
        finish 2
    fi
    cpu_only=""
    for step in $STEPS_GIVEN; do
        case " $CPU_STEPS " in *" $step "*) cpu_only+="${cpu_only:+ }$step" ;; esac
    done
    if [ -z "$cpu_only" ] || [ "$cpu_only" != "$STEPS_GIVEN" ]; then
        say "skipped: no CUDA device (torch ${torch_state#* } sees none); nothing to check on this machine"
        finish 0
    fi
    STEPS="$cpu_only"
    say "no CUDA device: running only the steps that need none ($STEPS)"
else
    say "GPU found (torch, CUDA: ${torch_state#* })"
fi
say "scratch $SCRATCH; summary and archive to $OUT_DIR (deadline ${DEADLINE_S}s; steps: $STEPS)"
cd "$ROOT" || finish 2

# run_step NAME LIMIT_S COMMAND...: run with a timeout capped by the time left; log to NAME.log;
# then collect, so that what the step wrote comes back even if a later step is cut.
run_step() {
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    local left=$((DEADLINE_S - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then
        say "$name: not run (deadline)"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name: start (limit ${limit}s)"
    local t0=$SECONDS rc=0
    if [ -n "${DEVICE_CHECK_DRY_RUN:-}" ]; then
        echo "DRY RUN: $*" >"$SCRATCH/$name.log"
    else
        timeout -k 10 "$limit" "$@" >"$SCRATCH/$name.log" 2>&1
        rc=$?
    fi
    local note=""
    { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && note=" TIMED OUT"
    say "$name: rc=$rc in $((SECONDS - t0))s$note"
    collect
}

# --- env ----------------------------------------------------------------------------------------
{
    timeout 30 nvidia-smi
    timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
} >"$SCRATCH/env.txt" 2>&1
run_step env 60 "$PY" - "$SCRATCH/env.json" <<'EOF'
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

# --- the GPU-marked tests, wherever they are in tests/ ------------------------------------------
# --continue-on-collection-errors: a test module that needs what the image lacks (starlette for
# the HTTP example) must not stop the gpu tests of every other module.
run_step gpu_tests 130 "$PY" -m pytest -m gpu tests -v -rA -p no:cacheprovider --timeout 100 \
    --continue-on-collection-errors -o junit_family=xunit1 --junitxml="$SCRATCH/gpu_tests.xml"

# --- the decoder: grid x dtypes x graphs; then the whole server -----------------------------
bench_model() {
    run_step "bench_model_$1" "$2" "$PY" benchmarks/bench_model.py --device cuda:0 --dtype "$1" \
        --grid --cuda-graphs both --no-mask-ab --repeats 3 --no-progress \
        --json "$SCRATCH/bench_model_$1.json"
}
first=${DTYPES%% *}
bench_model "$first" 80
for dt in $DTYPES; do
    [ "$dt" = "$first" ] || [ "$dt" = float16 ] || bench_model "$dt" 55
done
run_step fit_costs 30 "$PY" benchmarks/fit_batch_costs.py "$SCRATCH"/bench_model_*.json \
    --json "$SCRATCH/fit_costs.json"
# shellcheck disable=SC2086  # BENCH_FLAGS is a list of words
run_step bench_throughput 150 "$PY" -m bicodec_shm bench --device cuda:0 $BENCH_FLAGS \
    --json "$SCRATCH/bench_throughput.json"
if wanted bench_standin; then
    fitted=$("$PY" benchmarks/fit_batch_costs.py --print-stand-in "$SCRATCH/fit_costs.json" 2>/dev/null)
    if [ -z "$fitted" ] && [ -n "${DEVICE_CHECK_DRY_RUN:-}" ]; then
        fitted="4,0.006,async"  # a dry run fitted nothing: the modern preset's costs stand in
    fi
    if [ -z "$fitted" ]; then
        say "bench_standin: not run (no fitted costs in $SCRATCH/fit_costs.json: run fit_costs first)"
    else
        # shellcheck disable=SC2086  # STANDIN_FLAGS is a list of words
        run_step bench_standin 75 "$PY" -m bicodec_shm bench --stand-in "$fitted" $STANDIN_FLAGS \
            --json "$SCRATCH/bench_standin.json"
    fi
fi
# SNAC 24 kHz (Orpheus): short, one shape pair; the batched rows against their lone decodes too.
run_step bench_snac 40 "$PY" benchmarks/bench_snac_model.py --variant snac-24khz --device cuda:0 \
    --lengths 12,47 --batch-sizes 1,16 --repeats 3 --json "$SCRATCH/bench_snac.json"
# DAC 44.1 kHz (Dia, Parler-TTS) through the same engine: the shared server, its no-IPC limit and
# a decoder per process at N = 4 and 16, one 5 s window each.
run_step bench_dac 75 "$PY" -m bicodec_shm bench --codec dac-44khz --device cuda:0 --n 4,16 --window 5 \
    --repeats 1 --timeout 60 --per-process-max-n 16 --memory-gib 120 --systems shm,limit,per-process \
    --no-plot --no-progress --json "$SCRATCH/bench_dac.json"
# Qwen3-TTS's 12 Hz decoder (Code2Wav) the same way: the shared server against a decoder per
# process, where concurrent requests' time to first audio grows without cross-request batching.
run_step bench_qwen3 75 "$PY" -m bicodec_shm bench --codec qwen3-tts-12hz --device cuda:0 --n 4,16 \
    --window 5 --repeats 1 --timeout 60 --per-process-max-n 16 --memory-gib 120 \
    --systems shm,limit,per-process --no-plot --no-progress --json "$SCRATCH/bench_qwen3.json"
case " $DTYPES " in *" float16 "*) [ "$first" = float16 ] || bench_model float16 45 ;; esac

# --- summary ------------------------------------------------------------------------------------
"$PY" - "$SCRATCH" 2>&1 <<'EOF' | tee -a "$LOG"
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
        print(f"{state:8} {case.get('classname', '')}::{case.get('name')}")
        for prop in case.iter("property"):
            measured[prop.get("name")] = prop.get("value")
    json.dump(measured, open(os.path.join(out, "gpu_measurements.json"), "w"), indent=2)
    for key, value in measured.items():
        print(f"  {key} = {value}")
except (OSError, ET.ParseError) as exc:
    print(f"no test results: {exc}")
for path in sorted(glob.glob(os.path.join(out, "bench_model_*.json"))):
    try:
        data = json.load(open(path))
    except ValueError as exc:
        print(f"\n== {os.path.basename(path)}: unreadable ({exc}) ==")
        continue
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
    partial = " (PARTIAL: the step ended before the last run)" if bench.get("partial") else ""
    print(f"\n== bench_throughput{partial}: see bench_throughput.log for the table ==")
    print(json.dumps(bench.get("summary", bench.get("targets", "")), indent=1)[:3000])
except (OSError, ValueError) as exc:
    print(f"\nno bench_throughput.json: {exc}")
try:
    fitted = json.load(open(os.path.join(out, "fit_costs.json")))
    print(f"\n== batch cost fitted from bench_model's grid ({fitted.get('device')}): ms = a + b x rows x longest ==")
    for f in fitted["fits"]:
        print(f"  {f['dtype']:>8} graphs {'on ' if f['graphs'] else 'off'}: a = {f['a_ms']:.3f} ms, "
              f"b = {f['b_ms'] * 1e3:.3f} us/token ({f['points']} shapes, largest error {f['max_rel_err']:.0%})")
    print(f"  the stand-in run below plays {fitted['stand_in_for']}: --stand-in {fitted['stand_in']}")
except (OSError, ValueError, KeyError) as exc:
    print(f"\nno fit_costs.json: {exc}")


def by_n(path):
    """{N: [(system, req/s, avg batch)]} of a bench JSON."""
    rows = {}
    for r in json.load(open(path)).get("results", []):
        rows.setdefault(r["n_clients"], []).append((r["system"], r["requests_per_s"], r["avg_batch_size"]))
    return rows


try:
    stand = by_n(os.path.join(out, "bench_standin.json"))
    try:
        real = by_n(os.path.join(out, "bench_throughput.json"))
    except (OSError, ValueError):
        real = {}
    print("\n== the real decoder next to the stand-in with its fitted costs (req/s, avg batch) ==")
    for n in sorted(stand):
        for system, rps, batch in real.get(n, []) + [(f"stand-in: {s}", r, b) for s, r, b in stand[n]]:
            print(f"  N={n:<3} {system:<48} {rps:>9.1f} req/s  avg batch {batch or 0:.2f}")
except (OSError, ValueError, KeyError) as exc:
    print(f"\nno bench_standin.json: {exc}")
for step, codec in (("bench_dac", "dac-44khz"), ("bench_qwen3", "qwen3-tts-12hz")):
    try:
        report = json.load(open(os.path.join(out, f"{step}.json")))
        print(f"\n== {step} ({codec}, full size): see {step}.log for the table ==")
        for r in report.get("results", []):
            p50 = r.get("latency_p50_ms")
            print(f"  N={r['n_clients']} {r['system']}: {r['audio_s_per_s']:.1f} audio s/s, "
                  f"p50 {'-' if p50 is None else f'{p50:.0f} ms'}, peak RSS {r['peak_rss_mib']:.0f} MiB")
    except (OSError, ValueError, KeyError) as exc:
        print(f"\nno {step}.json: {exc}")
EOF
say "done in $((SECONDS - START))s; summary.txt and device_check.tar.gz in $OUT_DIR"
finish 0
