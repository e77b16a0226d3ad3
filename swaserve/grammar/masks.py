"""A step's allowed-token bitmasks on the host, for its constrained rows only: filled by xgrammar's batch
matcher (its own threads), either inline or on a worker thread beside the step loop (`start_fill`), into
reused host buffers (`MaskRows`), which also copy them to the device."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swaserve.grammar.matcher import LiveRows, PendingAccept, SequenceGrammar
from swaserve.h2d import to_device

# Rows per xgrammar thread at least. At 256 constrained rows of the 1B shape, stepped as the server's engine
# core steps (frontends detokenize), on a 16-core H200 host: 1 / 2 / 4 fill threads gave 47.0k / 48.3k / 53.9k
# output tok/s against 72.3k unconstrained (benchmarks/structured_outputs.py --fill-threads, 2026-11-29): the
# loop waits for the masks there, so a shorter fill is a shorter step. (With the text built in the step loop
# the loop itself was the limit and one thread did best: more of them slowed it.)
_ROWS_PER_THREAD = 64
_MAX_THREADS = 8


_CPUS: dict[int, int] = {}  # by process id (a forked child may run on other CPUs)


def _cpus() -> int:
    """The CPUs this process may run on, read once per process (a system call a step otherwise)."""
    pid = os.getpid()
    if pid not in _CPUS:
        try:
            _CPUS[pid] = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            _CPUS[pid] = os.cpu_count() or 1
    return _CPUS[pid]


def fill_threads(rows: int, most: int | None = None) -> int:
    """xgrammar threads for filling `rows` masks: one per 64 rows, at most `most` (the `grammar_threads`
    option), by default a quarter of the CPUs this process may run on (xgrammar's "auto" counts the whole
    machine's) and at most 8."""
    if most is None:
        most = min(_MAX_THREADS, _cpus() // 4)
    return max(1, min(most, -(-rows // _ROWS_PER_THREAD)))


# xgrammar BatchGrammarMatcher by thread count, per calling thread: one with threads keeps its pool in
# itself during a call, so two threads must not share one.
_BATCHES = threading.local()


def _batch(threads: int) -> Any:
    mine: dict[int, Any] = _BATCHES.__dict__.setdefault("by_threads", {})
    b = mine.get(threads)
    if b is None:
        import xgrammar as xgr

        b = mine[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
    return b


class MaskRows:
    """The host buffers a step's bitmask rows are filled into: two, used in turn from step to step (pinned
    where CUDA is available), instead of a fresh pinned `[rows, words]` tensor allocated and cleared every
    step (8 MB at 256 rows of a 262k vocabulary). `rows(n)` hands out the one not handed out last, once the
    copy that read it has completed: done in practice, since the step it served has committed since (with
    one buffer, a step that fills inline right after a deferred one samples would wait for that step's
    model to finish before its own copy could overwrite the buffer)."""

    def __init__(self, words: int):
        self.words = words
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.read: list[Any] = [None, None]  # torch.cuda.Event recorded after the last copy from each buffer
        self.turn = 1  # the buffer handed out last
        self.stream: Any = None  # torch.cuda.Stream of the copies to the device (`upload`; made on first use)

    def rows(self, n: int) -> torch.Tensor:
        self.turn ^= 1
        i = self.turn
        if self.read[i] is not None:
            self.read[i].synchronize()
            self.read[i] = None
        buf = self.bufs[i]
        if buf is None or buf.shape[0] < n:
            buf = self.bufs[i] = torch.empty(max(n, 64), self.words, dtype=torch.int32,
                                             pin_memory=torch.cuda.is_available())
        return buf[:n]

    def upload(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The rows handed out last (`rows(n)`, filled), on `device`. On a GPU they cross on a copy stream
        of their own and the current stream waits for that copy only: queued on the compute stream, the copy
        (8 MiB at 256 rows of a 262k vocabulary) would wait for the model still running there and hold the
        step's sampling back by its whole length."""
        buf = self.bufs[self.turn]
        if device.type != "cuda" or buf is None or not buf.is_pinned():
            return to_device(rows, device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.stream):
            out = rows.to(device, non_blocking=True)
            self.read[self.turn] = torch.cuda.Event()
            self.read[self.turn].record()  # on the copy stream: the buffer is free again once it has run
        compute.wait_stream(self.stream)
        out.record_stream(compute)  # allocated on the copy stream, read (and freed) on the compute stream
        return out


@dataclass
class TokenMasks:
    """Bitmasks of a batch's rows with a live grammar: `masks[j]` has bit t % 32 of word t // 32 set where
    token t may follow batch row `rows[j]`; the batch's other rows (`n` in all) are unconstrained."""

    masks: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, host (MaskRows' buffer when given one)
    rows: list[int]  # ascending positions in the batch
    n: int

    @property
    def every_row(self) -> bool:
        return len(self.rows) == self.n


class MaskJob:
    """One fill, on the worker thread or done inline, after the accept of the tokens it depends on when
    given one (`accept`, a `PendingAccept`). `result()` waits for it; `fill_seconds` is the time xgrammar
    took (on whichever thread ran it), the accept included; `rejected` the tokens that accept refused."""

    __slots__ = ("accept", "done", "error", "fill_seconds", "grammars", "handles", "masks", "threads")

    def __init__(self, grammars: list[SequenceGrammar], handles: list[Any], masks: TokenMasks,
                 threads: int | None = None, accept: PendingAccept | None = None):
        self.grammars = grammars  # the live rows' grammars, in mask row order
        self.handles = handles  # their xgrammar core objects (None where xgrammar has no `_handle`)
        self.threads = threads
        self.masks = masks
        self.accept = accept
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.fill_seconds = 0.0

    @property
    def rejected(self) -> int:
        return self.accept.rejected if self.accept is not None else 0

    def run(self) -> None:
        try:
            batch = _batch(fill_threads(len(self.grammars), self.threads))
            t0 = time.perf_counter()
            if self.accept is not None:
                self.accept.run()
            core = getattr(batch, "_handle", None)
            if core is not None and self.handles[0] is not None:  # no pass over the rows holding the GIL
                core.batch_fill_next_token_bitmask(self.handles, self.masks.masks, None, False)
            else:  # another xgrammar layout: the public call
                batch.batch_fill_next_token_bitmask([g.matcher for g in self.grammars], self.masks.masks)
            self.fill_seconds = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 (handed to whoever waits for the result)
            self.error = e
        finally:
            self.done.set()

    def result(self) -> TokenMasks:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.masks


class _Worker:
    """One daemon thread that runs fill jobs in order, for every engine in the process (an engine waits
    for its job before it starts the next)."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has the object but not the thread
        self.jobs: queue.SimpleQueue[MaskJob] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="swaserve-grammar-masks", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.jobs.get().run()


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


# Python's GIL switch interval once a job runs on the worker: the worker needs the GIL for a moment to start
# a job, between its two xgrammar calls and to finish it, and at the default 5 ms it would wait that long for
# the step loop, which runs Python all the while, to be made to let go of it.
_SWITCH_INTERVAL = 2e-4


def start_fill(grammars: Sequence[SequenceGrammar | None] | LiveRows, vocab_size: int, out: MaskRows | None = None,
               background: bool = False, threads: int | None = None,
               accept: PendingAccept | None = None) -> MaskJob | None:
    """Fill the masks of `grammars`' live rows (None, or a terminated grammar: a sequence that ended while
    its next step was already launched, samples unconstrained); None when no row has a live grammar.
    `background`: on the worker thread, returning at once: the worker takes the GIL within the switch
    interval (0.2 ms) and lets go of it inside xgrammar, which runs without it, so the step loop's Python
    goes on beside the fill. (Waiting for the worker to be inside xgrammar cost the loop 0.11-0.13 ms of
    wake-ups a step on an H200 host, `benchmarks/results/h200_structured_outputs_phases_*`.) `threads`: at
    most this many xgrammar threads (`fill_threads`). `accept`: the tokens the grammars took as accepted
    (`accept_later`), accepted first by the same job.
    `grammars` may be the live rows themselves (`LiveRows`) where the caller has them (`PendingAccept.live`,
    for a step over the rows that accepted), saving a pass over the batch. The grammars must not advance
    until `result()` returned. None when no row is live: `accept`, if any, is then the caller's to run."""
    if isinstance(grammars, LiveRows):
        going, rows, handles, n = grammars
    else:
        going, rows, handles, n = [], [], [], len(grammars)
        for i, g in enumerate(grammars):  # one pass over the batch
            if g is not None and not g.terminated:
                going.append(g)
                rows.append(i)
                handles.append(g.handle)
    if not going:
        return None
    words = (vocab_size + 31) // 32
    if out is None:
        out = MaskRows(words)
    assert out.words == words, (out.words, words)
    job = MaskJob(going, handles, TokenMasks(out.rows(len(going)), rows, n), threads, accept)
    if not background:
        job.run()
        return job
    if sys.getswitchinterval() > _SWITCH_INTERVAL:
        sys.setswitchinterval(_SWITCH_INTERVAL)
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER.pid != os.getpid():
            _WORKER = _Worker()
        _WORKER.jobs.put(job)
    return job


def fill_token_masks(grammars: Sequence[SequenceGrammar | None], vocab_size: int,
                     out: MaskRows | None = None) -> TokenMasks | None:
    """`start_fill` inline: the live rows' masks now."""
    job = start_fill(grammars, vocab_size, out)
    return job.result() if job is not None else None
