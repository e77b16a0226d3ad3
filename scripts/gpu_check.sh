#!/usr/bin/env bash
# The GPU machine's one command, from the repo root: `bash scripts/gpu_check.sh [--steps a,b,...]`.
# Every step runs to completion within one 10-minute device call on a fresh machine (scripts/gpu_check.py):
# (a) the kernel tests natively on CUDA, (b) the GPU-marked tests, (c) graph padding with the opt-in fast
# paths on, (d) the tests that need two GPUs (where two are visible), then alone after the tests (e) the
# quick decode benchmark, (f) offline throughput and (g) GPT-OSS's MXFP4 MoE kernel against bf16.
# Tests are sharded over every visible GPU in parallel processes; logs and a summary table with pass/fail
# counts per step go to $OUT (default /tmp/out). Exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export OUT PYTHONPATH=. PYTHONUNBUFFERED=1
# GPU tests append one JSON line per result here (tests/gpu/engine_driver.py: record).
export SWASERVE_GPU_REPORT="$OUT/gpu_report.jsonl"
: > "$SWASERVE_GPU_REPORT"

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "nvidia-smi unavailable"
source scripts/carried_wheels.sh  # the packages the GPU machine lacks
python3 - <<'PY' 2>&1 | tee /tmp/gpu_check_env.txt
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "| devices:",
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] or "NO CUDA DEVICE")
for name in ("triton", "transformers", "pytest", "hypothesis", "zmq", "msgspec", "fastapi", "uvicorn", "openai", "httpx", "gguf", "sentencepiece", "psutil", "xgrammar", "openai_harmony"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "present"))
    except Exception as e:  # report and carry on: the steps that need it will fail visibly
        print(name, "MISSING:", type(e).__name__, e)
PY
exec python3 scripts/gpu_check.py "$@"
