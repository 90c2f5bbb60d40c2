#!/usr/bin/env bash
# Runs the GPU kernel tests under compute-sanitizer (memcheck, then racecheck) and exits
# non-zero if either tool reports an error or the tests fail.
#
#   tests/gpu/run_sanitizer.sh                          # default: a reduced but complete subset
#   tests/gpu/run_sanitizer.sh -k "bf16 and 8"          # any pytest arguments instead
#   tests/gpu/run_sanitizer.sh --log-dir out/ [ARGS]    # logs in out/sanitizer_{memcheck,racecheck}.log
#
# Logs: one per tool, in --log-dir DIR (or $JBS_SANITIZER_LOG_DIR) as
# sanitizer_<tool>.log; without either, in fresh temporary files (mktemp), as before.
# The tests run with $PYTHON (default python3).
#
# Only the jax-blocksparse kernels (namespace jbs) are checked, not XLA's own kernels.
set -uo pipefail

LOG_DIR="${JBS_SANITIZER_LOG_DIR:-}"
if [ "${1:-}" = "--log-dir" ]; then
    if [ "$#" -lt 2 ]; then
        echo "run_sanitizer.sh: --log-dir needs a directory" >&2
        exit 2
    fi
    LOG_DIR="$2"
    shift 2
fi
if [ -n "$LOG_DIR" ]; then  # made absolute before the cd below
    if ! mkdir -p "$LOG_DIR" || ! LOG_DIR="$(cd "$LOG_DIR" && pwd)"; then
        echo "run_sanitizer.sh: cannot create log directory $LOG_DIR" >&2
        exit 2
    fi
fi
cd "$(dirname "$0")/../.." || exit 2

SANITIZER="${COMPUTE_SANITIZER:-compute-sanitizer}"
PYTHON="${PYTHON:-python3}"
if ! command -v "$SANITIZER" >/dev/null 2>&1; then
    echo "run_sanitizer.sh: $SANITIZER not found (set COMPUTE_SANITIZER)" >&2
    exit 2
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_BLOCKSPARSE_IMPL=kernels
if [ "$#" -eq 0 ]; then
    set -- -k "sanitizer_subset"
fi

status=0
for tool in memcheck racecheck; do
    if [ -n "$LOG_DIR" ]; then
        log="$LOG_DIR/sanitizer_${tool}.log"
    else
        log="$(mktemp -t "jbs-${tool}-XXXX.log")"
    fi
    echo "== compute-sanitizer --tool $tool (log: $log)"
    "$SANITIZER" --tool "$tool" --error-exitcode 99 --kernel-name kns=jbs \
        --print-limit 100 \
        "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu/test_bsmm_kernels.py tests/gpu/test_bsmm_sm90.py "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "== $tool: exit status $rc" >&2
        status=1
    fi
    if grep -Eq "ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9]|Invalid __(global|shared)__|Race reported" "$log"; then
        echo "== $tool reported errors" >&2
        status=1
    fi
done
exit "$status"
