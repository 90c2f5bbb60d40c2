#!/usr/bin/env bash
# Runs the GPU kernel tests under compute-sanitizer (memcheck, then racecheck) and exits
# non-zero if either tool reports an error or the tests fail.
#
#   tests/gpu/run_sanitizer.sh                 # default: a reduced but complete subset
#   tests/gpu/run_sanitizer.sh -k "bf16 and 8" # any pytest arguments instead
#
# Only the jax-blocksparse kernels (namespace jbs) are checked, not XLA's own kernels.
set -uo pipefail
cd "$(dirname "$0")/../.."

SANITIZER="${COMPUTE_SANITIZER:-compute-sanitizer}"
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
    log="$(mktemp -t "jbs-${tool}-XXXX.log")"
    echo "== compute-sanitizer --tool $tool (log: $log)"
    "$SANITIZER" --tool "$tool" --error-exitcode 99 --kernel-name kns=jbs \
        --print-limit 100 \
        python -m pytest -q -p no:cacheprovider tests/gpu/test_bsmm_kernels.py "$@" 2>&1 | tee "$log"
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
