"""How an engine turns speculation on: the drafter built (under tensor parallelism on rank 0 alone,
unsharded: `RankZeroDrafter`), plugged into the target's runtime, the verify graphs captured, and the
scheduler's `Speculation` made. Each rank other than 0 mirrors the target's side (`distributed.worker`)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from swaserve.distributed.state import gather_vocab_tables, single_rank

if TYPE_CHECKING:
    from swaserve.config import RunnerConfig, SchedulerConfig, SpeculativeConfig
    from swaserve.launcher import StepLauncher
    from swaserve.model_config import ModelConfig
    from swaserve.runtime import Runtime
    from swaserve.scheduler.speculate import Speculation


def check_speculation(spec: SpeculativeConfig, runner: RunnerConfig, tp_size: int) -> None:
    """ValueError for what speculation does not combine with (before any rank starts)."""
    if runner.overlap_schedule:
        raise ValueError("speculative decoding runs without overlap scheduling (not yet supported together)")
    if tp_size > 1 and spec.speculative_method == "mtp" and spec.speculative_draft_model is not None:
        raise ValueError("Gemma 4's assistant drafter reads the target's KV cache, which tensor parallelism "
                         "splits over the ranks: not supported with tensor_parallel_size > 1 yet")


class RankZeroDrafter:
    """A drafter that rank 0 of a tensor-parallel engine runs alone and whole (its model unsharded, no
    collective): every call runs as a group of one. Its drafts reach the other ranks as the verify
    step's input tokens, which rank 0 sends them anyway, so nothing else crosses. (Replicating the
    drafter on every rank would cost each rank its memory and time for drafts they already get.)"""

    def __init__(self, drafter: Any):
        self.inner = drafter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def alone(*args: Any, **kwargs: Any) -> Any:
            with single_rank():
                return attr(*args, **kwargs)

        return alone


def build_drafter_for(spec: SpeculativeConfig, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                      sched: SchedulerConfig, load_format: str, tensor_parallel: bool) -> Any:
    from swaserve.speculative import build_drafter

    if not tensor_parallel:
        return build_drafter(spec, config, device, dtype, sched, load_format)
    with single_rank():
        return RankZeroDrafter(build_drafter(spec, config, device, dtype, sched, load_format))


def start_speculation(rt: Runtime, launcher: StepLauncher, drafter: Any, spec: SpeculativeConfig,
                      runner_cfg: RunnerConfig, tensor_parallel: bool) -> Speculation:
    """Plug `drafter` into the target's runtime and launcher and capture the target's graphs (the
    runtime was built with `start=False`). Under tensor parallelism a drafter that reads the target's
    embedding or LM head gets whole copies, gathered from the ranks."""
    from swaserve.runtime import start_runner
    from swaserve.scheduler.speculate import Speculation
    from swaserve.speculative.verify_step import launch_verify

    launcher.verify = launch_verify
    if hasattr(drafter, "attach"):
        if tensor_parallel and spec.reads_target_vocab:
            with _whole_vocab(rt.runner.model):
                drafter.attach(rt)
        else:
            drafter.attach(rt)
    if hasattr(drafter, "observe"):
        launcher.set_observer(drafter)
    start_runner(rt, runner_cfg, verify=spec.verify_shape)
    if hasattr(drafter, "start"):  # after the target's graphs: e.g. the drafter's own graphs
        drafter.start(rt)
    return Speculation(drafter, spec.speculative_num_tokens, spec.speculative_max_batch_size)


@contextmanager
def _whole_vocab(model: Any) -> Iterator[None]:
    """The target's embedding and LM head replaced by whole (unsharded) copies while inside, for a
    drafter to take; the target keeps its vocab-parallel ones."""
    from torch import nn

    from swaserve.layers.embedding import LMHead, VocabEmbedding

    embed, head = model.model.embed_tokens, model.lm_head
    embed_rows, head_rows = gather_vocab_tables(model)
    with single_rank(), torch.device("meta"):
        whole_embed = VocabEmbedding(embed.vocab_size, embed_rows.shape[1], embed.scale)
        whole_head = LMHead(head.vocab_size, embed_rows.shape[1], head.tied, head.final_softcap)
    whole_embed.weight = nn.Parameter(embed_rows, requires_grad=False)
    if head_rows is not None:
        whole_head.weight = nn.Parameter(head_rows, requires_grad=False)
    whole_head.batch_invariant = head.batch_invariant
    model.model.embed_tokens, model.lm_head = whole_embed, whole_head
    try:
        yield
    finally:
        model.model.embed_tokens, model.lm_head = embed, head
