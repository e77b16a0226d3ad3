#!/usr/bin/env bash
# Named GPU runs (Gemma 4, serving, deterministic mode, defaults...), from the repo root: `bash scripts/gpu_suite.sh step ...`.
# Steps: kernels (MoE + attention kernel tests, natively), parity (6-layer 26B-A4B shape vs HF), decode
# (bs 1/16/64 x ctx 1k/8k vs the active-expert roofline), moe_align (the MoE pair sort alone), all_reduce
# (one-shot / two-shot / NCCL on 2 and 4 GPUs), serve (200 requests @ 128 through `swaserve
# serve` on a random-weight 26B-A4B directory), capacity (hybrid vs one pool); for issue 21:
# served_vs_offline (its 256-request set on a random Gemma-3-1B), svo_poisson (the set as Poisson arrivals,
# SVO_RATE req/s; svo_poisson_512 with 512-token prefill chunks) and stress_1b (200 @ 128); for issue 20:
# prefix_1b / prefix_4b (benchmarks/prefix_cache.py, cache on vs off); for issue 17: det_kernels (the
# batch-invariant kernels natively), bi_gemm (benchmarks/bi_gemm_sweep.py), ua_sweep
# (benchmarks/unified_attention_sweep.py; UA_ARGS adds options, e.g. "--batch-sizes 64,256"), det_probes_{1b,4b,g4} (64
# probes alone vs among 100 others, mode on and off), det_cost_1b / det_cost_4b (decode step and offline
# throughput off vs on, top kernels; DET_ARGS adds options, e.g. "--profile-bs 1,256"), det_cost_g4 (the same for
# the Gemma 4 MoE shape, no profile; DET_ARGS replaces its batch sizes), det_tp2 / det_tp4 (2 / 4 GPUs: probes and
# cost under tensor parallelism, Gemma-4-26B-A4B) and det_serve / det_serve_4b (200 @ 128 through the server with --enable-deterministic-inference); for issue 19: spec_graphs
# (verify CUDA graphs vs eager) and spec_1b / spec_4b (benchmarks/speculative.py); overlap (overlap vs sync
# engines), overlap_eagle (the same and EAGLE-3 heads); for issue 22: pw_graphs
# (piecewise graphs vs eager, tiny families), whole / svo_whole (issue 39: whole extend graphs, tests, step times,
# the Poisson set served pieces vs whole; offline_whole: 1B and 4B offline tok/s pieces vs whole; router / router_graphs / router_decode: the MoE-layer fusions, tests and parity / graphs vs eager / decode off and on;
# mx_split / mx_lut / mx_lut_default / mx_ncu: MXFP4 experts split over K, converted by table lookups (tests, sweeps,
# parity, decode; Nsight Compute at one token); decode_all: the 1B / 4B / 26B-A4B / GPT-OSS-20B decode table in one call; gemv / gemv_tests / gemv_decode / gemv_pdl / pdl_rows: the one-row GEMV, kernel tests and sweep / GPU tests / decode off and on / PDL off and on / PDL up to one-row steps), pw_1b / pw_4b / pw_1b_det (benchmarks/piecewise.py; pw_profile:
# where a mixed step's time goes; pw_profile_whole: the same through whole extend graphs; unified_tiles: the 16- and 32-row extend tiles' tests natively, then pw_profile_whole; unified_gpu: the GPU tests of
# whole graphs and FP8 pools; unified_flat: the unified extend's one-loop form against the chunk loop; flat_bits: its bit tests alone), mimo_serve
# (200 @ 128 on a random 6-layer MiMo-V2 with piecewise graphs) and mtp_mimo; for issue 38: so_1b / so_4b (structured
# outputs vs unconstrained, benchmarks/structured_outputs.py); for issue 34: svo_url (the
# serving benchmark against a server it did not launch, --base-url); for issue 37: fp8 (block-FP8 kernel
# tests natively, tests/gpu/test_fp8_gpu.py, benchmarks/fp8_gemm.py), fp8_g4 (Gemma-4-26B-A4B --quantization fp8 vs
# bf16: probes and decode table, benchmarks/fp8_weights.py) and fp8_kv (the FP8 KV cache: kernel tests
# natively with tests/gpu/test_unified_fp8_gpu.py, tests/gpu/test_fp8_kv_gpu.py (FP8_KV_TESTS: a -k filter), benchmarks/fp8_kv.py),
# fp8_asm (the inline e4m3 conversion: kernel tests natively, decode step off / on) and mimo_full (4 GPUs of 141 GB: MiMo-V2-Flash at
# its released shape in FP8, TP=4: decode table and offline run, then 200 @ 128 served); for issue 36: ep_g4 (2 GPUs: offline output
# tok/s at 128 running on a random Gemma-4-26B-A4B, TP=1 vs TP=2 vs TP=2 with --enable-expert-parallel, one
# table; EP_ARGS adds offline_throughput.py options), scaling (the same table over SCALE_LAYOUTS, default
# "tp1 tp2 tp4", of SCALE_SHAPE, default gemma4-26b-a4b: issue 36's scaling tables), dp2 (2 GPUs: the served request set with
# --data-parallel-size 2 vs one replica, DP_SHAPE default 4b, DP_REQUESTS default 512). Logs in $OUT/<step>.log;
# every step runs under a time limit even if an earlier one failed; a summary table at the end.
# `--parallel STEP...` runs single-GPU steps at once, one per visible GPU (e.g. fp8 fp8_kv fp8_g4 on a 4-GPU host).
# The serve step needs a Gemma tokenizer in .gpu_assets/gemma_tok (carried: the machine has no network):
#   python -c "from swaserve.loader.default_model import default_model_path as p; from swaserve.tokenizer \
#   import Tokenizer; Tokenizer.from_gguf(p()).hf.save_pretrained('.gpu_assets/gemma_tok')"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
source scripts/carried_wheels.sh  # the packages the GPU machine lacks
steps=("$@")
if [ "${steps[0]:-}" = --parallel ]; then
    # --parallel STEP...: each step in its own process on its own GPU (round-robin over the visible ones:
    # more steps than GPUs share them), at once; single-GPU steps only. Each step's logs end up in one file,
    # $OUT/<step>.log (the device machine returns few files), then each step's summary is printed.
    steps=("${steps[@]:1}")
    mapfile -t gpus < <(python3 -c "import torch; [print(i) for i in range(torch.cuda.device_count())]")
    [ ${#gpus[@]} -gt 0 ] || { echo "no CUDA GPU visible"; exit 1; }
    pids=()
    for i in "${!steps[@]}"; do
        g=${gpus[$((i % ${#gpus[@]}))]} work=/tmp/gpu_suite_parallel/${steps[$i]}
        mkdir -p "$work"
        echo "== ${steps[$i]} on GPU $g"
        CUDA_VISIBLE_DEVICES=$g OUT="$work" bash "$0" "${steps[$i]}" > "$work/stdout" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    for st in "${steps[@]}"; do
        work=/tmp/gpu_suite_parallel/$st
        for f in "$work"/*.log "$work/stdout"; do
            [ -f "$f" ] && { echo "##### $(basename "$f")"; cat "$f"; }
        done > "$OUT/$st.log"
        echo; echo "== $st"
        sed -n '/^== summary/,$p' "$work/stdout"
    done
    exit 0
fi
[ ${#steps[@]} -gt 0 ] || steps=(kernels parity decode)
NAMES=() RESULTS=()

run() {  # run NAME LIMIT_S CMD...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "   -> rc=$rc in $((SECONDS - start))s"
    tail -n "${TAIL:-16}" "$OUT/$name.log" | sed 's/^/   | /'
    NAMES+=("$name") RESULTS+=("rc=$rc $((SECONDS - start))s: $(grep -E 'passed|failed|PASS|FAIL|concurrency ratio' "$OUT/$name.log" | tail -n 1 | cut -c1-110)")
}

model_dir() {  # model_dir SHAPE: a config-only directory (random weights via --load-format dummy) with the tokenizer
    local d=/tmp/model-$1
    mkdir -p "$d" && cp .gpu_assets/gemma_tok/* "$d"/
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import hf_config; \
hf_config('$1', max_positions=16384).save_pretrained('$d')"
    echo "$d"
}

model_dir_ctx() {  # model_dir_ctx SHAPE: as model_dir, with the released model's context (what defaults plan for)
    local d=/tmp/model-ctx-$1
    mkdir -p "$d" && cp .gpu_assets/gemma_tok/* "$d"/
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import hf_config; \
from defaults_sweep import MAX_POSITIONS; hf_config('$1', max_positions=MAX_POSITIONS['$1']).save_pretrained('$d')"
    echo "$d"
}

for step in "${steps[@]}"; do
    case $step in
        kernels)
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run kernels 150 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_fused_moe.py tests/kernels/test_decode_attention.py \
                tests/kernels/test_extend_attention.py tests/kernels/test_qk_norm_rope.py
            run gpu_kernels 150 python3 -m pytest -q -p no:cacheprovider -m gpu -s \
                tests/gpu/test_fused_moe_gpu.py tests/gpu/test_gemma4_kernels_gpu.py ;;
        parity)
            run parity 280 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_gemma4_vs_hf.py ;;
        decode)
            run decode 360 python3 benchmarks/decode.py --shapes gemma4-26b-a4b --batch-sizes 1,16,64 \
                --contexts 1024,8192 --steps 32 --warmup 4 ;;
        moe_bench)
            run moe_bench 90 python3 benchmarks/moe_kernel.py ;;
        moe_align)  # the MoE pair sort alone (align_pairs in a graph) at 1-256 tokens over 128 and 256 experts
            run moe_align 90 python3 benchmarks/moe_kernel.py --align-only ;;
        all_reduce)  # issue 36: one-shot vs two-shot vs NCCL (bits and us per call) on 2 and 4 GPUs
            run all_reduce 150 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_one_shot_gpu.py ;;
        fp8)  # issue 37: block-FP8 kernels natively (interpreter tests + real shapes), then the GEMM/MoE benchmark
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run fp8_kernels 200 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_fp8_gemm.py
            run fp8_gpu 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fp8_gpu.py
            run fp8_bench 420 python3 benchmarks/fp8_gemm.py ;;
        fp8_g4)  # issue 37: Gemma-4-26B-A4B with --quantization fp8 vs bf16 (the same random weights quantised):
            # 64 greedy probes (identical, first token, logit error; a bf16 each-alone control) and the decode table
            run fp8_g4 "${FP8_G4_S:-540}" python3 benchmarks/fp8_weights.py --shape gemma4-26b-a4b --batch-sizes 1,16,64 \
                --contexts "${FP8_G4_CTX:-1024,8192}" --steps 32 --warmup 4 --probes 64 --max-tokens 32 ;;
        fp8_kv)  # issue 37 part 3: the FP8 KV kernel tests natively, the FP8-vs-bf16 KV GPU test (graphs on), then KV
            # tokens at 32k (12B shape, 40 GiB), decode at bs 64 x 8k (4B shape) and 64-probe greedy agreement (270M)
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run fp8_kv_kernels 300 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_fp8_kv.py tests/gpu/test_unified_fp8_gpu.py
            run fp8_kv_gpu 300 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_fp8_kv_gpu.py \
                ${FP8_KV_TESTS:+-k "$FP8_KV_TESTS"}
            # the agreement part needs the embedded model's package, absent on the GPU machines: run it where
            # installed (`python benchmarks/fp8_kv.py --parts agreement`)
            run fp8_kv_bench 540 python3 benchmarks/fp8_kv.py --shape 12b --kv-gib 40 --decode-shape 4b --ctx 8192 \
                --bs 64 --probes 64 --parts "${FP8_KV_PARTS:-capacity,decode}" ;;
        so_1b|so_4b)  # issue 38: 256 concurrent requests with a JSON schema vs without (1B / 4B shape, random
            # weights; the 4B's step is the device's, not the host loop's). SO_ARGS adds options, e.g. --fill-threads 1,2
            # shellcheck disable=SC2086  # the options are words
            run "$step" 300 python3 benchmarks/structured_outputs.py --shape "${step#so_}" ${SO_ARGS:-} ;;
        serve)
            d=$(model_dir gemma4-26b-a4b)
            run serve 420 python3 benchmarks/serve_stress.py --launch --model "$d" --load-format dummy \
                --num-requests 200 --concurrency 128 --window 1024 --max-tokens 256 -- \
                --max-running-requests 128 --max-context 4096 ;;
        dp2)  # issue 36: `--data-parallel-size 2` on 2 GPUs against one replica, served (streaming), one table
            d=$(model_dir "${DP_SHAPE:-4b}")
            for v in "one|" "two|--data-parallel-size 2"; do
                # shellcheck disable=SC2086  # the replica flags are words
                run "dp2_${v%%|*}" 420 python3 benchmarks/serving_vs_offline.py --model "$d" --load-format dummy \
                    --num-requests "${DP_REQUESTS:-512}" --modes stream --output-json "$OUT/dp2_${v%%|*}.jsonl" ${v#*|}
            done
            python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {n: [json.loads(l) for l in (out / f"dp2_{n}.jsonl").read_text().splitlines()] if (out / f"dp2_{n}.jsonl").exists()
        else [] for n in ("one", "two")}
tps = {n: r[-1]["output_tok_s"] if r else None for n, r in rows.items()}
for n, r in rows.items():
    print(f"{n:4} replica(s): " + (f"{tps[n]:.1f} out tok/s, TTFT p50 {r[-1]['ttft_p50_ms']:.0f} ms, failed {r[-1]['failed']}"
                                   if r else "failed"))
if tps["one"] and tps["two"]:
    print(f"data-parallel 2 / 1: {tps['two'] / tps['one']:.2f}x  ({rows['two'][-1]['hardware']})")
PY
            ;;
        served_vs_offline)  # issue 21's request set on a random Gemma-3-1B
            d=$(model_dir 1b)
            run served_vs_offline 420 python3 benchmarks/serving_vs_offline.py --model "$d" --load-format dummy \
                --num-requests 256 ${SVO_ARGS:-} ;;
        svo_poisson)  # the same set arriving as a Poisson process at ~80% of the offline capacity
            d=$(model_dir 1b)
            run svo_poisson 420 python3 benchmarks/serving_vs_offline.py --model "$d" --load-format dummy \
                --num-requests 256 --request-rate "${SVO_RATE:-68}" --modes offline,stream ${SVO_ARGS:-} ;;
        fp8_asm)  # issue 37: the unified kernel's inline e4m3 conversion (default on sm_89+; SWASERVE_FP8_CVT_ASM=0
            # turns it off): the FP8 kernel tests natively, then the 4B bs 64 ctx 8k decode step, default and
            # deterministic mode, off and on
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run fp8_asm_kernels 300 python3 -m pytest -q \
                -p no:cacheprovider tests/kernels/test_fp8_kv.py tests/gpu/test_unified_fp8_gpu.py tests/gpu/test_fp8_kv_gpu.py
            for w in 0 1; do
                for det in "" --deterministic; do
                    # shellcheck disable=SC2086  # the flag is a word or nothing
                    SWASERVE_FP8_CVT_ASM=$w run "fp8_asm_${w}${det:+_det}" 200 python3 benchmarks/fp8_kv.py --parts decode \
                        --decode-shape 4b --bs 64 --ctx 8192 $det
                done
            done ;;
        router)  # issue 39: the MoE-layer fusions (defaults; SWASERVE_FUSED_ROUTER=0 / SWASERVE_FUSED_TAIL=0 turn
            # them off): the routers' top-k in one launch, Gemma 4's router and expert inputs in one, a Gemma 4
            # layer's end in one. Kernel tests natively, the routing alone against the torch ops, Gemma 4,
            # GPT-OSS and MiMo-V2 parity with HF (about 70 s a test)
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run router_kernels 150 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_router_topk.py tests/kernels/test_ffn_tail.py tests/kernels/test_moe_inputs.py \
                tests/kernels/test_fused_norm.py
            run router_alone 120 python3 benchmarks/moe_kernel.py --router-only
            run router_parity 400 python3 -m pytest -q -p no:cacheprovider \
                -m gpu tests/gpu/test_gemma4_vs_hf.py tests/gpu/test_gpt_oss_vs_hf.py tests/gpu/test_mimo_v2_flash_vs_hf.py ;;
        router_graphs)  # issue 39: with the fusions on, Gemma 4's parity with HF, the MoE families' graphs
            # against eager (fp32, whole extend graphs) and bit for bit in deterministic mode, GPT-OSS-20B
            # decode off / on
            run router_g4_parity 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gemma4_vs_hf.py
            run router_lockstep 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_piecewise_gpu.py \
                -k "(gemma4_moe or gpt_oss) and (deterministic or (fp32 and whole))"
            for v in 0 1; do
                SWASERVE_FUSED_ROUTER=$v SWASERVE_FUSED_TAIL=$v run "router_decode_$v" 100 python3 benchmarks/decode.py \
                    --shapes gpt-oss-20b --batch-sizes 1,16,64 --contexts 1024 --steps 32 --warmup 4
            done ;;
        router_mimo)  # issue 39: MiMo-V2's grouped router fused: bf16 parity with HF, graphs vs eager in fp32; then
            # the 26B-A4B and GPT-OSS-20B at bs 256 with the fusions, and where GPT-OSS-20B's bs-1 step goes
            run router_mimo_parity 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_mimo_v2_flash_vs_hf.py -k bf16
            run router_mimo_lockstep 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_piecewise_gpu.py \
                -k "mimo and fp32"
            run router_decode_256 130 python3 benchmarks/decode.py --shapes gemma4-26b-a4b,gpt-oss-20b --batch-sizes 256 \
                --contexts 1024 --steps 32 --warmup 4
            run profile_gpt_oss_bs1 120 python3 scripts/profile_step.py gpt-oss-20b 1 1024 ;;
        mx_split)  # issue 39: MXFP4 experts split over K at decode sizes (`fused_moe._split_k`): the kernel tests
            # natively (real gpt-oss shapes against the reference, graph == eager), the MoE alone at 1 token with
            # splits 1 / 2 / default (4) / 8, and GPT-OSS-20B's decode step at bs 1 and 16
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run mx_split_tests 90 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_fused_moe_gpt_oss.py
            run mx_split_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fused_moe_gpt_oss_gpu.py
            run mx_split_moe 45 python3 benchmarks/moe_kernel.py --model gpt-oss-20b --tokens 1 \
                --variants scaled:0:4:0:1,scaled:0:4:0:2,scaled:0:4:0:8
            run mx_split_decode 100 python3 benchmarks/decode.py --shapes gpt-oss-20b --batch-sizes 1,16 \
                --contexts 1024 --steps 32 --warmup 4 ;;
        mx_lut)  # issue 39: MXFP4 weights converted by table lookups in inline PTX (moe_gemm.MX_LUT, a variant):
            # the exact-dequantisation and reference tests natively, the MoE alone per token count against the
            # default (dot_scaled), then GPT-OSS-20B's decode step with it (SWASERVE_MXFP4_MODE=lut)
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run mx_lut_tests 120 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_fused_moe_gpt_oss.py -k "lut or split"
            run mx_lut_moe 90 python3 benchmarks/moe_kernel.py --model gpt-oss-20b --tokens 1,16,64,256 \
                --variants lut:0:4:0,lut:0:8:0,lut:32:4:0
            SWASERVE_MXFP4_MODE=lut run mx_lut_decode 120 python3 benchmarks/decode.py --shapes gpt-oss-20b \
                --batch-sizes 1,16,64 --contexts 1024 --steps 32 --warmup 4 ;;
        mx_lut_default)  # issue 39: MX_LUT as the MXFP4 default: the MoE alone vs dot_scaled from 1 to 4096 tokens,
            # a tile / stage / split sweep at decode sizes, the real-shape tests, GPT-OSS parity with HF, graphs
            # vs eager bit for bit in deterministic mode, the decode table and where bs 1's step goes
            run lut_vs_scaled 120 python3 benchmarks/moe_kernel.py --model gpt-oss-20b --tokens 1,16,64,256,1024,4096 \
                --variants scaled:0:4:0
            run lut_sweep 150 python3 benchmarks/moe_kernel.py --model gpt-oss-20b --tokens 1,16,64 --variants \
                lut:0:4:2,lut:0:4:3,lut:0:4:4,lut:0:4:5,lut:32:4:3,lut:128:4:3,lut:128:8:3,lut:0:8:3,lut:0:2:3,lut:0:4:3:2,lut:0:4:3:8,lut:0:4:3:16,lut:32:4:4:8,lut:64:4:4:1
            run lut_gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fused_moe_gpt_oss_gpu.py
            run lut_parity 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpt_oss_vs_hf.py
            run lut_lockstep 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_piecewise_gpu.py \
                -k "gpt_oss and deterministic"
            run lut_decode 120 python3 benchmarks/decode.py --shapes gpt-oss-20b --batch-sizes 1,16,64,256 \
                --contexts 1024 --steps 32 --warmup 4
            run lut_profile_bs1 120 python3 scripts/profile_step.py gpt-oss-20b 1 1024 ;;
        mx_ncu)  # issue 39: Nsight Compute on the MXFP4 expert GEMMs at one token (gate/up, then down; the
            # default mode): throughput, occupancy, warp stalls, instruction mix
            ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -n 1)
            if [ -n "$ncu" ]; then
                run mx_ncu 240 "$ncu" --target-processes all -k regex:_moe_gemm_kernel -c 2 --section SpeedOfLight \
                    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
                    --section MemoryWorkloadAnalysis --section InstructionStats --section ComputeWorkloadAnalysis \
                    python3 benchmarks/moe_kernel.py --model gpt-oss-20b --tokens 1 --calls 2
            else
                echo "mx_ncu: no ncu on this machine ($(ls -d /usr/local/cuda*/bin /opt/nvidia/* 2> /dev/null | tr '\n' ' '))"
            fi ;;
        decode_all)  # issue 39: the decode table of the four shapes in one call (bs 1 / 16 / 64, ctx 1k), then where
            # the Gemma-4-26B-A4B bs-1 step goes
            run decode_all 330 python3 benchmarks/decode.py --shapes 1b,4b,gemma4-26b-a4b,gpt-oss-20b \
                --batch-sizes 1,16,64 --contexts 1024 --steps 32 --warmup 4
            run profile_g4_bs1 120 python3 scripts/profile_step.py gemma4-26b-a4b 1 1024 ;;
        gemv)  # issue 39: the one-row GEMV (`kernels/gemv.py`): its tests natively, then against cuBLAS on
            # the dense projections of 1B / 4B / Gemma-4-26B-A4B / GPT-OSS-20B (benchmarks/gemv_sweep.py)
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run gemv_kernels 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py
            run gemv_sweep 240 python3 benchmarks/gemv_sweep.py ${GEMV_ARGS:-} ;;
        gemv_tests)  # issue 39: the GPU tests whose steps run one row through the GEMV: graph padding (decode graphs of
            # 1..12 rows against eager), Gemma 3 1B and GPT-OSS (biased projections) against HF
            run gemv_tests 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cuda_graph_padding.py \
                tests/gpu/test_gemma3_1b_vs_hf.py tests/gpu/test_gpt_oss_vs_hf.py ;;
        gemv_pdl)  # issue 39: decode at bs 1 (ctx 1k) with the one-row GEMV, PDL off then on (SWASERVE_PDL: the GEMV loads
            # its first weight tile before the wait), GEMV_SHAPES as gemv_decode
            for v in 0 1; do
                SWASERVE_PDL=$v run "gemv_pdl_$v" 300 python3 benchmarks/decode.py \
                    --shapes "${GEMV_SHAPES:-1b,4b,gemma4-26b-a4b,gpt-oss-20b}" --batch-sizes "${GEMV_BS:-1}" \
                    --contexts 1024 --steps 32 --warmup 4
            done ;;
        pdl_rows)  # issue 39: PDL up to one-row steps (SWASERVE_PDL=1 SWASERVE_PDL_MAX_ROWS=1) against PDL off, decode at
            # bs 1 / 64 (ctx 1k), GEMV_SHAPES as gemv_decode; then graph padding and 1B parity with it on
            run pdl_rows_off 300 python3 benchmarks/decode.py --shapes "${GEMV_SHAPES:-1b,4b,gemma4-26b-a4b,gpt-oss-20b}" \
                --batch-sizes 1,64 --contexts 1024 --steps 32 --warmup 4
            SWASERVE_PDL=1 SWASERVE_PDL_MAX_ROWS=1 run pdl_rows_on 300 python3 benchmarks/decode.py \
                --shapes "${GEMV_SHAPES:-1b,4b,gemma4-26b-a4b,gpt-oss-20b}" --batch-sizes 1,64 --contexts 1024 --steps 32 --warmup 4
            SWASERVE_PDL=1 SWASERVE_PDL_MAX_ROWS=1 run pdl_rows_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/gpu/test_cuda_graph_padding.py tests/gpu/test_gemma3_1b_vs_hf.py ;;
        gemv_decode)  # issue 39: decode at bs 1 / 4 (ctx 1k) with the library GEMMs (SWASERVE_GEMV=0), then with the
            # one-row GEMV (the default), GEMV_SHAPES (default 1b,4b,gemma4-26b-a4b,gpt-oss-20b) one process each way
            for v in 0 1; do
                SWASERVE_GEMV=$v run "gemv_decode_$v" 300 python3 benchmarks/decode.py \
                    --shapes "${GEMV_SHAPES:-1b,4b,gemma4-26b-a4b,gpt-oss-20b}" --batch-sizes "${GEMV_BS:-1,4}" \
                    --contexts 1024 --steps 32 --warmup 4
            done ;;
        router_decode)  # issue 39: decode with the MoE-layer fusions off, then on (`router`)
            for v in 0 1; do
                SWASERVE_FUSED_ROUTER=$v SWASERVE_FUSED_TAIL=$v run "router_decode_$v" 300 \
                    python3 benchmarks/decode.py --shapes gemma4-26b-a4b,gpt-oss-20b --batch-sizes 1,16,64 \
                    --contexts 1024 --steps 32 --warmup 4
            done ;;
        whole)  # issue 39: extend steps as one graph replay, attention inside (--extend-graph whole): the GPU
            # lockstep tests against eager (tiny families, default and deterministic), then step times on 1B
            run whole_tests 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_piecewise_gpu.py -k whole
            run whole_1b 300 python3 benchmarks/piecewise.py --shape 1b --kv-mb 16384 --whole ;;
        svo_whole)  # issue 39: the Poisson set served with piecewise graphs, then with whole extend graphs
            d=$(model_dir 1b)
            for g in pieces whole; do
                # shellcheck disable=SC2086  # the options are words
                run "svo_$g" 290 python3 benchmarks/serving_vs_offline.py --model "$d" --load-format dummy \
                    --num-requests 256 --request-rate "${SVO_RATE:-68}" --modes offline,stream --extend-graph $g \
                    ${SVO_ARGS:-}
            done ;;
        offline_whole)  # issue 39: offline output tok/s (256 requests at once) with pieces vs whole extend graphs
            for shape in 1b 4b; do
                d=$(model_dir $shape)
                for g in pieces whole; do
                    run "offline_${shape}_$g" 150 python3 benchmarks/serving_vs_offline.py --model "$d" \
                        --load-format dummy --num-requests 256 --modes generate --extend-graph $g
                done
            done ;;
        svo_poisson_512)  # smaller prefill chunks: shorter mixed steps (ITL) against later first tokens (TTFT)
            d=$(model_dir 1b)
            run svo_poisson_512 420 python3 benchmarks/serving_vs_offline.py --model "$d" --load-format dummy \
                --num-requests 256 --request-rate "${SVO_RATE:-68}" --modes offline,stream --max-prefill-tokens 512 \
                ${SVO_ARGS:-} ;;
        prefix_1b|prefix_4b)
            d=$(model_dir "${step#prefix_}")
            run "$step" 400 python3 benchmarks/prefix_cache.py --model "$d" --load-format dummy ;;
        det_kernels)
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run det_kernels 200 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_batch_invariant_kernels.py ;;
        bi_gemm)  # issue 17: the batch-invariant GEMM's tilings vs cuBLAS per projection and M, bitwise invariance
            run bi_gemm 400 python3 benchmarks/bi_gemm_sweep.py ${BI_GEMM_ARGS:-} ;;
        ua_sweep)  # issue 17: deterministic decode attention's launch settings vs the default mode's kernel
            run ua_sweep 300 python3 benchmarks/unified_attention_sweep.py --shapes 1b,4b ${UA_ARGS:-} ;;
        overlap)  # overlap vs sync engines (fp32, and bf16 in deterministic mode)
            run overlap 200 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_overlap_gpu.py ;;
        overlap_eagle)  # overlap vs sync engines and EAGLE-3 heads, each file in its own process
            run overlap 200 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_overlap_gpu.py
            run eagle3 200 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_eagle3_gpu.py ;;
        det_probes_1b|det_probes_4b|det_probes_g4)
            shape=${step#det_probes_}
            [ "$shape" = g4 ] && shape=gemma4-26b-a4b
            run "$step" 400 python3 benchmarks/deterministic.py --model "$shape" --probes --control ;;
        det_cost_1b|det_cost_4b)
            run "$step" 400 python3 benchmarks/deterministic.py --model "${step#det_cost_}" --profile ${DET_ARGS:-} ;;
        det_cost_g4)  # the Gemma 4 MoE shape: batches its KV budget holds beside 52 GB of weights
            run det_cost_g4 400 python3 benchmarks/deterministic.py --model gemma4-26b-a4b \
                ${DET_ARGS:---batch-sizes 1,32,64 --requests 256} ;;
        det_tp2|det_tp4)  # issue 36: deterministic mode under TP (rank-order all-reduce) on Gemma-4-26B-A4B: 64 probes
            # alone vs among 100 others (greedy and seeded), then its cost (decode bs 1/32/64, 256 requests offline)
            tp=${step#det_tp}
            run "${step}_probes" "${DET_TP_PROBES_S:-270}" python3 benchmarks/deterministic.py --model gemma4-26b-a4b \
                --tp "$tp" --probes ${DET_TP_ARGS:-}
            run "${step}_cost" "${DET_TP_COST_S:-300}" python3 benchmarks/deterministic.py --model gemma4-26b-a4b \
                --tp "$tp" --batch-sizes 1,32,64 --requests 256 ${DET_TP_ARGS:-} ;;
        det_serve|det_serve_4b)
            shape=1b window=512
            [ "$step" = det_serve_4b ] && shape=4b window=1024
            d=$(model_dir $shape)
            run "$step" 300 python3 benchmarks/serve_stress.py --launch --model "$d" --load-format dummy \
                --num-requests 200 --concurrency 128 --window $window --max-tokens 256 -- --max-running-requests 128 \
                --enable-deterministic-inference ;;
        stress_1b)
            d=$(model_dir 1b)
            run stress_1b 300 python3 benchmarks/serve_stress.py --launch --model "$d" --load-format dummy \
                --num-requests 200 --concurrency 128 --window 512 --max-tokens 256 -- --max-running-requests 128 ;;
        spec_graphs)  # issue 19: verify steps through CUDA graphs vs eager, shrinking batches, poisoned slots
            run spec_graphs 300 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_verify_graph_gpu.py ;;
        spec_1b|spec_4b)  # issue 19: plain vs n-gram vs self-draft at batch 1/8/32 (random weights)
            run "$step" 420 python3 benchmarks/speculative.py --shape "${step#spec_}" --methods plain,ngram,draft \
                --batch-sizes 1,8,32 --max-tokens 128 ;;
        pw_graphs)  # issue 22: prefill chunks and mixed steps through piecewise graphs vs eager, tiny families
            run pw_graphs 300 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/gpu/test_piecewise_gpu.py ;;
        pw_1b|pw_4b|pw_1b_det)  # issue 22: step time off/on and bit-identity, chunks 64..4096 and mixed steps
            shape=${step#pw_}
            det=""
            [ "$shape" = 1b_det ] && shape=1b det=--deterministic
            kv=16384
            [ "$shape" = 4b ] && kv=36864
            run "$step" 400 python3 benchmarks/piecewise.py --shape "$shape" --kv-mb $kv $det ;;
        launch_overhead)  # issue 21: host time per eager attention launch
            run launch_overhead 120 python3 benchmarks/launch_overhead.py ;;
        pw_profile)  # issue 21: where a piecewise mixed step's time goes (host launch path vs GPU kernels)
            run pw_profile 300 python3 benchmarks/piecewise.py --shape 1b --kv-mb 16384 --profile --chunks 64 \
                --mixed 8+56,40+280,40+640 ;;
        unified_tiles)  # issue 39: the unified attention's shorter extend tiles: its kernel tests natively (decode ==
            # extend bit for bit, the captured step, FP8 pools), then pw_profile_whole's steps (unified_gpu: the GPU tests)
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run unified_kernels 240 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_batch_invariant_kernels.py tests/kernels/test_unified_captured_step.py \
                tests/kernels/test_fp8_kv.py
            run pw_profile_whole 150 python3 benchmarks/piecewise.py --shape 1b --kv-mb 16384 --profile --whole \
                --chunks 512,1024 --mixed 35+512,35+1024,256+768 ;;
        unified_flat)  # issue 39: the unified extend's one-loop form (`unified_launch.flat_extend`, on by default on sm_90):
            # its bit tests natively, the extend sweep off and on, the whole-graph steps off and on (SWASERVE_UNIFIED_FLAT=0/1)
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run flat_kernels 200 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_batch_invariant_kernels.py -k "flat or tile_height or matches_reference"
            SWASERVE_UNIFIED_FLAT=0 run flat_sweep_off 200 python3 benchmarks/unified_attention_sweep.py --extend --shapes 1b,4b \
                --prefill 1x1024,4x2048
            SWASERVE_UNIFIED_FLAT=1 run flat_sweep_on 200 python3 benchmarks/unified_attention_sweep.py --extend \
                --shapes 1b,4b --prefill 1x1024,4x2048
            for flat in 0 1; do
                SWASERVE_UNIFIED_FLAT=$flat run "flat_pw_$flat" 150 python3 benchmarks/piecewise.py --shape 1b --kv-mb 16384 \
                    --profile --whole --chunks 512,1024,2048 --mixed 35+512,35+1024,256+768
            done ;;
        flat_bits)  # issue 39: the one-loop unified extend's bits against the chunk loop's natively, d32 and d256 (the
            # engine's 32- and 64-row launches: 5 stages on sm_90), ~2-3 minutes
            SWASERVE_KERNEL_TESTS_ON_GPU=1 run flat_bits 300 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_batch_invariant_kernels.py -k "flat_loop or flat_extend" ;;
        unified_gpu)  # issue 39: whole graphs against eager (and in deterministic mode) and FP8 pools on the GPU
            run unified_gpu 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_unified_fp8_gpu.py \
                tests/gpu/test_piecewise_gpu.py ;;
        pw_profile_whole)  # issue 39: where a prefill / mixed step's time goes through whole extend graphs
            # (the default), the served Poisson set's longest steps: its prompts run to 1024 tokens beside ~35 decodes
            run pw_profile_whole 300 python3 benchmarks/piecewise.py --shape 1b --kv-mb 16384 --profile --whole \
                --chunks "${PW_CHUNKS:-512,1024}" --mixed "${PW_MIXED:-35+512,35+1024,256+768}" ;;
        mimo_serve)  # issue 22: MiMo-V2 reduced shape, 200 @ 128 through the server, decode + piecewise graphs
            d=$(model_dir mimo-6l)
            run mimo_serve 420 python3 benchmarks/serve_stress.py --launch --model "$d" --load-format dummy \
                --num-requests 200 --concurrency 128 --window 129 --max-tokens 256 -- --max-running-requests 128 \
                --max-context 4096 --enable-piecewise-cuda-graph
            echo "   server log warnings: $(grep -ciE 'warn' "$OUT/mimo_serve.log")" ;;
        mimo_full)  # issue 37: MiMo-V2-Flash as released (309B, FP8, 48 layers, 256 experts), TP=4 on 4x H200:
            # decode steps at bs 1/16/64 (and 256 requests at 128 running), then 200 @ 128 through `swaserve serve`
            d=$(model_dir mimo-v2-flash)
            run mimo_full_decode "${MIMO_DECODE_S:-280}" python3 benchmarks/offline_throughput.py --shape mimo-v2-flash \
                --tp "${MIMO_TP:-4}" --num-requests "${MIMO_REQUESTS:-256}" --max-running-requests 128 --output-len 256 \
                --decode-table 1,16,64 --table-context 1024 ${MIMO_ARGS:-}
            run mimo_full_serve "${MIMO_SERVE_S:-300}" python3 benchmarks/serve_stress.py --launch --model "$d" \
                --load-format dummy --num-requests 200 --concurrency 128 --window 129 --max-tokens 256 -- \
                --tp "${MIMO_TP:-4}" --max-running-requests 128 --max-context 4096 ${MIMO_ARGS:-}
            echo "   server log warnings: $(grep -ciE 'warn' "$OUT/mimo_full_serve.log")" ;;
        mtp_mimo)  # issue 22: MiMo MTP (random weights: the mechanism's cost) vs plain at batch 1/8/32
            run mtp_mimo 420 python3 benchmarks/speculative.py --shape mimo-6l --methods plain,mtp \
                --batch-sizes 1,8,32 --max-tokens 128 --workloads ordinary ;;
        defaults_1b|defaults_4b|defaults_g4)  # issue 34: the defaults against a sweep of step budgets and running limits
            shape=${step#defaults_}
            [ "$shape" = g4 ] && shape=gemma4-26b-a4b
            run "$step" 560 python3 benchmarks/defaults_sweep.py --shape "$shape" ${DEFAULTS_ARGS:-} ;;
        served_default_1b|served_default_g4)  # issue 34: out of the box through the server (no engine flags), streaming
            shape=${step#served_default_}
            [ "$shape" = g4 ] && shape=gemma4-26b-a4b
            d=$(model_dir_ctx "$shape")
            run "$step" 420 python3 benchmarks/serving_vs_offline.py --model "$d" --load-format dummy \
                --num-requests 256 --modes generate,stream --clients 8 --api-server-count 2 ${SERVED_ARGS:-} ;;
        svo_url)  # issue 34: serving_vs_offline.py --base-url (a running server): issue 21's set, 256 at once
            d=$(model_dir 1b)
            python3 -m swaserve serve --model "$d" --load-format dummy --port 8765 --disable-prefix-cache \
                > "$OUT/svo_url_server.log" 2>&1 &
            srv=$!
            python3 -c "import time, httpx
for _ in range(900):
    try:
        if httpx.get('http://127.0.0.1:8765/health', timeout=2).status_code == 200: break
    except httpx.TransportError: pass
    time.sleep(1)"
            run svo_url 300 python3 benchmarks/serving_vs_offline.py --base-url http://127.0.0.1:8765 \
                --num-requests 256 --modes stream,nonstream --clients 8 ${SVO_ARGS:-}
            kill "$srv"; wait "$srv" ;;
        gptoss_moe)  # issue 35: the MXFP4 MoE kernel against the bf16 fused MoE, 20b and 120b expert shapes
            run gptoss_moe 200 python3 benchmarks/moe_kernel.py --model gpt-oss-20b --tokens 1,16,64,256
            run gptoss_moe_120b 200 python3 benchmarks/moe_kernel.py --model gpt-oss-120b --tokens 1,16,64,256 ;;
        gptoss_moe_sweep)  # issue 35: the MXFP4 GEMM's dequantisation modes x tiles (pick the default from it)
            v=${MOE_VARIANTS:-bits:0:4:0,float:0:4:0,group:0:4:0,bits:32:4:3,group:32:8:3,group:64:8:4,float:32:8:3}
            run gptoss_moe_sweep 300 python3 benchmarks/moe_kernel.py --model gpt-oss-20b --variants "$v"
            run gptoss_moe_sweep_120b 300 python3 benchmarks/moe_kernel.py --model gpt-oss-120b --variants "$v" ;;
        gptoss_decode_20b|gptoss_decode_20b_bf16|gptoss_decode_120b)  # issue 35: decode vs the roofline (bytes as stored)
            shape=gpt-oss-${step#gptoss_decode_}
            [ "$shape" = gpt-oss-20b_bf16 ] && shape=gpt-oss-20b-bf16
            run "$step" 420 python3 benchmarks/decode.py --shapes "$shape" --batch-sizes "${GPTOSS_BS:-1,16,64,256}" \
                --contexts "${GPTOSS_CTX:-1024,8192}" --steps 32 --warmup 4 --max-tokens-in-flight 2200000 ;;
        gptoss_serve_20b|gptoss_serve_120b)  # issue 35: 200 @ 128 through swaserve serve, decode + piecewise graphs
            shape=gpt-oss-${step#gptoss_serve_}
            d=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from common import model_dir; \
print(model_dir('$shape', tokenizer='words'))")
            run "$step" 420 python3 benchmarks/serve_stress.py --launch --model "$d" --load-format dummy \
                --num-requests 200 --concurrency 128 --window 128 --max-tokens 256 -- --max-running-requests 128 \
                --max-context 4096 --enable-piecewise-cuda-graph
            echo "   server log warnings: $(grep -ciE 'warn' "$OUT/$step.log")" ;;
        ep_g4|scaling)  # issue 36: offline output tok/s, 256 requests at 128 running, per layout, one table with the
            # ratio to the first layout. ep_g4: Gemma-4-26B-A4B TP=1 vs TP=2 vs TP=2 with experts split (2 GPUs);
            # scaling: SCALE_SHAPE (default gemma4-26b-a4b; 12b for the dense table) over SCALE_LAYOUTS (default
            # "tp1 tp2 tp4"; a layout ending in _ep splits the experts). EP_ARGS adds offline_throughput.py options.
            layouts=${SCALE_LAYOUTS:-tp1 tp2 tp4} shape=${SCALE_SHAPE:-gemma4-26b-a4b}
            [ "$step" = ep_g4 ] && layouts="tp1 tp2 tp2_ep" shape=gemma4-26b-a4b
            names=()
            for v in $layouts; do
                tp=${v#tp} ep=
                [ "${tp%_ep}" != "$tp" ] && tp=${tp%_ep} ep=--enable-expert-parallel
                # shellcheck disable=SC2086  # the layout's flags are words
                run "${step}_$v" "${SCALE_S:-300}" python3 benchmarks/offline_throughput.py --shape "$shape" \
                    --num-requests 256 --max-running-requests 128 --tp "$tp" $ep ${EP_ARGS:-}
                names+=("${step}_$v")
            done
            python3 - "$OUT" "${names[@]}" <<'PY'
import json, pathlib, sys
rows = []
for name in sys.argv[2:]:
    log = pathlib.Path(sys.argv[1]) / f"{name}.log"
    runs = [json.loads(l) for l in log.read_text().splitlines() if l.startswith('{"run"')] if log.exists() else []
    rows.append((name, runs[-1] if runs else None))
base = rows[0][1]["out_tok_per_s"] if rows and rows[0][1] else None
print(f"\n{'layout':16} {'out tok/s':>10} {'vs first':>8} {'seconds':>8} {'decode s':>9} {'retract':>8}  device")
for name, r in rows:
    if r is None:
        print(f"{name:16} {'failed':>10}")
        continue
    ratio = f"{r['out_tok_per_s'] / base:.2f}x" if base else "-"
    print(f"{name:16} {r['out_tok_per_s']:>10.1f} {ratio:>8} {r['seconds']:>8.1f} {r['decode_s']:>9.1f} "
          f"{r['retractions']:>8}  {r['hardware']}")
PY
            ;;
        capacity)
            run capacity 170 python3 benchmarks/memory_capacity.py --shape gemma4-26b-a4b --kv-gib 12 --context 8192 ;;
        *) echo "unknown step $step" ;;
    esac
done
echo
echo "== summary"
for i in "${!NAMES[@]}"; do printf '%-12s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
