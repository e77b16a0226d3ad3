"""Starting tensor-parallel ranks: rank 0 is the engine's own process; this module spawns the other
ranks of this node (one process each, one device each), joins the torch.distributed group, and takes
the engine down with a clear error when a rank dies (a collective would otherwise wait forever)."""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from swaserve.config import ParallelConfig
from swaserve.distributed.one_shot import build_one_shot
from swaserve.distributed.state import TPGroup, set_tp_group

logger = logging.getLogger(__name__)
DEATH_GRACE_S = 2.0  # after a rank dies, the engine's own collective gets this long to fail first
JOIN_TIMEOUT_S = 30.0  # how long a closing engine waits for its ranks before it kills them
# Tensor-parallel engines this process started; each names its torch.distributed groups from its own
# base (`init_rank`), GROUP_NAMES_PER_ENGINE apart (an engine makes 2: the device group and the host one).
_ENGINES = itertools.count()
GROUP_NAMES_PER_ENGINE = 8


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank's process needs to build its shard (picklable: it crosses a spawn)."""

    rank: int
    world_size: int
    init_addr: str  # HOST:PORT of the rendezvous
    device: str  # "cpu" or "cuda:<local rank>"
    model: str | None
    dtype: Any
    engine_options: dict[str, Any] = field(default_factory=dict)
    parent_pid: int = 0  # the process that spawned this rank: when it is gone, the rank exits
    group_base: int = 0  # where the engine's group names start (`init_rank`): rank 0's, on every rank


def rank_device(device: torch.device, rank: int, par: ParallelConfig) -> torch.device:
    """Rank r's device: `cuda:<r's index on its node>` on GPUs; every rank on the CPU otherwise."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank % (par.tensor_parallel_size // par.nnodes))


def check_devices(device: torch.device, par: ParallelConfig) -> None:
    per_node = par.tensor_parallel_size // par.nnodes
    first = device.index or 0
    if device.type == "cuda" and first + per_node > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {par.tensor_parallel_size} over {par.nnodes} node(s) needs "
                         f"{per_node} GPUs per node from cuda:{first}; this node has {torch.cuda.device_count()}")


def free_local_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def init_rank(rank: int, world_size: int, init_addr: str, device: torch.device, ordered: bool = False,
              expert_parallel: bool = False, one_shot_dtype: torch.dtype | None = None,
              group_base: int = 0) -> TPGroup:
    """Join the group (NCCL on GPUs, gloo on CPU, plus a gloo group for host messages) and make it
    this process's tensor-parallel group (`ordered`: deterministic mode's rank-order all-reduce;
    `expert_parallel`: MoE layers built next hold whole experts; `one_shot_dtype`: set up the one-shot
    all-reduce for messages of that dtype, `one_shot.py`; `group_base`: see below)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torch names groups from a counter that it resets when they are destroyed, and symmetric memory
    # keeps a group's store under that name for the life of the process: a second engine in this
    # process would rendezvous its one-shot buffer on the first engine's dead store and wait forever
    # (seen on 4x H100). So each engine's names start at a base of its own, equal on every rank (the
    # names key the groups' rendezvous too).
    dist.distributed_c10d._world.group_count = group_base
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=30), **kw)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo")
    one_shot = build_one_shot(world, world_size, device, one_shot_dtype) if one_shot_dtype is not None else None
    group = TPGroup(rank, world_size, world, cpu_group, ordered=ordered, expert_parallel=expert_parallel,
                    one_shot=one_shot)
    set_tp_group(group)
    return group


def group_options(engine_options: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """`init_rank`'s keywords from the engine options and the model's dtype: `ordered` (deterministic
    mode: every all-reduce sums in rank order, `distributed.state.all_reduce`), `expert_parallel`, and
    `one_shot_dtype` (the model's dtype, None when --disable-custom-all-reduce turns it off)."""
    from swaserve.config import split_engine_options

    _, _, runner, par, _ = split_engine_options(engine_options)
    return {"ordered": bool(runner.enable_deterministic_inference),
            "expert_parallel": bool(par.enable_expert_parallel),
            "one_shot_dtype": None if par.disable_custom_all_reduce else dtype}


class RankProcesses:
    """The other ranks this process started, each running `run_rank(spec)` (`worker.run_rank`, passed in:
    the worker imports this module, not the other way round). A rank that exits while the engine runs is
    fatal: the error is logged and, unless the engine is closing by then, this process exits (code 1)
    after `DEATH_GRACE_S` (a NCCL collective waiting on a dead peer never returns)."""

    def __init__(self, specs: list[RankSpec], run_rank: Callable[[RankSpec], None]):
        ctx = mp.get_context("spawn")
        self.procs = {s.rank: ctx.Process(target=run_rank, args=(s,), name=f"swaserve-tp{s.rank}", daemon=True)
                      for s in specs}
        for p in self.procs.values():
            p.start()
        self.closing = False
        atexit.register(self._at_exit)  # runs before multiprocessing terminates its daemonic children
        if self.procs:  # (ranks on other nodes are not watched from here)
            threading.Thread(target=self._watch_ranks, name="swaserve-tp-watch", daemon=True).start()

    def _watch_ranks(self) -> None:
        by_sentinel = {p.sentinel: (r, p) for r, p in self.procs.items()}
        ready = multiprocessing.connection.wait(list(by_sentinel))
        if self.closing:
            return
        rank, proc = by_sentinel[ready[0]]  # type: ignore[index]
        proc.join(1)
        logger.error("tensor-parallel rank %d exited (code %s): the engine cannot go on without it; exiting",
                     rank, proc.exitcode)
        time.sleep(DEATH_GRACE_S)
        if not self.closing:
            os._exit(1)

    def _at_exit(self) -> None:
        self.closing = True

    def wait(self) -> None:
        """Until every rank has exited (a node other than 0: its ranks end when rank 0 stops them)."""
        self.closing = True
        for p in self.procs.values():
            p.join()
        atexit.unregister(self._at_exit)

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Wait up to `timeout` s in all for the ranks to exit (after rank 0 told them to stop); kill
        those still running (a rank stuck in a collective never returns)."""
        self.closing = True
        deadline = time.monotonic() + timeout
        for r, p in self.procs.items():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                logger.warning("tensor-parallel rank %d did not stop within %.0f s: killed", r, timeout)
                p.kill()
                p.join(5)
        atexit.unregister(self._at_exit)


def start_ranks(par: ParallelConfig, model: str | None, device: torch.device, dtype: Any,
                engine_options: dict[str, Any], run_rank: Callable[[RankSpec], None],
                ) -> tuple[TPGroup, RankProcesses]:
    """Spawn this node's other ranks, then join the group as rank `node_rank * ranks_per_node`
    (rank 0 on node 0). Returns the group and the spawned processes."""
    check_devices(device, par)
    per_node = par.tensor_parallel_size // par.nnodes
    addr = par.dist_init_addr or free_local_addr()
    first = par.node_rank * per_node
    # Ranks on other nodes (`serve_node`) cannot learn the base: an engine spanning nodes starts at 0 (a second
    # one in this process, on GPUs with the one-shot all-reduce, would meet the stale store above).
    base = next(_ENGINES) * GROUP_NAMES_PER_ENGINE if par.nnodes == 1 else 0
    specs = [RankSpec(r, par.tensor_parallel_size, addr, str(rank_device(device, r, par)), model, dtype,
                      engine_options, os.getpid(), base) for r in range(first + 1, first + per_node)]
    procs = RankProcesses(specs, run_rank)
    group = init_rank(first, par.tensor_parallel_size, addr, rank_device(device, first, par),
                      **group_options(engine_options, dtype), group_base=base)
    return group, procs
