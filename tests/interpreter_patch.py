"""Triton's CPU interpreter (TRITON_INTERPRET=1) without its re-patching of triton.language on every
call of a @triton.jit helper.

A launch patches triton.language for the interpreter once, for its whole run (`GridExecutor`); then
every call of a helper inside the kernel (`_dot_chain`, `_online_step`, `_inv_rms`, ...) patches the
same modules again (`InterpretedFunction.__call__`: an `inspect.getmembers` pass and hundreds of
setattr, per call and per program), which Triton 3.9 never undoes: 12-15% of the CPU time of an
interpreted test (test_triton_backend_matches_torch_native[stage2] 23.3 -> 20.0 s, the qk-norm and
fused-norm kernel tests 8.9 -> 7.8 s). Here a helper
called inside a launch skips the patching when the launch, or a helper called earlier in it, already
patched every language module the helper can see (Triton's own helpers, `tl.sort`'s stages, see
`triton.language.core`, which the kernels' launches do not patch), and runs exactly as before; any
other call goes through Triton's own path. The kernels compute the same values: only the redundant
setattr are gone.

Also an xor reduction (`tl.xor_sum`, which every compare-and-swap stage of `tl.sort` runs) becomes one
numpy `bitwise_xor.reduce` instead of the interpreter's generic reduce, a Python call per element. Xor
is exact, so the values are the same. Both together: `kernels.moe_align._align_kernel` (one `tl.sort` of
2048 int32 keys) 5.9 -> 0.13 s a call.

And a launch keyword that is neither the kernel's parameter nor a compile option raises, as a compiled
launch does (`KeyError: Keyword argument ... was specified but unrecognised`); the interpreter drops it
silently, so a constexpr passed to the wrong kernel passed every CPU test and failed every GPU one.
"""

from __future__ import annotations

import inspect

import numpy as np

_installed = False


def install() -> None:
    """Idempotent; a no-op without triton or where its interpreter's internals differ."""
    global _installed
    if _installed:
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    executor, helper = getattr(ti, "GridExecutor", None), getattr(ti, "InterpretedFunction", None)
    if executor is None or helper is None or not hasattr(helper, "rewrite") or not hasattr(ti, "InterpreterError"):
        return
    launch_call, helper_call = executor.__call__, helper.__call__
    running: list[set[int]] = []  # per launch in progress: the language modules patched so far
    seen: dict[int, set[int]] = {}

    def langs(fn) -> set[int]:  # the modules `_patch_lang(fn)` patches
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return seen[key]

    options = _launch_options()

    def launch(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(self.arg_names) - options)
        if unknown:
            raise KeyError(f"Keyword argument {unknown[0]} was specified but unrecognised "
                           f"(kernel {self.fn.__name__})")
        running.append(set(langs(self.fn)))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            running.pop()

    def call(self, *args, **kwargs):
        if not running or not langs(self.fn) <= running[-1]:
            if running:
                running[-1] |= langs(self.fn)  # Triton patches them now and never undoes it
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    executor.__call__, helper.__call__ = launch, call
    _fast_xor_reduce(ti, tl)
    _installed = True


def _launch_options() -> set[str]:
    """The keywords a compiled launch takes besides the kernel's parameters: the CUDA backend's options."""
    names = {"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid"}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return names
    return names | set(getattr(CUDAOptions, "__dataclass_fields__", {}))


def _fast_xor_reduce(ti, tl) -> None:
    reduce_ops = getattr(ti, "ReduceOps", None)
    xor_combine = getattr(tl.standard, "_xor_combine", None)
    if reduce_ops is None or xor_combine is None or not hasattr(reduce_ops, "apply_impl"):
        return
    apply_impl = reduce_ops.apply_impl

    def fast(self, input):
        if self.combine_fn is not xor_combine or self.axis is None or len(input) != 1:
            return apply_impl(self, input)
        x = input[0]
        return [self.to_tensor(np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims), x.dtype)]

    reduce_ops.apply_impl = fast
