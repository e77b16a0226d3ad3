"""The decode step's kernels compiled for an H100 (sm_90) on this CPU machine, in their PDL form
(`compile_sm90.py`, in a subprocess: this process runs Triton in interpreter mode). Checks what a
GPU run would otherwise be the first to see: each kernel releases the next one, then waits on the
previous one (`griddepcontrol.wait`) before it writes anything; only the weight-streaming GEMMs
read before the wait (their first weight tile, the point of PDL for them: the compiler must keep
that load above the wait), and every default launch configuration fits the H100's shared memory
(fp32 skinny tiles once did not), Gemma 4's d256/d512 decode and extend attention included, and the
FP8 KV cache's stores and attention kernels (e4m3 pools); and no kernel reads its tiles one 1- or 2-byte
element at a time (row strides that lost their divisibility by 16 did that to the block-FP8 GEMM: 12%
of cuBLAS on an H200), the block-FP8 GEMMs included; and deterministic attention feeds its MMAs operands
2 elements wide along K over e4m3 pools as over bf16 ones (a 16-row decode tile once took the e4m3 V tile
through a 4-wide operand layout, whose other summation order parted FP8 decode from extend on an H200);
and with the inline e4m3 conversion (`kv_quant.fp8_cvt_asm`, the unified kernel's default on sm_89+) it
reads no staged e4m3 tile one byte at a time from shared memory, as the split-KV decode kernel does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")
SCRIPT = Path(__file__).with_name("compile_sm90.py")


def test_pdl_kernels_compile_for_sm90_and_wait_before_they_write():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"no results (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    errors = [r for r in rows if "error" in r]
    assert not errors and proc.returncode == 0, errors or proc.stderr[-3000:]
    names = {r["kernel"] for r in rows}
    assert {"add_rms_norm", "qk_norm_rope_store", "decode_stage1[split]", "decode_stage1[split, fused combine]",
            "decode_stage2", "act_and_mul",
            "skinny_gemm[bf16]", "skinny_gated_gemm[fp32, K=1152]",
            "decode_stage1[d512 g8, direct]", "decode_stage1[d512 g8, split]", "decode_stage2[d512]",
            "decode_stage1[d256 g2, direct]", "extend[d256 g2, bf16]", "extend[d512 g8, bf16]",
            "extend[d512 g8, fp32]", "unified extend[d512 g8, fp32]", "unified extend[d256 g2, bf16]",
            "unified extend flat[d256 g2, bf16]", "qk_norm_rope_store[d512 k_eq_v]", "qk_norm_rope_store[d256 v_norm]",
            "qk_norm_rope_store[q only]", "qk_norm_rope_store[fp8 kv]", "store_kv[fp8 kv]",
            "decode_stage1[fp8 kv, split]", "decode_stage1[fp8 kv, direct]", "extend[fp8 kv]",
            "unified[fp8 kv, extend]", "unified merge[fp8 kv, decode]", "quant_fp8_groups",
            "unified[fp8 kv, decode request]", "unified[bf16 kv, decode chunk]",
            "fp8_gemm[w8a8, 2048 rows]", "fp8_gemm[w8a16, 64 rows]", "unified[fp8 kv asm, decode chunk]",
            "unified[fp8 kv asm, extend]", "route_topk[bf16, E=128, k=8, scaled]", "route_topk[fp32, E=32, k=4]", "ffn_tail[moe]",
            "ffn_tail[dense, 4 parts]", "moe_inputs", "route_grouped[E=256, k=8, 1 groups]",
            "route_grouped[E=256, k=8, 8 groups]", "moe_gemm[mxfp4 scaled, split 4, gate_up]",
            "moe_gemm[mxfp4 lut, gate_up]", "moe_gemm[mxfp4 lut, down]", "gemv[bf16, 4224 x 2816]",
            "gemv[bf16, bias, 2880 x 4096]", "gemv[bf16, 2560 x 10240]"} <= names
    for r in rows:  # the unified kernel's inline e4m3 conversion (sm_89+): tiles staged as fp16
        if "asm" in r["kernel"]:
            assert r["shared_byte_reads"] == 0 and r["dot_kwidths"] == [2], r
            if "decode" in r["kernel"]:
                assert not r["wgmma"], r  # the unified decode keeps its 16-row tile (the older MMA, as bf16)
    by_name = {r["kernel"]: r for r in rows}  # the split-KV decode kernel (no inline conversion) reads V a byte at a time
    assert by_name["decode_stage1[fp8 kv, split]"]["shared_byte_reads"] > 0, by_name["decode_stage1[fp8 kv, split]"]
    for r in rows:  # deterministic attention: every MMA operand 2 elements wide along K, e4m3 pools as bf16 ones
        if r["kernel"].startswith("unified["):  # (the older MMA or the warpgroup one: the same bits, measured)
            assert r["dot_kwidths"] == [2], r
    for r in rows:  # MXFP4 experts: MX_LUT's codes reach the MMA without byte reads from shared memory (the
        if r["kernel"].startswith("moe_gemm[mxfp4"):  # scale tile aside); dot_scaled's read each staged byte
            lut = "lut" in r["kernel"]
            assert (r["shared_byte_reads"] <= 8) == lut and r["narrow_reads"] <= 8, r  # scale bytes: one a group
            # MX_LUT's asm takes 4 code bytes a register: consecutive along K (dim 0 of the [K/2, N] tile, or
            # the K runs of the MMA's B operand), as its output order assumes
            assert all((p.get("order") == [0, 1] and p["size_per_thread"][0] % p["pack"] == 0)
                       or (p.get("dot_operand") == 1 and p["k_width"] % p["pack"] == 0)
                       for p in r["asm_pack_layouts"]) and bool(r["asm_pack_layouts"]) == lut, r
    for r in rows:
        assert r["fits_h100"], r
        # 16-byte tiles: row strides keep their divisibility (jit_per_batch); one bf16 value read alone: the
        # router's per-expert scale (a gather), the layer tail's scalar (MXFP4 scale bytes: above)
        if r["kernel"].startswith("gemv[bf16, bias"):  # a program's few bias values, once each (its row sums' layout)
            assert r["narrow_reads"] <= 8, r
        elif not r["kernel"].startswith("moe_gemm[mxfp4"):
            assert r["narrow_reads"] == (1 if r["kernel"].endswith("scaled]") or r["kernel"].startswith("ffn_tail") else 0), r
        if r["kernel"].startswith(("extend", "store_kv", "unified", "quant_fp8", "fp8_gemm", "route_")):  # no PDL
            continue
        assert r["pdl_wait"] and r["release_before_wait"] and r["writes_before_wait"] == 0, r
        weight_streaming = r["kernel"].startswith(("skinny", "gemv"))
        assert (r["reads_before_wait"] > 0) == weight_streaming, r
