"""A tensor-parallel rank other than 0: builds its shard and its own pools exactly as rank 0 does, then
follows rank 0's step messages: replay the table writes, run the forward (its collectives pair with
rank 0's), take part in the logits gather, and record the tokens rank 0 sampled."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from swaserve.distributed.channel import StepChannel
from swaserve.distributed.state import broadcast_from_first, gather_digests
from swaserve.memory.table_ops import apply_table_ops, table_digest

if TYPE_CHECKING:
    from swaserve.config import ParallelConfig
    from swaserve.distributed.launch import RankSpec
    from swaserve.runtime import Runtime

logger = logging.getLogger(__name__)


def _exit_with_parent(parent_pid: int) -> None:
    """No orphan rank keeps a device: exit once the process that started this one is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="swaserve-parent-watch", daemon=True).start()


def run_rank(spec: RankSpec) -> None:
    """Process entry point of rank `spec.rank`."""
    from swaserve.config import split_engine_options
    from swaserve.distributed.launch import group_options, init_rank
    from swaserve.distributed.state import gather_vocab_tables, release_graphs
    from swaserve.engine_setup import load_engine_model
    from swaserve.runtime import build_runtime, size_runtime, start_runner

    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp{spec.rank} %(name)s: %(message)s")
    if spec.parent_pid:
        _exit_with_parent(spec.parent_pid)
    device = torch.device(spec.device)
    group = init_rank(spec.rank, spec.world_size, spec.init_addr, device,
                      **group_options(spec.engine_options, spec.dtype), group_base=spec.group_base)
    cache_cfg, sched_cfg, runner_cfg, _, spec_cfg = split_engine_options(spec.engine_options)
    loaded, config = load_engine_model(spec.model, device, spec.dtype, sched_cfg, runner_cfg)
    if spec_cfg.speculative_method is None:
        rt = build_runtime(config, loaded.model, device, spec.dtype, cache_cfg, sched_cfg, runner_cfg)
    else:  # rank 0's steps and collectives of `speculative.setup`, without the drafter (rank 0's alone)
        _, sizing = size_runtime(config, device, spec.dtype, cache_cfg, sched_cfg)
        rt = build_runtime(config, loaded.model, device, spec.dtype, cache_cfg, sizing.sched, runner_cfg, start=False)
        if spec_cfg.reads_target_vocab:
            gather_vocab_tables(rt.runner.model)
        start_runner(rt, runner_cfg, verify=spec_cfg.verify_shape)
    try:
        follow_steps(rt, StepChannel(group.cpu_group))
    except RuntimeError:
        if spec.parent_pid and os.getppid() != spec.parent_pid:
            os._exit(0)  # rank 0 is gone: its peers' collectives fail; nothing to report
        raise
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        release_graphs()  # NCCL keeps a communicator that a live graph captured: they go first
    if group.one_shot is not None:
        group.one_shot.close()
    torch.distributed.destroy_process_group()
    # Skip the interpreter's teardown: gloo's threads can still be joinable when C++ statics are
    # destroyed, and std::terminate then aborts a rank that finished cleanly (seen as exit code -6).
    logging.shutdown()
    os._exit(0)


def follow_steps(rt: Runtime, channel: StepChannel) -> None:
    """The rank's loop, until rank 0 says stop."""
    runner = rt.runner
    table = rt.req_to_token.req_to_token
    full_to_swa = getattr(rt.allocator, "full_to_swa_device", None)
    while True:
        msg = channel.recv()
        if msg.stop:
            return
        apply_table_ops(msg.ops, table, full_to_swa)
        if msg.check:
            gather_digests(table_digest(table, full_to_swa))
        if msg.inputs is None:
            continue
        batch = msg.inputs.build(runner.device)
        select = torch.tensor(msg.select, dtype=torch.int64, device=runner.device) if msg.select else None
        hidden = runner.forward_hidden(batch, select)
        if not msg.sample:
            continue
        rows = batch.req_pool_indices
        if msg.heads:  # a speculative verify step: rank 0's LM-head calls, in its order
            for start, n in msg.heads:
                runner.logits(hidden[start : start + n])
            rows = rows[torch.tensor(msg.sample, device=runner.device)]
        else:
            if len(msg.sample) != batch.batch_size:
                sel = torch.tensor(msg.sample, device=runner.device)
                hidden, rows = hidden[sel], rows[sel]
            if msg.greedy:  # this rank's part of the head's collective: its best tokens, or its logits
                runner.greedy_tokens(hidden)
            else:
                runner.logits(hidden)
        tokens = torch.empty(len(msg.sample), dtype=torch.int64, device=runner.device)
        broadcast_from_first(tokens)
        runner.record_sampled(rows, tokens)


def serve_node(par: ParallelConfig, model: str | None, device: torch.device, dtype: torch.dtype,
               engine_options: dict) -> int:
    """A node other than 0 (`--node-rank N`): run this node's ranks until rank 0 stops them."""
    from swaserve.distributed.launch import RankProcesses, RankSpec, rank_device

    per_node = par.tensor_parallel_size // par.nnodes
    first = par.node_rank * per_node
    specs = [RankSpec(r, par.tensor_parallel_size, par.dist_init_addr or "", str(rank_device(device, r, par)), model,
                      dtype, engine_options, os.getpid()) for r in range(first, first + per_node)]
    procs = RankProcesses(specs, run_rank)
    procs.wait()
    return max((p.exitcode or 0) for p in procs.procs.values())
