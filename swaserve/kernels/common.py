"""Pieces the attention and GEMM kernels share: interpreter detection, dot precision flags, head
dim padding, and the jit helpers for soft-capped scores, the online-softmax step and the final
normalisation (with optional per-head sinks)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


_SMS: dict[torch.device, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device); 8 elsewhere (the
    interpreter, where grid sizing only has to be plausible)."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return _SMS[device]


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def jit_per_batch(*names: str, aligned: tuple[str, ...] = ()):
    """`triton.jit` for a kernel whose integer arguments `names` change from batch to batch (row
    counts, offsets): no specialisation on their value (== 1) or divisibility by 16, so one compile
    serves every batch instead of a new one on the serving path.

    `aligned`: strides over the rows of contiguous tensors, fixed by a layer's width whatever the
    batch. They keep Triton's specialisation (divisibility by 16, or == 1), which never changes
    between batches, and it is what proves a row's start 16-byte aligned: Triton marks divisibility
    only on arguments it also specialises by value, so a stride in `names` is loaded element by
    element (a block-FP8 GEMM ran at 12% of cuBLAS's TFLOP/s that way on an H200). Listing them
    here only documents that choice; they must not be in `names`."""
    assert not set(names) & set(aligned), set(names) & set(aligned)
    return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)


def compiled_variants() -> dict[str, int]:
    """Compiled variants of each swaserve Triton kernel in this process so far, by kernel name: a
    count that grows while serving means a JIT compile on the request path."""
    import importlib
    import pkgutil

    import swaserve.kernels as pkg

    counts: dict[str, int] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, fn in vars(mod).items():
            if isinstance(fn, triton.runtime.jit.JITFunction) and fn.__module__ == mod.__name__:
                n = sum(len(entry[0]) for entry in getattr(fn, "device_caches", {}).values())
                if n:
                    counts[name] = n
    return counts


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, PRECISION) constexprs for `_dot`.

    fp32 runs as true fp32 ("ieee"), not tf32, so fp32 stays a usable accuracy reference on GPU.
    The CPU interpreter (triton 3.9) multiplies bf16/fp16 operands as their raw uint16 bits, so
    under TRITON_INTERPRET operands are upcast to fp32 first (values are identical after rounding).
    """
    return interpret_mode() and dtype != torch.float32, "ieee" if dtype == torch.float32 else "tf32"


def _block_d(d: int) -> int:
    """Head dims pad to a power of 2 (masked); at least 16, the smallest tl.dot operand dim."""
    return max(16, triton.next_power_of_2(d))


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _dot_rows(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr):
    """`_dot` whose every output row is computed the same way wherever it sits in the tile. Native
    tl.dot is (one row's products summed in a fixed order); the CPU interpreter's numpy matmul is
    not (OpenBLAS sums a row differently by its offset in the block), so under TRITON_INTERPRET
    (`ROWWISE`) the product is an explicit multiply and a sum over K."""
    if ROWWISE:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return _dot(a, b, UPCAST, PREC)


@triton.jit
def _dot_chain(a, b, acc, UPCAST: tl.constexpr, PREC: tl.constexpr, ROWWISE: tl.constexpr):
    """`acc + a @ b` as one chain of MMAs into `acc` (the accumulator is the MMA's addend, never a
    separate sum): each output is then reduced along K in the same order whatever the tile shape or
    BLOCK_K (what `bi_matmul` rests on, measured per GPU). `ROWWISE` (the interpreter): an explicit
    multiply and sum, whose order depends on BLOCK_K, so callers keep BLOCK_K fixed there."""
    if ROWWISE:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _scores(qk, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k -> logits in log2 units (so the softmax can use exp2)."""
    if HAS_SOFTCAP:
        x = qk * qk_scale / softcap
        # tanh via exp: saturates cleanly to +-1 for large |x| and needs no libdevice (interpreter).
        x = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
        return x * (softcap * 1.4426950408889634)
    return qk * (qk_scale * 1.4426950408889634)


@triton.jit
def _online_step(s, m, l):
    """One online-softmax step on masked log2 logits s [R, N] (-inf = masked); returns
    (p, alpha, m_new, l_new). Rows with every key masked so far keep m = -inf and p = 0, no NaN."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    return p, alpha, m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _finish(acc, m, l, sinks_ptr, heads, hmask, HAS_SINKS: tl.constexpr):
    """acc / (l + exp(sink)) with the sink as a value-less extra logit; 0 where nothing is seen."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m, sink)
        scale = tl.exp2(m - m_f)
        l = l * scale + tl.exp2(sink - m_f)
        acc = acc * scale[:, None]
    return tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
