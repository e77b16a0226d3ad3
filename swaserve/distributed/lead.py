"""TensorParallel: rank 0's side of a tensor-parallel engine: checks that the model splits, starts the
other ranks, and each step sends them the inputs (with the table writes that preceded it) and the
sampled tokens. The scheduler and sampler run on rank 0 only."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from swaserve.config import ParallelConfig, split_engine_options
from swaserve.distributed.channel import StepChannel, StepMessage
from swaserve.distributed.launch import RankProcesses, rank_device, start_ranks
from swaserve.distributed.state import (
    TPGroup,
    broadcast_from_first,
    gather_digests,
    release_graphs,
    set_tp_group,
    tp_group,
)
from swaserve.distributed.worker import run_rank
from swaserve.memory.table_ops import table_digest

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardInputs
    from swaserve.runtime import Runtime


def check_model_splits(model: str | None, size: int, expert_parallel: bool = False) -> None:
    """ValueError when `size` ranks cannot split the model (heads, widths, experts, FP8 blocks), or when
    expert parallelism is asked of a model without routed experts: built on the meta device as ranks 0
    and 1 of `size` (rank 1's cuts are the first that can fall inside an FP8 block), before any process
    starts."""
    from swaserve.distributed.state import ExpertSplit
    from swaserve.loader import load_hf_config
    from swaserve.model_config import ModelConfig
    from swaserve.models.registry import get_model_class

    hf = load_hf_config(model)
    cls = get_model_class(ModelConfig.from_hf(hf).architecture, getattr(hf, "model_type", None))
    before = tp_group()
    try:
        for rank in range(min(size, 2)):
            set_tp_group(TPGroup(rank, size, expert_parallel=expert_parallel))
            with torch.device("meta"):
                built = cls(hf)
    finally:
        set_tp_group(before)
    if expert_parallel and not any(isinstance(getattr(m, "expert_split", None), ExpertSplit)
                                   for m in built.modules()):
        raise ValueError(f"enable_expert_parallel: {cls.__name__} has no routed experts to split over the ranks; "
                         "drop the flag (tensor parallelism splits its MLPs)")


class StepLead:
    """What the step launcher of rank 0 calls: `send` before each forward, `share` after sampling."""

    def __init__(self, channel: StepChannel, table_log: list[list]):
        self.channel = channel
        self.table_log = table_log

    def send(self, inputs: ForwardInputs, sample: list[int], select: list[int] | None = None,
             heads: list[list[int]] | None = None, greedy: bool = False) -> None:
        """`select` / `heads`: a verify step's; `greedy`: the sampled rows take the LM head's greedy
        path (`channel.StepMessage`)."""
        ops = self.table_log[:]
        self.table_log.clear()
        self.channel.send(StepMessage(ops, inputs.encodable(), sample, select or [], heads or [], greedy=greedy))

    @staticmethod
    def share(tokens: torch.Tensor) -> None:
        """Rank 0's sampled tokens `[n]` int64 to every rank (in place on the others)."""
        broadcast_from_first(tokens)


DESTROY_TIMEOUT_S = 60.0


def destroy_group(timeout: float) -> None:
    """`destroy_process_group()`, given up after `timeout` seconds (logged): a rank stuck elsewhere must
    not hang the engine's close."""
    done = threading.Event()

    def run() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=run, name="swaserve-tp-destroy", daemon=True).start()
    if not done.wait(timeout):
        logger.error("tensor-parallel group teardown did not finish in %.0f s; the ranks are killed", timeout)


def _shut_down(channel: StepChannel, procs: RankProcesses, device: torch.device) -> None:
    """Stop the other ranks (each destroys its groups and exits, freeing its device), kill those that do
    not stop in time, and destroy this process's groups, so another engine can start here."""
    from swaserve.runner.memory_budget import release_device_memory

    procs.closing = True
    try:
        channel.send(StepMessage(stop=True))
        sent = True
    except RuntimeError:
        sent = False  # a rank is gone already
    release_device_memory(device)  # no collective of ours still queued when the group goes
    release_graphs()  # NCCL keeps a communicator that a live graph captured: they go first
    if tp_group().one_shot is not None:
        tp_group().one_shot.close()
    if dist.is_initialized():
        # Every rank destroys its groups on the stop message, and NCCL's communicator teardown is
        # collective: rank 0 takes part now, not after joining the ranks (they would wait in it for rank
        # 0, be killed, and leave rank 0 waiting forever; seen on 2x H200). With a rank gone it cannot
        # complete under NCCL: bounded.
        destroy_group(DESTROY_TIMEOUT_S if sent else 5.0)
    procs.join()
    set_tp_group(TPGroup())


def check_no_open_group() -> None:
    """ValueError when this process is in a torch.distributed group already: torch has one default
    group per process, so one tensor-parallel engine at a time. Engines only unreachable (dropped,
    not yet collected) are collected first, which stops them."""
    if dist.is_initialized():
        gc.collect()
    if dist.is_initialized():
        raise ValueError("another tensor-parallel engine is open in this process (torch.distributed keeps "
                         "one group per process): close() it, or leave its `with` block, before starting one")


class TensorParallel:
    """Rank 0's handle on the group. `close()`, or garbage collection of this object (the engine
    dropped), or the interpreter's exit stops the other ranks and destroys the groups, once."""

    def __init__(self, group: TPGroup, procs: RankProcesses, device: torch.device):
        self.group, self.procs, self.device = group, procs, device
        self.channel = StepChannel(group.cpu_group)
        # Holds no reference to this object, so dropping the engine collects it and runs the shutdown.
        self._finalizer = weakref.finalize(self, _shut_down, self.channel, procs, device)

    @classmethod
    def start(cls, par: ParallelConfig, model: str | None, device: torch.device, dtype: torch.dtype,
              engine_options: dict[str, Any]) -> TensorParallel:
        if par.node_rank != 0:
            raise ValueError("the engine is rank 0 and runs on node 0; other nodes run ranks only "
                             "(`swaserve serve --node-rank N` starts them)")
        runner_cfg = split_engine_options(engine_options)[2]
        if runner_cfg.enable_cpu_graph:
            raise ValueError("enable_cpu_graph does not support tensor parallelism yet (the decode graph "
                             "would have to trace the collectives); run the CPU ranks eagerly")
        check_model_splits(model, par.tensor_parallel_size, par.enable_expert_parallel)
        check_no_open_group()
        group, procs = start_ranks(par, model, device, dtype, engine_options, run_rank)
        return cls(group, procs, rank_device(device, 0, par))

    def lead(self, rt: Runtime) -> StepLead:
        """Record rank 0's device-table writes from now on, for the other ranks."""
        log: list[list] = []
        rt.req_to_token.log = log
        if hasattr(rt.allocator, "log"):
            rt.allocator.log = log
        return StepLead(self.channel, log)

    def check_tables(self, rt: Runtime) -> None:
        """AssertionError unless every rank's request table and SWA mapping equal rank 0's (after the
        writes not yet sent, which go out with this check)."""
        log = rt.req_to_token.log
        ops = log[:] if log is not None else []
        if log is not None:
            log.clear()
        self.channel.send(StepMessage(ops, check=True))
        if hasattr(rt.allocator, "sync_device"):  # the SWA mapping's writes not yet on the device
            rt.allocator.sync_device()
        mine = table_digest(rt.req_to_token.req_to_token, getattr(rt.allocator, "full_to_swa_device", None))
        every = gather_digests(mine)
        bad = [r for r in range(every.shape[0]) if not torch.equal(every[r], mine)]
        assert not bad, f"tensor-parallel rank(s) {bad} hold request tables that differ from rank 0's"

    def close(self) -> None:
        """Idempotent."""
        self._finalizer()
