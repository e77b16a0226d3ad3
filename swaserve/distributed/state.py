"""This process's place in the tensor-parallel group (rank, size, the torch.distributed groups), the
collectives the model layers call, and the arithmetic of who holds which heads, vocabulary rows and
routed experts.

Set once per process by `init_tensor_parallel` before the model is built; at size 1 every collective
is the identity and nothing here touches torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakSet

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """`group`: the device group (NCCL on GPUs, gloo on CPU) the layers' collectives run on;
    `cpu_group`: a gloo group for host messages (the step broadcast), the same group on CPU;
    `ordered` (deterministic mode): `all_reduce` sums the ranks' partials in rank order;
    `expert_parallel` (`--enable-expert-parallel`): MoE layers give each rank whole experts
    (`split_experts`) instead of a share of every expert's width;
    `one_shot`: the peer-memory all-reduce for small messages (`one_shot.OneShotAllReduce`), or None;
    `graphs`: the CUDA graphs made while this group is up (`new_cuda_graph`)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    cpu_group: Any = None
    ordered: bool = False
    expert_parallel: bool = False
    one_shot: Any = None
    graphs: WeakSet = field(default_factory=WeakSet, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.size > 1


_TP = TPGroup()
# torch 2.13 renamed all_gather_into_tensor (the old name warns); the GPU image's torch 2.11 has only it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_group() -> TPGroup:
    return _TP


def set_tp_group(group: TPGroup) -> None:
    global _TP
    _TP = group


def new_cuda_graph() -> torch.cuda.CUDAGraph:
    """A CUDA graph to capture into; in a group of several ranks it is tracked (`release_graphs`)."""
    graph = torch.cuda.CUDAGraph()
    if _TP.enabled:
        _TP.graphs.add(graph)
    return graph


def release_graphs() -> int:
    """Reset every live CUDA graph made while this group was up, before its communicator goes: NCCL
    (2.26 on) will not destroy a communicator while a graph that captured one of its collectives lives,
    and polls for them forever (both ranks of a closing TP=2 engine hung there on 4x H100). The engine
    is closing, so nothing replays them again. Returns how many were reset."""
    graphs = list(_TP.graphs)
    for g in graphs:
        g.reset()
    _TP.graphs.clear()
    return len(graphs)


@contextmanager
def single_rank() -> Iterator[None]:
    """Inside: this process acts as a group of one (layers built here hold whole tensors; collectives
    are the identity). What rank 0 builds and runs alone (a drafter) or the one-rank shapes of a model."""
    before = _TP
    set_tp_group(TPGroup())
    try:
        yield
    finally:
        set_tp_group(before)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (a row-parallel projection's partial outputs). `ordered`
    groups gather every partial and add them on each rank as `((p0 + p1) + p2) + ...`, whatever the
    message size or batch: the library's all-reduce picks its algorithm (and so its summation order)
    by message size, so a row's sum could depend on the rows beside it. A gather only copies bits."""
    tp = _TP
    if not tp.enabled:
        return x
    if tp.one_shot is not None and tp.one_shot.fits(x):
        return tp.one_shot(x, ordered=tp.ordered)  # rank order too: ordered or not
    if not tp.ordered:
        dist.all_reduce(x, group=tp.group)
        return x
    parts = x.new_empty(tp.size, *x.shape)  # [size, *x.shape]: rank r's partial at r
    _all_gather(parts.view(tp.size * x.shape[0], *x.shape[1:]), x.contiguous(), group=tp.group)
    torch.add(parts[0], parts[1], out=x)
    for r in range(2, tp.size):
        x.add_(parts[r])
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """`[n, d]` on every rank -> `[n, size * d]`: rank r's columns at `r*d : (r+1)*d` (vocab-parallel logits)."""
    tp = _TP
    if not tp.enabled:
        return x
    n, d = x.shape
    out = x.new_empty(tp.size * n, d)  # rank r's rows at r*n : (r+1)*n
    _all_gather(out, x.contiguous(), group=tp.group)
    return out.view(tp.size, n, d).transpose(0, 1).reshape(n, tp.size * d)


def vocab_parallel_argmax(best: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the whole vocabulary from every rank's best logit `best` `[n]` float32 and
    its global token id `index` `[n]` int64 in the rank's block: the highest value, the lowest rank (so
    the lowest token id) on ties, as `torch.argmax` of the gathered logits. One all-gather of 8 bytes a
    row instead of the rows' logits."""
    tp = _TP
    if not tp.enabled:
        return index
    pair = torch.stack([best.view(torch.int32), index.to(torch.int32)], dim=1)  # [n, 2] int32, one message
    every = pair.new_empty(tp.size * pair.shape[0], 2)
    _all_gather(every, pair, group=tp.group)
    every = every.view(tp.size, -1, 2)
    winner = every[..., 0].view(torch.float32).argmax(dim=0)  # [n]: the first rank holding the max
    return every[..., 1].gather(0, winner[None]).squeeze(0).to(torch.int64)


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place (sampled tokens: every rank records the same ones)."""
    tp = _TP
    if tp.enabled:
        dist.broadcast(x, src=0, group=tp.group)
    return x


def gather_vocab_tables(model: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole `[vocab, hidden]` token embedding and untied LM head weight (None when tied) of a
    vocab-parallel `model`, gathered from every rank's block (collective: every rank calls it)."""
    vocab = model.model.embed_tokens.vocab_size

    def whole(w: torch.Tensor) -> torch.Tensor:
        out = w.new_empty(_TP.size * w.shape[0], *w.shape[1:])
        _all_gather(out, w.detach().contiguous(), group=_TP.group)
        return out[:vocab]

    head = model.lm_head.weight
    return whole(model.model.embed_tokens.weight), (whole(head) if head is not None else None)


def gather_digests(digest: torch.Tensor) -> torch.Tensor:
    """Every rank's `[k]` int64 CPU digest, `[size, k]` (host group)."""
    tp = _TP
    out = digest.new_empty(tp.size * digest.numel())
    _all_gather(out, digest.contiguous(), group=tp.cpu_group)
    return out.view(tp.size, -1)


@dataclass(frozen=True)
class HeadShard:
    """Which attention heads one rank computes. Query heads split evenly; K/V heads split evenly where
    there are at least as many as ranks, otherwise each rank holds a copy of the one K/V head its
    query heads read (Gemma-3-1B's single K/V head is replicated on every rank)."""

    num_heads: int  # local query heads
    num_kv_heads: int  # local K/V heads
    q_start: int  # first global query head
    kv_start: int  # first global K/V head


def shard_heads(num_heads: int, num_kv_heads: int, rank: int | None = None, size: int | None = None) -> HeadShard:
    rank = _TP.rank if rank is None else rank
    size = _TP.size if size is None else size
    check_heads(num_heads, num_kv_heads, size)
    q = num_heads // size
    if num_kv_heads >= size:
        kv = num_kv_heads // size
        return HeadShard(q, kv, rank * q, rank * kv)
    # Query heads of K/V head j are j*G .. (j+1)*G-1 (G = num_heads / num_kv_heads); this rank's fall in one.
    return HeadShard(q, 1, rank * q, rank * q // (num_heads // num_kv_heads))


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError unless `size` ranks can split these heads (see `HeadShard`)."""
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the number of attention heads ({num_heads})")
    if num_kv_heads >= size and num_kv_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the number of K/V heads ({num_kv_heads}) "
                         "or be a multiple of it")
    if num_kv_heads < size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must be a multiple of the number of K/V heads "
                         f"({num_kv_heads}) when it exceeds it")


def shard_size(total: int, what: str, size: int | None = None) -> int:
    """`total / size` (intermediate sizes, expert widths); ValueError when it does not divide."""
    size = _TP.size if size is None else size
    if total % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the {what} ({total})")
    return total // size


def vocab_shard(vocab_size: int, rank: int | None = None, size: int | None = None) -> tuple[int, int, int]:
    """`(start, rows, padded)`: this rank's vocabulary rows `start : start + rows`; every rank's block is
    `padded = ceil(vocab / size)` rows (the last one zero-padded), so gathered logits line up."""
    rank = _TP.rank if rank is None else rank
    size = _TP.size if size is None else size
    padded = -(-vocab_size // size)
    start = min(rank * padded, vocab_size)
    return start, min(padded, vocab_size - start), padded


@dataclass(frozen=True)
class ExpertSplit:
    """The routed experts one rank holds: global ids `start .. start + count - 1` of `total`. Without
    expert parallelism that is all of them (each cut to a share of its width); with it, rank r holds
    whole experts, `total // size` of them plus one for each of the first `total % size` ranks. The
    router stays whole on every rank; a (token, slot) pair routed to another rank's expert adds nothing
    here (`layers.fused_moe.moe_experts`' `expert_start`) and the MoE's all-reduce sums the ranks."""

    total: int
    start: int
    count: int

    @property
    def parallel(self) -> bool:
        return self.count < self.total

    def holds(self, expert: int) -> bool:
        return self.start <= expert < self.start + self.count

    def local(self, expert: int) -> int:
        """Global expert id -> this rank's index of it; ValueError when another rank holds it."""
        if not self.holds(expert):
            raise ValueError(f"expert {expert} is held by another rank (this one holds "
                             f"{self.start}..{self.start + self.count - 1})")
        return expert - self.start


def split_experts(num_experts: int, rank: int | None = None, size: int | None = None,
                  parallel: bool | None = None) -> ExpertSplit:
    """This rank's `ExpertSplit` of `num_experts` (all of them unless the group is expert-parallel);
    ValueError when there are fewer experts than ranks (a rank would hold none)."""
    rank = _TP.rank if rank is None else rank
    size = _TP.size if size is None else size
    parallel = _TP.expert_parallel if parallel is None else parallel
    if not parallel or size == 1:
        return ExpertSplit(num_experts, 0, num_experts)
    if num_experts < size:
        raise ValueError(f"expert parallelism over {size} ranks needs at least {size} experts per MoE layer; "
                         f"this model has {num_experts}")
    base, extra = divmod(num_experts, size)
    return ExpertSplit(num_experts, rank * base + min(rank, extra), base + (rank < extra))
