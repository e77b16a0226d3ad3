"""What one kernel costs inside a CUDA graph when it does (almost) nothing: the floor under every
small kernel of a decode step (norms, rotary, attention combine at small batches).

A chain of N launches is captured in one graph and replayed; each kernel reads one value its
predecessor wrote and writes one (a true dependency, as between the step's kernels), with 1
program or one per SM, launched plainly or with PDL (release first, then wait). Prints microseconds per
kernel, graph-timed with CUDA events.

    python benchmarks/kernel_floor.py [--chain 256]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from common import hardware


@triton.jit
def _step_kernel(src, dst, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    v = tl.load(src + tl.program_id(0))
    tl.store(dst + tl.program_id(0), v + 1.0)


def per_kernel_us(chain: int, programs: int, pdl: bool, reps: int = 20) -> float:
    bufs = [torch.zeros(programs, device="cuda") for _ in range(2)]
    kw = {"launch_pdl": True} if pdl else {}

    def run() -> None:
        for i in range(chain):
            _step_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], USE_PDL=pdl, **kw)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        run()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    assert float(bufs[chain % 2][0]) > 0, "the chain ran"
    return start.elapsed_time(end) * 1e3 / reps / chain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chain", type=int, default=256, help="kernels per graph")
    a = ap.parse_args()
    print(f"# {hardware()}; a graph of {a.chain} dependent one-value kernels", flush=True)
    print(f"{'programs':>8} {'launch':>6} {'us/kernel':>10}")
    for programs in (1, torch.cuda.get_device_properties(0).multi_processor_count):
        for pdl in (False, True):
            us = per_kernel_us(a.chain, programs, pdl)
            print(f"{programs:>8} {'PDL' if pdl else 'plain':>6} {us:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
