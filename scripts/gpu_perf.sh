#!/usr/bin/env bash
# The GPU machine's benchmark command, from the repo root: `bash scripts/gpu_perf.sh [step ...]`.
# Steps (default: all but fastpaths, lm_head and floor): profile decode vs_hf offline prefill capacity
# sampler fastpaths lm_head floor. Each step's log goes to $OUT/<step>.log (default /tmp/out) and its
# last lines are printed; every step runs even if an earlier one failed, each under a time limit.
# The defaults need two 10-minute device calls: name the steps, e.g. `vs_hf offline decode`, then
# `profile prefill capacity sampler`.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(profile decode vs_hf offline prefill capacity sampler)

run() {  # run NAME LIMIT_S CMD...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   -> rc=$? in $((SECONDS - start))s"
    tail -n "${TAIL:-14}" "$OUT/$name.log" | sed 's/^/   | /'
}

for step in "${steps[@]}"; do
    case $step in
        profile)
            for cfg in "1b 1 512" "1b 64 512" "1b 256 512" "4b 1 1024"; do
                # shellcheck disable=SC2086
                TAIL=24 run "profile_${cfg// /_}" 120 python3 scripts/profile_step.py $cfg
            done ;;
        fastpaths)  # A/B of the opt-in skinny GEMMs, PDL launches and fused split combine
            for flags in "" "--pdl" "--pdl --fused-combine" "--skinny-gemm --pdl --fused-combine"; do
                # shellcheck disable=SC2086
                run "decode_ab${flags// /_}" 100 python3 benchmarks/decode.py --shapes 1b,4b --batch-sizes 1,64 \
                    --contexts 512 --steps 32 $flags
            done ;;
        decode) run decode 240 python3 benchmarks/decode.py --shapes 1b,4b --batch-sizes 1,16,64,256 \
            --contexts 512,1024,2048,8192 --steps 48 ;;
        vs_hf) run vs_hf 400 python3 benchmarks/vs_hf.py --peer-dir .peers ${VS_HF_ARGS:-} ;;
        offline) run offline 150 python3 benchmarks/offline_throughput.py ;;
        prefill) run prefill 90 python3 benchmarks/prefill.py ;;
        capacity) run capacity 240 python3 benchmarks/memory_capacity.py ;;
        sampler) TAIL=10 run sampler 120 python3 benchmarks/sampler.py ;;
        lm_head) run lm_head_sweep 200 python3 benchmarks/lm_head_sweep.py ;;
        floor) run kernel_floor 60 python3 benchmarks/kernel_floor.py ;;
        *) echo "unknown step $step" ;;
    esac
done
