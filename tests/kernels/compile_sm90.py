"""Compile the decode step's Triton kernels ahead of time for an H100 (sm_90) on a machine without a
GPU, and report what the GPU would otherwise be needed to find out: in the PDL form, whether the
kernel releases the next one before it waits (`griddepcontrol.wait`) and which global reads and
writes the compiled code issues before that wait, and how much shared memory each launch
configuration needs (the extend attention kernel too: shared memory only, it has no PDL form).
Prints one JSON line per kernel. Run by test_compile_sm90.py in a
subprocess, because the kernel tests' process has Triton in interpreter mode.

    python tests/kernels/compile_sm90.py
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "needs compiled (not interpreted) Triton kernels"

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# By module path: the package re-exports a function named decode_attention over the module's name.
activation = importlib.import_module("swaserve.kernels.activation")
decode_attention = importlib.import_module("swaserve.kernels.decode_attention")
extend_attention = importlib.import_module("swaserve.kernels.extend_attention")
fp8_gemm = importlib.import_module("swaserve.kernels.fp8_gemm")
norm = importlib.import_module("swaserve.kernels.norm")
router_topk = importlib.import_module("swaserve.kernels.router_topk")
ffn_tail = importlib.import_module("swaserve.kernels.ffn_tail")
moe_gemm = importlib.import_module("swaserve.kernels.moe_gemm")
moe_inputs = importlib.import_module("swaserve.kernels.moe_inputs")
qk_norm_rope = importlib.import_module("swaserve.kernels.qk_norm_rope")
skinny_gemm = importlib.import_module("swaserve.kernels.skinny_gemm")
gemv = importlib.import_module("swaserve.kernels.gemv")
store_kv = importlib.import_module("swaserve.kernels.store_kv")
unified_attention = importlib.import_module("swaserve.kernels.unified_attention")
extend_launch = importlib.import_module("swaserve.kernels.unified_launch").extend_launch

TARGET = GPUTarget("cuda", 90, 32)
H100_SMEM = 232448  # bytes of shared memory one block may use on an H100 (227 KiB)
_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
        torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8"}
_READ = re.compile(r"\b(ld\.global|cp\.async)")
_WRITE = re.compile(r"\b(st\.global|atom\.global|red\.global)")
# global loads narrower than 4 bytes: 1- and 2-byte elements read one at a time (a tile whose rows Triton
# cannot prove 16-byte aligned), scalar `ld.global.b8/b16` or 1/2-byte asynchronous copies
_SHARED_BYTE_READ = re.compile(r"\bld\.shared(\.\w+)*\.[bsu]8\b")  # one byte of a staged tile a load
_NARROW_READ = re.compile(r"\bld\.global(\.\w+)*\.[bsu](8|16)\b|\bcp\.async\.\w+\.shared\.global\S*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[12]|[12])\b")


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kw)` records the call instead of launching."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def _signature(kernel, args: tuple, kw: dict) -> tuple[dict, dict, dict, dict]:
    """Signature, constexprs, options and attributes as the JIT would specialise this call on a GPU:
    16-byte aligned pointers and ints divisible by 16 marked so, ints equal to 1 made constants
    (without the marks Triton cannot use asynchronous copies and the pipeline looks different)."""
    pdl = "USE_PDL" in kernel.arg_names
    sig, consts, attrs, options = {}, {}, {}, {"launch_pdl": pdl}
    named = dict(zip(kernel.arg_names, args))
    for k, v in kw.items():
        if k in ("num_warps", "num_stages"):
            options[k] = v
        elif k != "launch_pdl":
            named[k] = v
    if pdl:
        named["USE_PDL"] = True
    aligned = [["tt.divisibility", 16]]
    for i, p in enumerate(kernel.params):
        v = named[p.name]
        if p.is_constexpr or (type(v) is int and v == 1 and not p.do_not_specialize):
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _PTR[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = aligned
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i64" if abs(v) >= 2**31 else "i32"
            # Triton marks divisibility only where it also specialises on the value (never for an
            # argument in do_not_specialize, whatever do_not_specialize_on_alignment says)
            if v % 16 == 0 and not (p.do_not_specialize or p.do_not_specialize_on_alignment):
                attrs[(i,)] = aligned
        else:
            sig[p.name] = "fp32"
    return sig, consts, options, attrs


def _asm_pack_layouts(ttgir: str) -> list[dict]:
    """Each packed inline-asm op's pack size and operand layout: a blocked one's sizePerThread and order, or
    a dot operand's opIdx and kWidth. A pack of 4 is 4 consecutive elements of a thread, so it lies along
    one dimension only if the thread holds runs of 4k along it."""
    blocked = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{(.*?)\}>", ttgir, re.MULTILINE))

    def ints(key: str, text: str) -> list[int] | None:
        m = re.search(rf"{key} = \[([\d, ]+)\]", text)
        return [int(x) for x in m.group(1).split(",")] if m else None

    out = []
    for line in ttgir.splitlines():
        m = re.search(r"elementwise_inline_asm .*packed_element = (\d+).*? : tensor<[^,]*, (#blocked\d*|#ttg\.dot_op<\{[^}]*\}>)",
                      line)
        if not m:
            continue
        enc = m.group(2)
        row: dict = {"pack": int(m.group(1))}
        if enc.startswith("#blocked"):
            row |= {"size_per_thread": ints("sizePerThread", blocked.get(enc, "")), "order": ints("order", blocked.get(enc, ""))}
        else:
            row |= {"dot_operand": int(re.search(r"opIdx = (\d+)", enc).group(1)),
                    "k_width": int(re.search(r"kWidth = (\d+)", enc).group(1))}
        out.append(row)
    return out


def _check(name: str, module, attr: str, call) -> dict:
    # Every jit function of the module records (a wrapper may launch two kernels; helpers are never
    # called, as nothing launches); `attr` is the one compiled.
    kernels = {k: v for k, v in vars(module).items() if isinstance(v, triton.runtime.jit.JITFunction)}
    recorders = {k: _Recorder(v) for k, v in kernels.items()}
    for k, rec in recorders.items():
        setattr(module, k, rec)
    try:
        call()
    finally:
        for k, v in kernels.items():
            setattr(module, k, v)
    kernel = kernels[attr]
    args, kw = recorders[attr].calls[0]
    sig, consts, options, attrs = _signature(kernel, args, kw)
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=TARGET, options=options)
    lines = compiled.asm["ptx"].splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), len(lines))
    release = next((i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line), None)
    before = lines[:wait]
    return {"kernel": name, "pdl_wait": wait < len(lines),
            "release_before_wait": release is not None and release < wait,
            "reads_before_wait": sum(bool(_READ.search(line)) for line in before),
            "writes_before_wait": sum(bool(_WRITE.search(line)) for line in before),
            "narrow_reads": sum(bool(_NARROW_READ.search(line)) for line in lines),
            "shared_byte_reads": sum(bool(_SHARED_BYTE_READ.search(line)) for line in lines),
            # the MMA operands' k-widths (elements a thread holds along K: 2 for 16-bit operands; an 8-bit
            # tile converted after its shared-memory load shows 4) and whether the warpgroup MMA ran
            "dot_kwidths": sorted({int(k) for k in re.findall(r"kWidth = (\d+)", compiled.asm["ttgir"])}),
            "wgmma": "wgmma.mma_async" in compiled.asm["ptx"],
            "asm_pack_layouts": _asm_pack_layouts(compiled.asm["ttgir"]),
            "shared": compiled.metadata.shared, "fits_h100": compiled.metadata.shared <= H100_SMEM}


def _attention_cases() -> list[tuple]:
    """Decode and extend (the extend kernel's and the unified kernel's) at Gemma 4's head shapes with
    their default launch settings: sliding layers d256 with 16 q / 8 kv heads, full layers d512 with 16 q
    / 2 kv heads (a GQA group of 8). The
    fused combine and stage 2 only differ from the d256 split form by their epilogue: d512 only.
    Extend is not a decode-step kernel (no PDL form): only its shared memory is checked."""
    cases: list[tuple] = []
    for d, hq, hkv in ((256, 16, 8), (512, 16, 2)):
        q = torch.zeros(4, hq, d, dtype=torch.bfloat16)
        out = torch.zeros_like(q)
        kv = torch.zeros(64, hkv, d, dtype=torch.bfloat16)
        ip, ix = torch.zeros(5, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
        for splits, fused in ((1, False), (4, False), (4, True))[: 3 if d == 512 else 2]:
            tag = f"d{d} g{hq // hkv}, " + ("direct" if splits == 1 else "split, fused combine" if fused else "split")
            ctr = torch.zeros(64, dtype=torch.int32) if fused else None
            cases.append((f"decode_stage1[{tag}]", decode_attention, "_decode_stage1",
                          lambda q=q, kv=kv, out=out, ip=ip, ix=ix, splits=splits, ctr=ctr:
                          decode_attention.decode_attention(q, kv, kv, ip, ix, out, 1.0, num_kv_splits=splits,
                                                            split_counters=ctr)))
        if d == 512:
            cases.append((f"decode_stage2[d{d}]", decode_attention, "_decode_stage2",
                          lambda q=q, kv=kv, out=out, ip=ip, ix=ix:
                          decode_attention.decode_attention(q, kv, kv, ip, ix, out, 1.0, num_kv_splits=4)))
        for dtype in (torch.bfloat16, torch.float32):
            qe, kve = q.to(dtype), kv.to(dtype)
            cases.append((f"extend[d{d} g{hq // hkv}, {'bf16' if dtype == torch.bfloat16 else 'fp32'}]",
                          extend_attention, "_extend_kernel",
                          lambda qe=qe, kve=kve, ip=ip, ix=ix, w=1024 if d == 256 else None:
                          extend_attention.extend_attention(qe, kve[:4], kve[:4], torch.zeros_like(qe), kve, kve, ip,
                                                            ip, ix, ip[:4], 1.0, max_extend_len=4, window=w)))
            # the unified kernel's extend program on its 64-row tile (a long prefill's; launch settings:
            # `unified_launch.extend_launch`), and for d256 bf16 its one-loop form (`flat`: 5 stages)
            for flat in (False, True) if d == 256 and dtype == torch.bfloat16 else (False,):
                launch = (64, *extend_launch(64, d, qe.element_size(), flat)[1:])
                cases.append((f"unified extend{' flat' if flat else ''}[d{d} g{hq // hkv}, "
                              f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}]", unified_attention, "_unified_kernel",
                              lambda qe=qe, kve=kve, w=1024 if d == 256 else None, launch=launch, flat=flat:
                              unified_attention.unified_attention(
                                  qe, torch.zeros_like(qe), kve, kve, torch.zeros(8, 1024, dtype=torch.int32),
                                  torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
                                  torch.zeros(5, dtype=torch.int32), 1.0, max_extend_len=4, window=w, launch=launch,
                                  flat=flat)))
    return cases


def _mxfp4_moe_cases() -> list[tuple]:
    """gpt-oss-20b's MXFP4 expert GEMMs at one token (4 pairs in one 16-row block an expert): the default
    (`tl.dot_scaled`, split over K as `fused_moe` splits it at decode) and the MX_LUT variant (table-lookup
    conversion in inline PTX, which ptxas must accept), gate/up (gated, GPT-OSS's activation) and down."""
    H, I, E, pairs = 2880, 2880, 32, 4
    a, h = torch.zeros(pairs, H, dtype=torch.bfloat16), torch.zeros(pairs, I, dtype=torch.bfloat16)
    w1, s1 = torch.zeros(E, 2 * I, H // 32, 16, dtype=torch.uint8), torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8)
    w2, s2 = torch.zeros(E, H, I // 32, 16, dtype=torch.uint8), torch.zeros(E, H, I // 32, dtype=torch.uint8)
    b1, b2 = torch.zeros(E, 2 * I, dtype=torch.bfloat16), torch.zeros(E, H, dtype=torch.bfloat16)
    sp, be = torch.zeros(4 * 16, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    cases = []
    for mode, tag in ((moe_gemm.MX_SCALED, "scaled, split 4"), (moe_gemm.MX_LUT, "lut")):
        split = 4 if mode == moe_gemm.MX_SCALED else 1
        out1 = torch.zeros(split, pairs, 2 * I) if split > 1 else torch.zeros(pairs, I, dtype=torch.bfloat16)
        out2 = torch.zeros(split, pairs, H) if split > 1 else torch.zeros(pairs, H, dtype=torch.bfloat16)
        common = {"top_k": 4, "block_m": 16, "block_n": 64, "mx_mode": mode, "split_k": split}
        cases += [
            (f"moe_gemm[mxfp4 {tag}, gate_up]", moe_gemm, "_moe_gemm_kernel",
             lambda out1=out1, common=common: moe_gemm.moe_gemm(a, w1, s1, b1, out1, sp, be, pairs, a_per_token=True,
                                                                gated=True, activation="swiglu_oai", alpha=1.702,
                                                                limit=7.0, **common)),
            (f"moe_gemm[mxfp4 {tag}, down]", moe_gemm, "_moe_gemm_kernel",
             lambda out2=out2, common=common: moe_gemm.moe_gemm(h, w2, s2, b2, out2, sp, be, pairs, a_per_token=False,
                                                                gated=False, **common)),
        ]
    return cases


def _fp8_kv_cases() -> list[tuple]:
    """FP8 (e4m3) KV pools at Gemma 3's head (d256, 4 q heads a kv head, bf16): the stores (the fused
    norm/rotary/store, `store_kv`) and every attention kernel reading e4m3 tiles (decode split and
    direct, extend with e4m3 new tokens, the unified kernel's extend and decode). `store_kv`,
    extend and unified have no PDL form (their PDL checks are skipped)."""
    f8, bf16, T = torch.float8_e4m3fn, torch.bfloat16, 4
    q, out = torch.zeros(T, 4, 256, dtype=bf16), torch.zeros(T, 4, 256, dtype=bf16)
    kv = torch.zeros(64, 1, 256, dtype=f8)
    sc = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)}
    ip, ix, locs = torch.zeros(T + 1, dtype=torch.int32), torch.zeros(64, dtype=torch.int32), torch.zeros(T, dtype=torch.int64)
    table, rows, seq = torch.zeros(8, 1024, dtype=torch.int32), torch.zeros(T, dtype=torch.int32), torch.ones(T, dtype=torch.int32)
    cos = torch.zeros(T, 128)
    return [
        ("qk_norm_rope_store[fp8 kv]", qk_norm_rope, "_qk_norm_rope_store_kernel",
         lambda: qk_norm_rope.qk_norm_rope_store(torch.zeros(T, 6 * 256, dtype=bf16), 4, 1, 256, cos, cos,
                                                 torch.zeros(256, dtype=bf16), torch.zeros(256, dtype=bf16), 1e-6, kv,
                                                 kv, locs, unit_offset=True, **sc)),
        ("store_kv[fp8 kv]", store_kv, "_store_kv_kernel",
         lambda: store_kv.store_kv(kv, kv, locs, torch.zeros(T, 1, 256, dtype=bf16), torch.zeros(T, 1, 256, dtype=bf16),
                                   loc_map=ip, **sc)),
        ("decode_stage1[fp8 kv, split]", decode_attention, "_decode_stage1",
         lambda: decode_attention.decode_attention(q, kv, kv, ip, ix, out, 0.06, num_kv_splits=4, **sc)),
        ("decode_stage1[fp8 kv, direct]", decode_attention, "_decode_stage1",
         lambda: decode_attention.decode_attention(q, kv, kv, ip, ix, out, 0.06, num_kv_splits=1, **sc)),
        ("extend[fp8 kv]", extend_attention, "_extend_kernel",
         lambda: extend_attention.extend_attention(q, kv[:T], kv[:T], out, kv, kv, ip, ip, ix, ip[:T], 1.0,
                                                   max_extend_len=T, window=1024, **sc)),
        ("unified[fp8 kv, extend]", unified_attention, "_unified_kernel",
         lambda: unified_attention.unified_attention(q, out, kv, kv, table, rows, seq, ip, 1.0, max_extend_len=T,
                                                     window=1024, **sc)),
        # A decode program of each kind over e4m3 and bf16 pools: operands 2 wide along K (with a 16-row tile
        # the e4m3 V tile reached the older MMA converted after its shared-memory load, k-width 4: another
        # summation order than bf16's, so FP8 decode and extend parted; decode_config)
        *[(f"unified[{name}, decode {programs}]", unified_attention, "_unified_kernel",
           lambda pool=pool, programs=programs, scales=scales: unified_attention.unified_attention(
               q, out, pool, pool, table, rows, seq, ip, 1.0, max_extend_len=1, programs=programs, **scales))
          for name, pool, scales in (("fp8 kv", kv, sc), ("bf16 kv", kv.to(bf16), {}))
          for programs in ("block", "chunk", "request")],
        ("unified merge[fp8 kv, decode]", unified_attention, "_merge_kernel",
         lambda: unified_attention.unified_attention(q, out, kv, kv, table, rows, seq, ip, 1.0, max_extend_len=1,
                                                     programs="chunk", **sc)),
    ]


def _as_on_sm90(call):
    """`call` with the unified kernel's inline e4m3 conversion on: on an sm_89+ GPU it is (`kv_quant.
    fp8_cvt_asm`), and these arguments sit on the CPU, where it is off."""
    def run():
        old = unified_attention.fp8_cvt_asm
        unified_attention.fp8_cvt_asm = lambda device: True
        try:
            return call()
        finally:
            unified_attention.fp8_cvt_asm = old
    return run


def _fp8_asm_cases() -> list[tuple]:
    """The unified kernel's inline conversion of e4m3 tiles (the default on sm_89+, `kv_quant.fp8_cvt_asm`):
    its decode programs on their 16-row tile and its extend, at a Gemma-3-4B head (d256, GQA 2). Staged
    as fp16, the tiles reach the MMA 2 wide through `ldmatrix`, with no shared-memory byte loads (the
    split-KV decode kernel, which does not take it: 64 `ld.shared.b8` a thread per key block)."""
    f8, bf16, T = torch.float8_e4m3fn, torch.bfloat16, 4
    q, out = torch.zeros(T, 8, 256, dtype=bf16), torch.zeros(T, 8, 256, dtype=bf16)
    kv = torch.zeros(64, 4, 256, dtype=f8)
    sc = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)}
    ip = torch.zeros(T + 1, dtype=torch.int32)
    table, rows, seq = torch.zeros(8, 1024, dtype=torch.int32), torch.zeros(T, dtype=torch.int32), torch.ones(T, dtype=torch.int32)
    return [
        *[(f"unified[fp8 kv asm, decode {programs}]", unified_attention, "_unified_kernel",
           _as_on_sm90(lambda programs=programs: unified_attention.unified_attention(
               q, out, kv, kv, table, rows, seq, ip, 1.0, max_extend_len=1, programs=programs, **sc)))
          for programs in ("block", "chunk", "request")],
        ("unified[fp8 kv asm, extend]", unified_attention, "_unified_kernel",
         _as_on_sm90(lambda: unified_attention.unified_attention(q, out, kv, kv, table, rows, seq, ip, 1.0,
                                                                 max_extend_len=T, window=1024, **sc))),
    ]


def _fp8_gemm_cases() -> list[tuple]:
    """Block-FP8 GEMMs at a MiMo-V2 projection's K (4096): W8A8 at prefill rows (the activation
    quantiser, then fp8 MMAs) and weight-only at decode rows. No PDL form: checked for shared memory
    and for reading their tiles 16 bytes at a time."""
    w, s = torch.zeros(1024, 4096, dtype=torch.float8_e4m3fn), torch.zeros(8, 32)
    x_prefill, x_decode = torch.zeros(2048, 4096, dtype=torch.bfloat16), torch.zeros(64, 4096, dtype=torch.bfloat16)
    return [
        ("quant_fp8_groups", fp8_gemm, "_quant_groups_kernel", lambda: fp8_gemm.quant_fp8_groups(x_prefill)),
        ("fp8_gemm[w8a8, 2048 rows]", fp8_gemm, "_fp8_gemm_kernel",
         lambda: fp8_gemm.fp8_gemm(x_prefill, w, s, act_fp8=True)),
        ("fp8_gemm[w8a16, 64 rows]", fp8_gemm, "_fp8_gemm_kernel",
         lambda: fp8_gemm.fp8_gemm(x_decode, w, s, act_fp8=False)),
    ]


def main() -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    T, dim, inter = 4, 1152, 6912
    x, res = torch.zeros(T, dim, dtype=bf16), torch.zeros(T, dim, dtype=bf16)
    w = torch.zeros(dim, dtype=bf16)
    parts = torch.zeros(8, T, dim, dtype=f32)
    qkv = torch.zeros(T, 6 * 256, dtype=bf16)
    cos = torch.zeros(T, 128, dtype=f32)
    kv_buf = torch.zeros(16, 1, 256, dtype=bf16)
    locs = torch.zeros(T, dtype=torch.int64)
    q, out = torch.zeros(T, 4, 256, dtype=bf16), torch.zeros(T, 4, 256, dtype=bf16)
    indptr, indices = torch.zeros(T + 1, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    cases = [
        ("rms_norm", norm, "_rms_norm_kernel", lambda: norm.rms_norm(x, w, 1e-6, unit_offset=True, residual=res)),
        ("add_rms_norm", norm, "_add_rms_norm_kernel", lambda: norm.add_rms_norm(x, res, w, w, 1e-6, unit_offset=True)),
        ("add_rms_norm[8 parts]", norm, "_add_rms_norm_kernel",
         lambda: norm.add_rms_norm(parts, res, w, w, 1e-6, unit_offset=True)),
        ("act_and_mul", activation, "_act_and_mul_kernel",
         lambda: activation.act_and_mul(torch.zeros(T, 2 * inter, dtype=bf16), "gelu_tanh")),
        ("qk_norm_rope_store", qk_norm_rope, "_qk_norm_rope_store_kernel",
         lambda: qk_norm_rope.qk_norm_rope_store(qkv, 4, 1, 256, cos, cos, torch.zeros(256, dtype=bf16),
                                                 torch.zeros(256, dtype=bf16), 1e-6, kv_buf, kv_buf, locs,
                                                 unit_offset=True)),
        # Gemma 4's forms: a d512 full layer with K = V (q|k only), a d256 sliding layer with a V norm,
        # a KV-shared layer (q only); fp32 norm weights.
        ("qk_norm_rope_store[d512 k_eq_v]", qk_norm_rope, "_qk_norm_rope_store_kernel",
         lambda: qk_norm_rope.qk_norm_rope_store(torch.zeros(T, 18 * 512, dtype=bf16), 16, 2, 512,
                                                 torch.zeros(T, 256), torch.zeros(T, 256), torch.zeros(512),
                                                 torch.zeros(512), 1e-6, torch.zeros(16, 2, 512, dtype=bf16),
                                                 torch.zeros(16, 2, 512, dtype=bf16), locs, unit_offset=False,
                                                 weight_fp32=True, v_norm=True, v_from_k=True)),
        ("qk_norm_rope_store[d256 v_norm]", qk_norm_rope, "_qk_norm_rope_store_kernel",
         lambda: qk_norm_rope.qk_norm_rope_store(torch.zeros(T, 32 * 256, dtype=bf16), 16, 8, 256, cos, cos,
                                                 torch.zeros(256), torch.zeros(256), 1e-6,
                                                 torch.zeros(16, 8, 256, dtype=bf16),
                                                 torch.zeros(16, 8, 256, dtype=bf16), locs, unit_offset=False,
                                                 weight_fp32=True, v_norm=True)),
        ("qk_norm_rope_store[q only]", qk_norm_rope, "_qk_norm_rope_store_kernel",
         lambda: qk_norm_rope.qk_norm_rope_store(torch.zeros(T, 8 * 256, dtype=bf16), 8, 1, 256, cos, cos,
                                                 torch.zeros(256), None, 1e-6, None, None, None,
                                                 unit_offset=False, weight_fp32=True)),
        ("decode_stage1[split]", decode_attention, "_decode_stage1",
         lambda: decode_attention.decode_attention(q, kv_buf, kv_buf, indptr, indices, out, 0.06, num_kv_splits=4)),
        ("decode_stage1[split, fused combine]", decode_attention, "_decode_stage1",
         lambda: decode_attention.decode_attention(q, kv_buf, kv_buf, indptr, indices, out, 0.06, num_kv_splits=4,
                                                   split_counters=torch.zeros(64, dtype=torch.int32))),
        ("decode_stage1[direct]", decode_attention, "_decode_stage1",
         lambda: decode_attention.decode_attention(q, kv_buf, kv_buf, indptr, indices, out, 0.06, num_kv_splits=1)),
        ("decode_stage2", decode_attention, "_decode_stage2",
         lambda: decode_attention.decode_attention(q, kv_buf, kv_buf, indptr, indices, out, 0.06, num_kv_splits=4)),
    ]
    cases += _attention_cases() + _fp8_kv_cases() + _fp8_asm_cases() + _fp8_gemm_cases() + _mxfp4_moe_cases()
    cases += [  # the MoE routers' selection: Gemma-4-26B-A4B's (bf16 logits, per-expert scale), GPT-OSS-20B's
        ("route_topk[bf16, E=128, k=8, scaled]", router_topk, "_route_topk_kernel",
         lambda: router_topk.route_topk(torch.zeros(T, 128, dtype=bf16), 8, torch.zeros(128, dtype=bf16))),
        ("route_topk[fp32, E=32, k=4]", router_topk, "_route_topk_kernel",
         lambda: router_topk.route_topk(torch.zeros(T, 32, dtype=f32), 4)),
        *[(f"route_grouped[E={E}, k=8, {G} groups]", router_topk, "_route_grouped_kernel",  # MiMo-V2-Flash's; DeepSeek's
           lambda E=E, G=G: router_topk.route_grouped(torch.zeros(T, E), torch.zeros(E), 8, G, max(1, G // 2), True, 2.5))
          for E, G in ((256, 1), (256, 8))],
    ]
    g4 = torch.zeros(T, 2816, dtype=bf16)
    nw = torch.zeros(2816, dtype=f32)
    cases += [  # a Gemma-4-26B-A4B layer's end: an MoE layer's, and a dense one's from split-K partial sums
        ("ffn_tail[moe]", ffn_tail, "_ffn_tail_kernel",
         lambda: ffn_tail.ffn_tail(g4, g4, g4, nw, nw, nw, torch.zeros(1, dtype=bf16), nw, 1e-6, weight_fp32=True)),
        ("ffn_tail[dense, 4 parts]", ffn_tail, "_ffn_tail_kernel",
         lambda: ffn_tail.ffn_tail(torch.zeros(4, T, 2816), None, g4, None, None, nw, torch.zeros(1, dtype=bf16), nw,
                                   1e-6, weight_fp32=True)),
        ("moe_inputs", moe_inputs, "_moe_inputs_kernel",
         lambda: moe_inputs.moe_inputs(g4, torch.zeros(2816, dtype=bf16), 2816**-0.5, nw, 1e-6, weight_fp32=True)),
    ]
    for dtype in (bf16, f32):
        tag = "bf16" if dtype == bf16 else "fp32"
        xs = torch.zeros(T, inter, dtype=dtype)
        cases += [
            (f"skinny_gemm[{tag}]", skinny_gemm, "_skinny_gemm_kernel",
             lambda xs=xs, dtype=dtype: skinny_gemm.skinny_gemm(xs, torch.zeros(dim, inter, dtype=dtype), 8)),
            (f"skinny_gated_gemm[{tag}, K=1152]", skinny_gemm, "_skinny_gated_kernel",
             lambda dtype=dtype: skinny_gemm.skinny_gated_gemm(torch.zeros(T, dim, dtype=dtype),
                                                               torch.zeros(2 * inter, dim, dtype=dtype), "gelu_tanh")),
            (f"skinny_gated_gemm[{tag}, K=2560]", skinny_gemm, "_skinny_gated_kernel",
             lambda dtype=dtype: skinny_gemm.skinny_gated_gemm(torch.zeros(T, 2560, dtype=dtype),
                                                               torch.zeros(2 * 10240, 2560, dtype=dtype), "gelu_tanh")),
        ]
    cases += [  # the one-row GEMV: Gemma-4-26B-A4B's MLP gate_up (K not a whole number of 512-wide tiles), GPT-OSS-20B's
        # biased o_proj, Gemma 3 4B's down_proj (1024-wide tiles)
        ("gemv[bf16, 4224 x 2816]", gemv, "_gemv_kernel",
         lambda: gemv.gemv(torch.zeros(1, 2816, dtype=bf16), torch.zeros(4224, 2816, dtype=bf16))),
        ("gemv[bf16, bias, 2880 x 4096]", gemv, "_gemv_kernel",
         lambda: gemv.gemv(torch.zeros(1, 4096, dtype=bf16), torch.zeros(2880, 4096, dtype=bf16),
                           torch.zeros(2880, dtype=bf16))),
        ("gemv[bf16, 2560 x 10240]", gemv, "_gemv_kernel",
         lambda: gemv.gemv(torch.zeros(1, 10240, dtype=bf16), torch.zeros(2560, 10240, dtype=bf16))),
    ]
    failed = False
    for name, module, attr, call in cases:
        try:
            print(json.dumps(_check(name, module, attr, call)), flush=True)
        except Exception as e:  # noqa: BLE001 -- report every kernel, then fail
            failed = True
            print(json.dumps({"kernel": name, "error": f"{type(e).__name__}: {e}"[:400]}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
