"""What one kernel costs inside a CUDA graph when it does (almost) nothing: the floor under every
small kernel of a decode step (norms, rotary, attention combine at small batches).

A chain of N launches is captured in one graph and replayed; each kernel reads one value its
predecessor wrote and writes one (a true dependency, as between the step's kernels), with 1
program or one per SM, launched plainly or with PDL (release first, then wait; sm_90+ and a Triton
with `launch_pdl`, whatever SWASERVE_PDL says; on the CPU plainly only). Prints microseconds per
kernel, graph-timed with CUDA events.

    python benchmarks/kernel_floor.py [--chain 256]
    python benchmarks/kernel_floor.py --smoke     # Triton's interpreter on the CPU (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, graph_us, hardware, parse_args  # noqa: E402

# isort: split
# after common: --smoke picks Triton's interpreter before triton is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _step_kernel(src, dst, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    v = tl.load(src + tl.program_id(0))
    tl.store(dst + tl.program_id(0), v + 1.0)


def per_kernel_us(chain: int, programs: int, pdl: bool, dev: torch.device) -> float:
    bufs = [torch.zeros(programs, device=dev) for _ in range(2)]
    kw = {"launch_pdl": True} if pdl else {}

    def launch(i: int) -> None:
        _step_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], USE_PDL=pdl, **kw)

    us = graph_us(launch, calls=chain)
    assert float(bufs[chain % 2][0]) > 0, "the chain ran"
    return us


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chain", type=int, default=256, help="kernels per graph")
    a = parse_args(ap, argv, smoke=dict(chain=4))
    from swaserve.kernels.common import num_sms

    dev = bench_device(a.smoke)
    launches = [False, True] if dev.type == "cuda" else [False]  # the interpreter knows no PDL
    print(f"# {hardware()}; a graph of {a.chain} dependent one-value kernels", flush=True)
    rows = []
    for programs in (1, num_sms(dev)):
        for pdl in launches:
            rows.append(dict(programs=programs, launch="PDL" if pdl else "plain",
                             us_per_kernel=round(per_kernel_us(a.chain, programs, pdl, dev), 2)))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'programs':>8} {'launch':>6} {'us/kernel':>10}")
    for r in rows:
        print(f"{r['programs']:>8} {r['launch']:>6} {r['us_per_kernel']:>10.2f}")


if __name__ == "__main__":
    main()
