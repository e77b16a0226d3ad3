#!/usr/bin/env bash
# The GPU machine's one command, from the repo root: `bash scripts/gpu_check.sh`.
# Runs (a) the kernel tests natively on CUDA, (b) the GPU-marked tests, (d) the graph-padding test
# with the opt-in fast paths on, (c) the quick decode benchmark; each step's log goes to $OUT (default /tmp/out). Every step runs even if an earlier one
# failed; each has a time limit so the whole run stays under ~9 minutes. Ends with a summary table
# and exits non-zero if any step failed.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONPATH=.
# Kernel tests run natively instead of in the Triton interpreter (see tests/kernels/conftest.py).
export SWASERVE_KERNEL_TESTS_ON_GPU=1
# GPU tests append one JSON line per result here (tests/gpu/engine_driver.py: record).
export SWASERVE_GPU_REPORT="$OUT/gpu_report.jsonl"
: > "$SWASERVE_GPU_REPORT"
BUDGET_S=${GPU_CHECK_BUDGET_S:-535}  # whole run, setup included; later steps get what is left
# Per-step limits. A fresh machine has no Triton cache: most of (a) and much of (b) is compiling.
LIMIT_A=190 LIMIT_B=330 LIMIT_C=110

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "nvidia-smi unavailable"
wheels=(.whl/*.whl)
if [ -e "${wheels[0]}" ] && ! python3 -c "import pytest" > /dev/null 2>&1; then
    # Carried wheels, only where pytest is missing (an older carried pytest breaks the machine's own
    # pytest plugins); no index, no deps.
    pip_cmd=(python3 -m pip)
    python3 -m pip --version > /dev/null 2>&1 || pip_cmd=(pip)
    if "${pip_cmd[@]}" install --no-index --no-deps --target /tmp/site "${wheels[@]}" > "$OUT/pip.log" 2>&1; then
        echo "installed ${#wheels[@]} carried wheel(s) into /tmp/site"
    else
        echo "pip install of .whl/ failed (see $OUT/pip.log)"
    fi
    export PYTHONPATH=/tmp/site:.
fi
python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "| device:",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
for name in ("triton", "transformers", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # report and carry on: the steps that need it will fail visibly
        print(name, "MISSING:", type(e).__name__, e)
EOF

NAMES=() RESULTS=() SECS=() NOTES=()

# run_step NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, record the outcome.
run_step() {
    local name=$1 limit=$2 log="$OUT/$1.log" start=$SECONDS rc result note
    shift 2
    local left=$((BUDGET_S - SECONDS - 5))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 10 ]; then
        NAMES+=("$name") RESULTS+=("NOT RUN") SECS+=(0) NOTES+=("no time left in the ${BUDGET_S}s budget")
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    case $rc in
        0) result=PASS ;;
        124 | 137) result=TIMEOUT ;;
        5) result="FAIL(no tests)" ;;
        *) result="FAIL(rc=$rc)" ;;
    esac
    # pytest's summary line, e.g. "3 failed, 40 passed, 2 skipped in 51.20s"; else the log's last line.
    note=$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$log" | tail -n 1 |
        sed -E 's/=+//g; s/ in [0-9.]+s.*//; s/^ +//; s/ +$//')
    [ -n "$note" ] || note=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-70)
    # A pytest run where everything was skipped (no CUDA seen) checked nothing.
    if [ "$result" = PASS ] && [[ $note == *skipped* || $note == *deselected* ]] && [[ $note != *passed* ]]; then
        result="FAIL(none ran)"
    fi
    NAMES+=("$name") RESULTS+=("$result") SECS+=($((SECONDS - start))) NOTES+=("$note")
    echo "   -> $result in $((SECONDS - start))s: $note  (log: $log)"
    if [ "$result" != PASS ]; then tail -n 25 "$log" | sed 's/^/   | /'; fi
}

run_step a_kernel_tests "$LIMIT_A" python3 -m pytest -q -p no:cacheprovider tests/kernels
run_step b_gpu_tests "$LIMIT_B" python3 -m pytest -q -p no:cacheprovider --durations=12 -m gpu \
    tests/gpu tests/unit/test_sampler.py
# The opt-in fast paths (skinny decode GEMMs, PDL launches, split combine in stage 1): graph padding
# must stay bit-identical.
SWASERVE_SKINNY_GEMM=1 SWASERVE_PDL=1 SWASERVE_FUSED_SPLIT_COMBINE=1 run_step d_fast_paths 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu/test_cuda_graph_padding.py
if [ -f benchmarks/decode.py ]; then
    run_step c_decode_bench "$LIMIT_C" python3 benchmarks/decode.py --quick
    if [ -f "$OUT/c_decode_bench.log" ]; then
        echo "== decode benchmark (tail)"
        tail -n 20 "$OUT/c_decode_bench.log"
    fi
else
    NAMES+=("c_decode_bench") RESULTS+=("SKIP") SECS+=(0) NOTES+=("benchmarks/decode.py not found")
fi

if [ -s "$SWASERVE_GPU_REPORT" ]; then
    echo "== GPU test results ($SWASERVE_GPU_REPORT)"
    cat "$SWASERVE_GPU_REPORT"
fi

echo
echo "== summary (total ${SECONDS}s, logs in $OUT)"
printf '%-16s | %-15s | %7s | %s\n' step result seconds "key numbers"
printf '%-16s-+-%-15s-+-%7s-+-%s\n' "----------------" "---------------" "-------" "-----------"
failed=0
for i in "${!NAMES[@]}"; do
    printf '%-16s | %-15s | %7s | %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
    case ${RESULTS[$i]} in PASS | SKIP) ;; *) failed=1 ;; esac
done
exit $failed
