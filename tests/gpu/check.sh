#!/usr/bin/env bash
# tests/gpu/check.sh: the GPU path checked end to end with one command, on an H100 or H200,
# within one device call: measure first, then test; a crash ends only its own process.
#
# Usage
#   bash tests/gpu/check.sh OUTDIR               # a session's steps; logs, JUnit XML and JSON go in OUTDIR
#   bash tests/gpu/check.sh --dry-run OUTDIR     # print the exact commands; run (and create) nothing
#   CHECK_STEPS="build suite ncu ncu-summary" bash tests/gpu/check.sh OUTDIR   # only these steps
#
# Needs, on the GPU machine: python3 with jax[cuda], torch, pytest; nvidia-cutlass (the
# CuTe headers of the sm_90a kernels: a wheel in .whl/ is unpacked where it is not
# installed; without it the portable kernels alone are built and checked); nvcc and
# nvidia-smi on the PATH; ncu and compute-sanitizer where they work (probed first).
# Nothing is downloaded: it builds the extension in place (build.py) and runs from the
# tree (PYTHONPATH=$PWD).
#
# Steps, in order (a session's default: every step but training and suite, which run
# only when CHECK_STEPS names them). A failing (or timed out) step never stops the ones
# after it; one whose tool does not work on this machine is "unavailable", not failed.
#   step         what                                                   H100 s   limit s
#   preflight    tests/gpu/preflight.py: the GPU, the CUTLASS headers        8        40
#                (a carried wheel unpacked, pip's output logged; missing:
#                said at once, portable kernels for sm_90), compute-
#                sanitizer and ncu probed on a ten-line CUDA program
#   build        python3 build.py --cuda-arch <arch> -j $(nproc)            75       150
#                (arch: preflight's; without it nvidia-smi's compute_cap:
#                9.0 -> sm_90a, 8.x -> sm_8x)
#   env          python3 -m jax_blocksparse; nvidia-smi, git commit, date,    3        30
#                tool versions into OUTDIR (meta.txt, nvidia-smi.txt)
#   bench        bench/session.py: bf16 at W 8192 x 8192, N = 8192, blocks  140       170
#                128/64/32/16 one process each (densities 0.1 first; the
#                Hopper and Ampere kernels and XLA's dot; torch BSR at 0.1),
#                then 4096^3 block 8, f16, f32 (TF32) as time allows; every
#                row saved as measured, a rerun resumes
#   crossover    bench/crossover.py: this device's crossover table          2        20
#   gpu-tests    tests/gpu/run_isolated.py: each test function of the      130       150
#                kernel tests in its own process, CHECK_PARALLEL at a time,
#                going on past a failure in a new process (twice at most);
#                memcheck on each function's first failure
#   training     tests/gpu/run_isolated.py: test_training_steps.py, one     80       120
#                process per model (only when named)
#   sanitizer    tests/gpu/run_sanitizer.sh: memcheck + racecheck           45        60
#   suite        JAX_BLOCKSPARSE_IMPL=kernels, tests/test_*.py one file    200       240
#                per process (largest first), CHECK_SUITE_PARALLEL at a
#                time (only when named)
#   ncu          ncu around bench/ncu_driver.py: each jbs kernel family     25        90
#                x dtype x block at density 0.1, once
#   ncu-summary  bench/ncu_summary.py: JSON + table (duration, occupancy,     1        20
#                tensor pipe, DRAM, registers)
# Each step runs under `timeout` with its limit, cut to what is left of CHECK_BUDGET_S
# (default 420 s: 7 minutes, 15 s of it kept for the summary), so the whole run ends
# within the budget; a step with under 5 s left is skipped. The bench, which fills what it
# is given, leaves the isolated tests and the sanitizer their usual times (the gate needs
# both: a sanitizer run cut short turns every key off). The default steps up to the
# sanitizer take about 400 s on an H100 or H200; ncu gets what is left.
# At the end bench/check_summary.py prints one table (each step's status, counts and
# seconds; every failing test with its first error line; the bf16 efficiency and speedup
# per op and block size at density 0.1, Ampere and Hopper) and writes OUTDIR/summary.json.
# Exit status: 0 if every step passed (or was unavailable), else 1 (2: usage).
#
# OUTDIR after a run: steps.tsv, meta.txt, nvidia-smi.txt, preflight.{log,json,env},
# env_report.txt, build.log, bench.{log,json} and bench/ (one JSON per bench item),
# crossover.log, crossovers.json, {gpu-tests,training,suite}.{log,json} and
# {gpu-tests,training,suite}/ (a log, JUnit XML and memcheck log per job),
# sanitizer.log, sanitizer_{memcheck,racecheck}.log, ncu.log, ncu_raw.csv,
# ncu_problems.json, ncu_summary.{txt,json}, summary.json.
#
# Environment
#   CHECK_STEPS           steps to run, space-separated (default: the session's, in the order above)
#   CHECK_BUDGET_S        seconds for the whole run (default 420; 0: only the per-step limits)
#   CHECK_CUDA_ARCH       build for this arch instead of the one preflight (or nvidia-smi) gives
#   CHECK_NCU_PATHS       the kernel paths ncu profiles (default "ampere hopper")
#   CHECK_PARALLEL        processes at a time for gpu-tests and training (default 8)
#   CHECK_SUITE_PARALLEL  ... for the suite (default 8)
#   CHECK_TAIL            lines of each step's log echoed to the console (default 6)
#   JBS_COMMIT            the commit recorded where the tree has no .git (default: git's HEAD)
# XLA_FLAGS, JAX_PLATFORMS, JAX_BLOCKSPARSE_IMPL and JAX_BLOCKSPARSE_HOPPER are unset
# (their values go in meta.txt); each step sets what it needs (the bench opens the
# Hopper gate for its Hopper rows itself, tests/gpu/test_bsmm_sm90.py for its tests).
set -uo pipefail

usage() {
    sed -n '2,/^set -uo pipefail/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

DRY=0
OUT=""
while [ "$#" -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "check.sh: unknown option $1" >&2; exit 2 ;;
        *)
            if [ -n "$OUT" ]; then echo "check.sh: one OUTDIR only" >&2; exit 2; fi
            OUT="$1"
            ;;
    esac
    shift
done
if [ -z "$OUT" ]; then
    echo "usage: bash tests/gpu/check.sh [--dry-run] OUTDIR   (--help for more)" >&2
    exit 2
fi
case "$OUT" in
    /*) ;;
    *) OUT="$PWD/$OUT" ;;
esac
OUT="${OUT%/}"

REPO="$(cd "$(dirname "$0")/../.." && pwd)" || exit 2
cd "$REPO" || exit 2

BUDGET="${CHECK_BUDGET_S:-420}"
RESERVE=15  # seconds of the budget kept for the summary (it collects the GPU tests' parameters)
TAIL="${CHECK_TAIL:-6}"
PARALLEL="${CHECK_PARALLEL:-8}"
SUITE_PARALLEL="${CHECK_SUITE_PARALLEL:-8}"
SESSION_STEPS="preflight build env bench crossover gpu-tests sanitizer ncu ncu-summary"
STEPS="${CHECK_STEPS:-$SESSION_STEPS}"
NCU_PATHS="${CHECK_NCU_PATHS:-ampere hopper}"
NCU_METRICS="gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread"
# The kernel tests, one process per test function (the sm90 file opens the Hopper gate itself).
GPU_TEST_FILES=(tests/gpu/test_bsmm_kernels.py tests/gpu/test_bsmm_sm90.py tests/gpu/test_bsconv_kernels.py)
# The models of tests/gpu/test_training_steps.py (its ORDER: longest first), one process
# each, selected by `-k MODEL]` (the end of the test id: "mlp]" is not "mlp_nnx]").
# tests/test_gpu_check.py checks this list against ORDER.
TRAINING_MODELS=(rnn_cells lstm_fused rigl conv mlp mlp_nnx)
TRAINING_FILE=tests/gpu/test_training_steps.py

now_us() {
    local t="${EPOCHREALTIME:-}"
    if [ -n "$t" ]; then echo "${t/[.,]/}"; else echo "$(($(date +%s) * 1000000))"; fi
}
T0="$(now_us)"

# The environment every step shares (recorded first: what was set before).
PREV_ENV="XLA_FLAGS=${XLA_FLAGS-<unset>} JAX_PLATFORMS=${JAX_PLATFORMS-<unset>} JAX_BLOCKSPARSE_IMPL=${JAX_BLOCKSPARSE_IMPL-<unset>} JAX_BLOCKSPARSE_HOPPER=${JAX_BLOCKSPARSE_HOPPER-<unset>}"
unset XLA_FLAGS JAX_PLATFORMS JAX_BLOCKSPARSE_IMPL JAX_BLOCKSPARSE_HOPPER
export PYTHONPATH="$REPO"
# The sm_90a kernels compile against nvidia-cutlass's CuTe headers. The GPU machine has
# no network: the preflight step unpacks a wheel carried in .whl/ (the device tool's
# `carry`) into .whl/site, which every step then finds.
export PYTHONPATH="$REPO:$REPO/.whl/site"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1

if [ -z "${JBS_COMMIT:-}" ]; then
    JBS_COMMIT="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || true)"
    if [ -n "$JBS_COMMIT" ] && [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null | head -n 1)" ]; then
        JBS_COMMIT="$JBS_COMMIT+dirty"
    fi
    JBS_COMMIT="${JBS_COMMIT:-unknown}"
fi
export JBS_COMMIT

# 9.0 -> sm_90a (wgmma needs the arch-specific target), 8.x -> sm_8x, else sm_XY.
arch_of() {
    case "$1" in
        9.0) echo sm_90a ;;
        8.*) echo "sm_8${1#8.}" ;;
        [0-9]*.[0-9]*) echo "sm_${1%%.*}${1#*.}" ;;
        *) echo "" ;;
    esac
}
COMPUTE_CAP=""
if command -v nvidia-smi >/dev/null 2>&1; then
    COMPUTE_CAP="$(timeout 20 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' \r')"
fi
ARCH="${CHECK_CUDA_ARCH:-$(arch_of "$COMPUTE_CAP")}"

# ---------------------------------------------------------------------------------
# Step runner
# ---------------------------------------------------------------------------------
NAMES=()
STATUSES=()
CHILD=""
# shellcheck disable=SC2317  # called by the trap
on_signal() {
    if [ -n "$CHILD" ]; then kill -TERM "$CHILD" 2>/dev/null; fi
    echo "check.sh: interrupted" >&2
    exit 130
}
trap on_signal INT TERM

# quoted ARGS...: the words as a shell would need them typed, separated by spaces.
quoted() {
    local out=() a q="'\\''"
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            out+=("$a")
        else
            out+=("'${a//\'/$q}'")
        fi
    done
    printf '%s' "${out[*]}"
}

wanted() {
    case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac
}

# limit_for SECONDS: the step's limit, cut to what is left of the budget (less the
# summary's reserve, and less KEEP: what the steps after it that the gate needs are kept).
KEEP=0
limit_for() {
    local limit="$1" left
    if [ "$BUDGET" -gt 0 ]; then
        left=$((BUDGET - RESERVE - KEEP - ($(now_us) - T0) / 1000000))
        if [ "$left" -lt "$limit" ]; then limit="$left"; fi
    fi
    if [ "$limit" -lt 0 ]; then limit=0; fi
    echo "$limit"
}

record() {  # record NAME STATUS RC SECONDS LIMIT LOG
    NAMES+=("$1")
    STATUSES+=("$2")
    if [ "$DRY" -eq 0 ]; then
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${6#"$OUT"/}" >>"$OUT/steps.tsv"
    fi
}

# run_step NAME LIMIT LOG [VAR=VALUE ...] -- COMMAND [ARGS ...]
run_step() {
    local name="$1" limit="$2" log="$3"
    shift 3
    local envs=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
        envs+=("$1")
        shift
    done
    shift
    local cmd=(timeout --kill-after=10 "$limit" env "${envs[@]}" "$@")
    if [ "$DRY" -eq 1 ]; then
        printf '# %s\n%s > %s 2>&1 < /dev/null\n' "$name" "$(quoted "${cmd[@]}")" "$(quoted "$log")"
        record "$name" dry-run "" "" "$limit" "$log"
        return 0
    fi
    echo "== [$name] $(quoted "${envs[@]}" "$@")"
    if [ "$limit" -lt 5 ]; then
        echo "== [$name] skipped: ${limit}s left of the ${BUDGET}s budget" | tee "$log"
        record "$name" skipped "" 0 "$limit" "$log"
        return 0
    fi
    local t0 rc secs status
    t0="$(now_us)"
    "${cmd[@]}" >"$log" 2>&1 </dev/null &
    CHILD=$!
    wait "$CHILD"
    rc=$?
    CHILD=""
    secs="$(awk -v us="$(($(now_us) - t0))" 'BEGIN { printf "%.1f", us / 1e6 }')"
    case "$rc" in
        0) status=pass ;;
        124 | 137) status=timeout ;;
        *) status=fail ;;
    esac
    if [ "$TAIL" -gt 0 ]; then tail -n "$TAIL" "$log" | sed 's/^/   | /'; fi
    echo "== [$name] $status (exit $rc) in ${secs}s (limit ${limit}s), log: $log"
    record "$name" "$status" "$rc" "$secs" "$limit" "$log"
}

# unavailable NAME WHY: a step whose tool does not work on this machine (preflight's probe):
# recorded as "unavailable", which is not a failure.
unavailable() {
    if [ "$DRY" -eq 1 ]; then
        printf '# %s: runs only where preflight found its tool available\n' "$1"
        return 0
    fi
    echo "== [$1] unavailable: $2"
    record "$1" unavailable "" 0 0 ""
}

# tool_ok STATUS: whether a step may use a tool preflight reported as STATUS (anything but
# "unavailable" or "absent": a step whose tool was not probed runs and speaks for itself).
tool_ok() {
    case "$1" in unavailable | absent) return 1 ;; *) return 0 ;; esac
}

# meta FILE COMMAND...: a fact about the machine into OUTDIR (never fails the run).
meta() {
    local file="$1"
    shift
    if [ "$DRY" -eq 1 ]; then
        printf '%s >> %s 2>&1\n' "$(quoted "$@")" "$(quoted "$file")"
        return 0
    fi
    timeout 30 "$@" >>"$file" 2>&1 </dev/null || echo "($* failed: exit $?)" >>"$file"
}

# isolated NAME LIMIT PARALLEL [VAR=VALUE ...] -- RUNNER ARGS...: a run_isolated.py step.
# The runner gets the step's limit less 10 s as its budget, so it writes its JSON and
# stops its jobs before `timeout` would kill it.
isolated() {
    local name="$1" limit="$2" parallel="$3"
    shift 3
    local envs=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
        envs+=("$1")
        shift
    done
    shift
    local budget=$((limit > 20 ? limit - 10 : limit))
    run_step "$name" "$limit" "$OUT/$name.log" "${envs[@]}" -- \
        python3 tests/gpu/run_isolated.py --out "$OUT/$name" --json "$OUT/$name.json" \
        --parallel "$parallel" --budget "$budget" "$@" -- -p no:cacheprovider
}

# ---------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------
if [ "$DRY" -eq 1 ]; then
    echo "# check.sh --dry-run: the commands a run would make, in order (nothing is run)"
    printf '# budget %ss; steps: %s\n' "$BUDGET" "$STEPS"
    printf 'cd %s\n' "$(quoted "$REPO")"
    printf 'unset XLA_FLAGS JAX_PLATFORMS JAX_BLOCKSPARSE_IMPL JAX_BLOCKSPARSE_HOPPER\n'
    printf 'export %s XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 %s\n' \
        "$(quoted "PYTHONPATH=$PYTHONPATH")" "$(quoted "JBS_COMMIT=$JBS_COMMIT")"
    printf 'mkdir -p %s\n' "$(quoted "$OUT")"
    if [ -z "$ARCH" ]; then ARCH="<sm_XY from preflight, or nvidia-smi --query-gpu=compute_cap>"; fi
else
    mkdir -p "$OUT" || { echo "check.sh: cannot create $OUT" >&2; exit 2; }
    # Outputs of an earlier run in the same OUTDIR would be read as this run's.
    (cd "$OUT" && rm -rf steps.tsv meta.txt nvidia-smi.txt preflight.log preflight.json preflight.env \
        preflight_pip.log tool_probe tool_probe.cu env_report.txt build.log bench.log bench.json \
        crossover.log crossovers.json gpu-tests gpu-tests.log gpu-tests.json training training.log training.json \
        sanitizer.log sanitizer_memcheck.log sanitizer_racecheck.log suite suite.log suite.json ncu.log \
        ncu_raw.csv ncu_problems.json ncu_summary.txt ncu_summary.json summary.json)
    : >"$OUT/steps.tsv"
    echo "check.sh: $REPO -> $OUT (budget ${BUDGET}s, commit $JBS_COMMIT, compute capability ${COMPUTE_CAP:-none}, arch ${ARCH:-default})"
fi

# What ran where (also without the env step).
if [ "$DRY" -eq 0 ]; then
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "commit: $JBS_COMMIT"
        echo "git_head: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo none)"
        echo "host: $(hostname 2>/dev/null || echo unknown)"
        echo "gpu: $(timeout 20 nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader 2>/dev/null | head -n 1 || echo none)"
        echo "device: $(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || echo none)"
        echo "cuda_arch: ${ARCH:-default of build.py}"
        echo "nproc: $(nproc)"
        echo "budget_s: $BUDGET"
        echo "steps: $STEPS"
        echo "previous_env: $PREV_ENV"
    } >"$OUT/meta.txt"
else
    printf '# meta.txt: date -u, commit (%s), git rev-parse HEAD, hostname, nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total, arch, nproc\n' "$JBS_COMMIT"
fi

# 0. Preflight: the GPU, the CUTLASS headers (a carried wheel unpacked), the tools probed.
PREFLIGHT_SANITIZER=unprobed
PREFLIGHT_NCU=unprobed
if wanted preflight; then
    preflight_args=()
    if [ -n "${CHECK_CUDA_ARCH:-}" ]; then preflight_args=(--arch "$CHECK_CUDA_ARCH"); fi
    run_step preflight "$(limit_for 40)" "$OUT/preflight.log" -- \
        python3 tests/gpu/preflight.py --out "$OUT" "${preflight_args[@]}"
    if [ "$DRY" -eq 0 ]; then
        cat "$OUT/preflight.log"
        if [ -f "$OUT/preflight.env" ]; then
            # shellcheck disable=SC1091  # written by preflight.py
            . "$OUT/preflight.env"
            if [ -z "${CHECK_CUDA_ARCH:-}" ] && [ -n "${PREFLIGHT_ARCH:-}" ]; then ARCH="$PREFLIGHT_ARCH"; fi
        fi
    fi
fi

# 1. Build in place for this GPU, and record the environment.
if wanted build; then
    build_args=()
    if [ -n "$ARCH" ]; then build_args=(--cuda-arch "$ARCH"); fi
    run_step build "$(limit_for 150)" "$OUT/build.log" -- \
        python3 build.py "${build_args[@]}" -j "$(nproc)"
fi
if wanted env; then
    meta "$OUT/nvidia-smi.txt" nvidia-smi
    meta "$OUT/meta.txt" python3 --version
    meta "$OUT/meta.txt" nvcc --version
    meta "$OUT/meta.txt" ncu --version
    meta "$OUT/meta.txt" compute-sanitizer --version
    meta "$OUT/meta.txt" python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    run_step env "$(limit_for 30)" "$OUT/env_report.txt" -- python3 -m jax_blocksparse
fi

# 2. Measure first: the benchmark (it starts no product 25 s before its limit, and every
#    row is in bench.json as soon as it is measured), then this device's crossover table.
# The gate needs the isolated tests and a compute-sanitizer run that finished (one cut
# short turns every key off): the bench leaves them their usual times (an H200's 124 s of
# tests and 41 s of sanitizer, 2026-11-27, when a bench of 165 s had left the sanitizer 26).
keep_for() {  # keep_for STEP...: the usual seconds of the named steps that will run
    local total=0 step
    for step in "$@"; do
        wanted "$step" || continue
        case "$step" in
            gpu-tests) total=$((total + 130)) ;;
            sanitizer) if tool_ok "$PREFLIGHT_SANITIZER"; then total=$((total + 45)); fi ;;
        esac
    done
    echo "$total"
}
if wanted bench; then
    KEEP="$(keep_for gpu-tests sanitizer)"
    limit="$(limit_for 170)"
    run_step bench "$limit" "$OUT/bench.log" JAX_BLOCKSPARSE_IMPL=kernels -- \
        python3 bench/session.py --out "$OUT/bench" --json "$OUT/bench.json" --budget "$((limit > 20 ? limit - 5 : limit))"
    KEEP=0
fi
if wanted crossover; then
    run_step crossover "$(limit_for 20)" "$OUT/crossover.log" -- \
        python3 bench/crossover.py "$OUT/bench.json" --out "$OUT/crossovers.json"
fi

# 3. Correctness, each test function in its own process (a kernel fault ends only its own).
# The memcheck reruns of first failures, where compute-sanitizer works here.
memcheck_args=()
if ! tool_ok "$PREFLIGHT_SANITIZER"; then memcheck_args=(--sanitizer ""); fi
if wanted gpu-tests; then
    KEEP="$(keep_for sanitizer)"
    isolated gpu-tests "$(limit_for 150)" "$PARALLEL" JBS_REQUIRE_KERNELS=1 -- \
        --split function --resume 2 --timeout 120 --sanitizer-timeout 60 "${memcheck_args[@]}" "${GPU_TEST_FILES[@]}"
    KEEP=0
fi

# 4. Whole training steps (CUDA graphs), one process per model (each runs its own children).
if wanted training; then
    training_args=()
    for model in "${TRAINING_MODELS[@]}"; do training_args+=(--keyword "$model]"); done
    isolated training "$(limit_for 120)" "$PARALLEL" JBS_REQUIRE_KERNELS=1 -- \
        "${training_args[@]}" --timeout 110 --sanitizer "" "$TRAINING_FILE" \
        "$TRAINING_FILE::test_cases_cover_every_model" \
        "$TRAINING_FILE::test_forced_graphs_cover_the_command_types_that_matter"
fi

# 5. compute-sanitizer: memcheck and racecheck on the kernel tests' sanitizer subset.
if wanted sanitizer; then
    if tool_ok "$PREFLIGHT_SANITIZER"; then
        run_step sanitizer "$(limit_for 60)" "$OUT/sanitizer.log" -- \
            bash tests/gpu/run_sanitizer.sh --log-dir "$OUT"
    else
        unavailable sanitizer "compute-sanitizer: $PREFLIGHT_SANITIZER on this machine (preflight.json)"
    fi
fi

# 6. The whole suite through the kernels, XLA's default settings, one file per process.
if wanted suite; then
    suite_files=(tests/test_*.py)
    isolated suite "$(limit_for 240)" "$SUITE_PARALLEL" JAX_BLOCKSPARSE_IMPL=kernels JBS_REQUIRE_KERNELS=1 -- \
        --order size --timeout 200 --sanitizer-timeout 60 "${memcheck_args[@]}" "${suite_files[@]}"
fi

# 7. Nsight Compute: one launch per kernel family x dtype x block size at density 0.1.
if wanted ncu && ! tool_ok "$PREFLIGHT_NCU"; then
    unavailable ncu "ncu: $PREFLIGHT_NCU on this machine (preflight.json)"
elif wanted ncu; then
    run_step ncu "$(limit_for 90)" "$OUT/ncu.log" JAX_BLOCKSPARSE_IMPL=kernels -- \
        ncu --clock-control none --kernel-name-base demangled --kernel-name regex:jbs --csv --page raw \
        --metrics "$NCU_METRICS" --log-file "$OUT/ncu_raw.csv" \
        python3 bench/ncu_driver.py --density 0.1 --paths $NCU_PATHS --problems "$OUT/ncu_problems.json"
fi
if wanted ncu-summary && ! tool_ok "$PREFLIGHT_NCU"; then
    unavailable ncu-summary "ncu: $PREFLIGHT_NCU on this machine (preflight.json)"
elif wanted ncu-summary; then
    run_step ncu-summary "$(limit_for 20)" "$OUT/ncu_summary.txt" -- \
        python3 bench/ncu_summary.py "$OUT/ncu_raw.csv" "$OUT/ncu.log" --problems "$OUT/ncu_problems.json" \
        --json "$OUT/ncu_summary.json" --min-rows 1
fi

# 8. The summary table.
if [ "$DRY" -eq 1 ]; then
    printf '# summary\n'
    printf 'python3 bench/check_summary.py %s\n' "$(quoted "$OUT")"
    exit 0
fi
echo
echo "================================ summary ================================"
if ! timeout "$((RESERVE > 5 ? RESERVE - 2 : 5))" python3 bench/check_summary.py "$OUT"; then
    if [ ! -s "$OUT/summary.json" ]; then  # the script itself failed: the bare table
        printf '%-12s %s\n' step status
        while IFS=$'\t' read -r name status rc secs limit log; do
            printf '%-12s %-8s exit %-4s %6ss (limit %ss) %s\n' "$name" "$status" "$rc" "$secs" "$limit" "$log"
        done <"$OUT/steps.tsv"
    fi
fi
echo "total: $(awk -v us="$(($(now_us) - T0))" 'BEGIN { printf "%.1f", us / 1e6 }')s; outputs in $OUT"
failed=0
for i in "${!NAMES[@]}"; do
    case "${STATUSES[$i]}" in pass | unavailable) ;; *) failed=1 ;; esac
done
if [ "${#NAMES[@]}" -eq 0 ]; then
    echo "check.sh: no step ran (CHECK_STEPS=$STEPS)" >&2
    failed=1
fi
exit "$failed"
