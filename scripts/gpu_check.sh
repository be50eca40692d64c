#!/usr/bin/env bash
# The GPU check (`make gpu-check`): on a machine with an NVIDIA GPU, install
# vlens with vLLM's CUDA build in its own venv, run the engine tests on the
# GPU, then the benchmark with CUDA graphs (`python -m benchmarks run --device-check`:
# plain vLLM at its defaults, vlens eager, vlens compiled with piecewise CUDA
# graphs), and print the tables. Meant to finish in under ~9 minutes on one
# H200, the install included; each phase prints its time.
#
# Settings (environment):
#   OUT               folder for the logs and results (default: benchmarks/.gpu-check)
#   GPU_VENV          the venv to make or reuse (default: benchmarks/.venv-gpu)
#   GPU_PYTHON        use this interpreter as it is and install nothing
#                     (a machine with vLLM's CUDA build already there)
#   GPU_SYSTEM_SITE=1 make the venv with --system-site-packages (reuse an
#                     installed torch); pip's own PIP_NO_INDEX / PIP_FIND_LINKS
#                     work for an offline install from wheels
#   GPU_TESTS         the test files (default below)
#   TESTS_TIMEOUT, BENCH_TIMEOUT, BENCH_BUDGET   seconds (defaults 240, 360, 240)
#   BENCH_ARGS        more arguments for `python -m benchmarks run` (e.g. "--model PATH")
#
# Exit status: 0 when every phase passed, 1 when one failed (the others
# still run), 2 when the machine cannot run the check at all (no GPU).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/benchmarks/.gpu-check}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T_ALL=$(date +%s)
STATUS=0

say() { echo "gpu-check: $*" | tee -a "$SUMMARY"; }
fail_fast() { say "FAILED: $*"; exit 2; }

# time one phase; its output goes to $OUT/<name>.log and, trimmed, here
phase() {
    local name="$1" limit="$2"; shift 2
    local t0=$(date +%s) rc
    say "== $name (limit ${limit} s): $*"
    timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$name.log"
    local dt=$(( $(date +%s) - t0 ))
    if [ "$rc" -eq 0 ]; then
        say "-- $name passed in ${dt} s"
    else
        [ "$rc" -eq 124 ] && say "-- $name ran past ${limit} s and was stopped"
        say "-- $name FAILED (exit $rc) after ${dt} s; full log: $OUT/$name.log"
        STATUS=1
    fi
    return "$rc"
}

# -- 0. a GPU, before anything slow --------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 \
    || fail_fast "no nvidia-smi on this machine: the GPU check needs an NVIDIA GPU and its driver (on a CPU machine run \`make bench\`)"
GPUS="$(nvidia-smi -L 2>&1)" \
    || fail_fast "nvidia-smi sees no GPU ($(echo "$GPUS" | head -n 1)): the GPU check needs an NVIDIA GPU (on a CPU machine run \`make bench\`)"
echo "$GPUS" | grep -q "^GPU " \
    || fail_fast "nvidia-smi lists no GPU: $(echo "$GPUS" | head -n 1)"
say "$(echo "$GPUS" | head -n 1)"

# -- 1. the venv ------------------------------------------------------------------
if [ -n "${GPU_PYTHON:-}" ]; then
    PY="$GPU_PYTHON"
    say "using $PY as it is (GPU_PYTHON): nothing installed"
else
    VENV="${GPU_VENV:-$ROOT/benchmarks/.venv-gpu}"
    PY="$VENV/bin/python"
    SITE=""
    [ "${GPU_SYSTEM_SITE:-0}" = 1 ] && SITE="--system-site-packages"
    if [ ! -x "$PY" ]; then
        python3 -m venv $SITE "$VENV" || fail_fast "could not make the venv $VENV"
    fi
    phase install 420 "$PY" -m pip install --progress-bar off -e ".[gpu,test]" \
        || fail_fast "the install failed (log: $OUT/install.log); no network here? set PIP_NO_INDEX=1 PIP_FIND_LINKS=wheels/ or GPU_PYTHON"
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY" || fail_fast "torch in $PY does not see a CUDA GPU, or vLLM is missing"
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False")
import vllm
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; vllm {vllm.__version__}")
EOF

# -- 2. the engine tests on the GPU -------------------------------------------------
# test_driver: async scheduling on (vLLM's CUDA default) against off, stop
# strings and stop tokens (the EOS path) under both, every caller at once;
# test_compiled: compiled mode with piecewise CUDA graphs
TESTS="${GPU_TESTS:-tests/test_driver.py tests/test_isolation.py tests/test_parity.py tests/test_steering.py tests/test_compiled.py tests/test_recompute.py}"
existing=""
for t in $TESTS; do [ -e "$t" ] && existing="$existing $t"; done
# shellcheck disable=SC2086
phase tests "${TESTS_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider $existing

# -- 3. the benchmark with CUDA graphs ---------------------------------------------
# shellcheck disable=SC2086
phase bench "${BENCH_TIMEOUT:-360}" env PYTHONUNBUFFERED=1 "$PY" -m benchmarks run --device-check \
    --no-widgets --budget "${BENCH_BUDGET:-240}" ${BENCH_ARGS:-}
if grep -q '"suite": "gpu"' benchmarks/results.jsonl 2>/dev/null; then
    cp benchmarks/results.jsonl "$OUT/results.jsonl"
    # the tables, from the JSONL (also when the run stopped after the lines were written)
    "$PY" -c "from benchmarks.report import tables; from benchmarks.results import latest; \
print(tables(latest('benchmarks/results.jsonl', 'gpu')))" > "$OUT/tables.md" 2>&1 && cat "$OUT/tables.md"
fi

say "done in $(( $(date +%s) - T_ALL )) s; exit $STATUS (logs and results in $OUT)"
exit "$STATUS"
