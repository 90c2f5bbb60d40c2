#!/usr/bin/env bash
# tests/gpu/device_call.sh: a GPU session's main device call, whole: the check
# (tests/gpu/check.sh, its session steps, under a hard time limit), then everything it wrote
# packed into $OUT, so that a call cut short still brings back what was measured.
#
# Usage (the device tool's command; carry [".whl"] for the CUTLASS wheel; timeout_s 480):
#   bash tests/gpu/device_call.sh
#
# $OUT after it (each a single file: the device tool brings back at most 8):
#   check.tgz       the check's OUTDIR, all of it (logs, JUnit XML, JSON)
#   console.log     what the check printed (its summary table last)
#   bench.json      the merged benchmark rows, summary.json and preflight.json, where written
#
# Environment: CHECK_BUDGET_S (default 420) and every other CHECK_* variable of check.sh;
# DEVICE_CALL_LIMIT_S (default CHECK_BUDGET_S + 35): the hard limit on the check itself.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
: "${OUT:?device_call.sh: OUT, the output folder of the device tool, is not set}"
export CHECK_BUDGET_S="${CHECK_BUDGET_S:-420}"
LIMIT="${DEVICE_CALL_LIMIT_S:-$((CHECK_BUDGET_S + 35))}"
CHECK_DIR="${CHECK_DIR:-/tmp/jbs-check}"

pack() {
    tar czf "$OUT/check.tgz" -C "$(dirname "$CHECK_DIR")" "$(basename "$CHECK_DIR")" 2>/dev/null
    for name in bench.json summary.json preflight.json; do
        if [ -f "$CHECK_DIR/$name" ]; then cp "$CHECK_DIR/$name" "$OUT/"; fi
    done
    ls -la "$OUT"
}
trap pack EXIT

timeout --kill-after=5 "$LIMIT" bash tests/gpu/check.sh "$CHECK_DIR" 2>&1 | tee "$OUT/console.log"
rc="${PIPESTATUS[0]}"
echo "device_call.sh: check.sh exit $rc"
exit "$rc"
