"""`moe_dequant.MX_LUT_PTX` (MX_LUT's conversion of four MXFP4 code bytes to eight scaled bf16 weights)
run by a small interpreter of the PTX it uses (mov, and, shr, shl, prmt, lop3, fma.rn.bf16x2), on its own
text: every code byte in every position and scales across the range give `mxfp4.dequantize`'s values, in
the order `_mx_lut_dot` loads the activations (w_A: inputs 0-3 of the four bytes, w_B: inputs 4-7). The
GPU runs the same text (`tests/gpu`, the dequantisation test with MX_LUT natively); the interpreter there
takes the plain-Triton path instead."""

from __future__ import annotations

import re
import struct

import pytest
import torch

from swaserve.kernels.moe_dequant import MX_LUT_PTX
from swaserve.layers import mxfp4

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    pool = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:  # sign-replicate mode: the selected byte's top bit, eight times
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    out = 0
    for half in range(2):
        x, y, z = (_bf16(v >> (16 * half)) for v in (a, b, c))
        r = torch.tensor(x * y + z, dtype=torch.float32).to(torch.bfloat16)  # exact here: no rounding to check
        out |= (r.view(torch.int16).item() & 0xFFFF) << (16 * half)
    return out


def run_asm(q: int, s: int) -> list[int]:
    """The four output registers of `MX_LUT_PTX` for inputs $4 = q, $5 = s."""
    regs = {"$4": q, "$5": s}

    def val(x: str) -> int:
        return int(x, 0) if x[0].isdigit() else regs[x]

    for stmt in MX_LUT_PTX.replace("{", "").replace("}", "").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [x.strip() for x in rest.split(",")]
        d, srcs = args[0], [val(x) for x in args[1:]]
        if op == "mov.b32":
            r = srcs[0]
        elif op == "and.b32":
            r = srcs[0] & srcs[1]
        elif op == "shr.u32":
            r = srcs[0] >> srcs[1]
        elif op == "shl.b32":
            r = srcs[0] << srcs[1]
        elif op == "prmt.b32":
            r = _prmt(*srcs)
        elif op == "lop3.b32":
            r = _lop3(*srcs)
        elif op == "fma.rn.bf16x2":
            r = _fma_bf16x2(*srcs)
        else:
            raise AssertionError(f"no interpreter for {op}")
        regs[d] = r & M32
    return [regs[f"${i}"] for i in range(4)]


def test_the_interpreter_knows_every_instruction():
    ops = {m.group(1) for m in re.finditer(r"(?:^|;)\s*([a-z][\w.]*)\s", MX_LUT_PTX.replace("{", ";"))}
    assert ops - {".reg"} <= {"mov.b32", "and.b32", "shr.u32", "shl.b32", "prmt.b32", "lop3.b32", "fma.rn.bf16x2"}


@pytest.mark.parametrize("scale", [2, 100, 119, 127, 140, 240])
def test_every_code_byte_in_every_position(scale, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(96):
        q_bytes = torch.randint(0, 256, (4,), generator=g, dtype=torch.int64)
        q_bytes[int(torch.randint(0, 4, (1,), generator=g))] = int(torch.randint(0, 256, (1,), generator=g))
        q = sum(int(b) << (8 * i) for i, b in enumerate(q_bytes))
        s = scale | (scale << 8) | (scale << 16) | (scale << 24)  # the pack's four bytes: one group's scale
        out = run_asm(q, s)
        got = [_bf16(out[r] >> (16 * h)) for r in range(4) for h in range(2)]  # inputs 0-3 (w_A), 4-7 (w_B)
        blocks = torch.nn.functional.pad(q_bytes.to(torch.uint8), (0, 12)).view(1, 1, 16)
        want = mxfp4.dequantize(blocks, torch.tensor([[scale]], dtype=torch.uint8), torch.bfloat16)[0, :8]
        assert got == want.float().tolist(), (hex(q), scale, got, want.tolist())
    # all 256 byte values, each in each of the four positions
    for pos in range(4):
        for b in range(256):
            q = b << (8 * pos)
            out = run_asm(q, 127 * 0x01010101)
            got = [_bf16(out[r] >> (16 * h)) for r in range(4) for h in range(2)]
            assert got[2 * pos: 2 * pos + 2] == [mxfp4.FP4_VALUES[b & 15], mxfp4.FP4_VALUES[b >> 4]], (b, pos)
