"""A one-shot all-reduce over peer GPU memory (PyTorch symmetric memory), for the small messages of
decode steps: each rank copies its partial into a buffer every rank of the group has mapped, the ranks
meet at a device-side barrier, and every rank reads all partials and sums them. One kernel, no NCCL
launch, captured in CUDA graphs like any other kernel, and no NVLink multicast (which these machines
keep off): peer loads only.

The sum runs in rank order, `((p0 + p1) + p2) + p3`, on every rank and for every message size (torch's
`one_shot_all_reduce` indexes the peers' vectors by rank before adding), so it is the rank-order sum
deterministic mode asks for, bit for bit the one `state.all_reduce`'s gather path computes.

Messages above `ONE_SHOT_MAX_BYTES` (each rank reads every peer's whole message, so the cost grows
with size times ranks) go to NCCL, or to the gather path in deterministic mode.

Two-shot: from `TWO_SHOT_MIN_BYTES` on 4 or more ranks, outside deterministic mode, torch's two-shot
kernel runs instead (after a copy into the buffer): each rank sums its 1/N of the message over the ranks,
then every rank reads the others' sums, so a rank moves 2 (N - 1)/N of the message over NVLink instead of
N - 1 whole ones. Measured on 4 H200s, a decode step's one-shot all-reduce of 128 x 3840 bf16 took 18.5 us
(`tests/gpu/test_one_shot_gpu.py` times both). Deterministic mode keeps one-shot at every size: that the
two kernels round alike is not established, and a switch by size would then make a row's sum depend on
its batch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Largest message sent one-shot: a decode step of 256 rows at hidden 4096 in bf16 is 2 MiB. Not yet
# tuned against NCCL on these machines.
ONE_SHOT_MAX_BYTES = 2 << 20
TWO_SHOT_MIN_BYTES = 256 << 10  # and at least TWO_SHOT_MIN_RANKS ranks; not yet tuned (see the docstring)
TWO_SHOT_MIN_RANKS = 4
SIZES = (2, 4, 8)  # group sizes torch's kernel is specialised for


class OneShotAllReduce:
    """Owns a symmetric buffer of `max_bytes` in `dtype` on `device`, rendezvoused with `group` (every
    rank constructs one, in the same order: the rendezvous is collective)."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int = ONE_SHOT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.group_name = group.group_name
        self.ranks = group.size()
        self.capacity = max_bytes // torch.empty((), dtype=dtype).element_size()
        self.buffer = symm_mem.empty(self.capacity, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        ops = torch.ops.symm_mem
        self._copy_out = getattr(ops, "one_shot_all_reduce_copy_out", None)
        self._out = ops.one_shot_all_reduce_out
        self._two_shot = getattr(ops, "two_shot_all_reduce_out", None)

    def close(self) -> None:
        """Drop the buffer (its peers' mappings go with it) before the group is destroyed; every
        message goes to NCCL afterwards."""
        self.capacity = 0
        self.buffer = None

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` goes one-shot: this dtype, contiguous, within the buffer, a whole number of 4-byte
        words (the kernel's smallest vector), and starting 16-byte aligned in its storage like the
        buffer does (the kernel vectorises both alike and refuses a mismatch)."""
        n, size = x.numel(), x.element_size()
        return (x.dtype == self.dtype and x.is_contiguous() and 0 < n <= self.capacity
                and (n * size) % 4 == 0 and (x.storage_offset() * size) % 16 == 0)

    def two_shot(self, x: torch.Tensor) -> bool:
        """Whether `x` (that `fits`) goes two-shot outside deterministic mode (see the module docstring)."""
        return (self._two_shot is not None and self.ranks >= TWO_SHOT_MIN_RANKS
                and x.numel() * x.element_size() >= TWO_SHOT_MIN_BYTES)

    def __call__(self, x: torch.Tensor, ordered: bool = False) -> torch.Tensor:
        """Sum of `x` over the ranks, in place. `ordered` (deterministic mode): one-shot at every size."""
        return self.reduce(x, two_shot=not ordered and self.two_shot(x))

    def reduce(self, x: torch.Tensor, two_shot: bool = False) -> torch.Tensor:
        """Sum of `x` over the ranks, in place, by the kernel named. One-shot: each block of the kernel
        copies and later overwrites only its own elements of `x`, so input and output may alias."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel()]
        if two_shot:
            staged.copy_(flat)
            self._two_shot(staged, "sum", self.group_name, flat)
        elif self._copy_out is not None:
            self._copy_out(staged, flat, "sum", self.group_name, flat)
        else:  # older torch: stage the partial with a copy of our own
            staged.copy_(flat)
            self._out(staged, "sum", self.group_name, flat)
        return x


def build_one_shot(group: Any, size: int, device: torch.device, dtype: torch.dtype) -> OneShotAllReduce | None:
    """The one-shot all-reduce for this group, or None where it cannot run (not CUDA, a group size the
    kernel has no specialisation for, or symmetric memory unavailable: logged, and NCCL is used)."""
    if device.type != "cuda" or size not in SIZES or dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        return OneShotAllReduce(group, device, dtype)
    except (RuntimeError, ImportError, AttributeError) as e:  # no P2P between the GPUs, a torch without it
        logger.info("one-shot all-reduce unavailable (%s: %s); NCCL carries every all-reduce", type(e).__name__, e)
        return None
