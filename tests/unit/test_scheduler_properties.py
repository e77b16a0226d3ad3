"""Scheduler property tests with a fake model: random arrivals, lengths, aborts and tiny pools that
force chunked prefill, SWA eviction and retraction. Integrity is checked after every step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.config import SchedulerConfig
from swaserve.memory import ReqToTokenPool, SWAEvictor, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from swaserve.runner.forward_batch import ForwardMode
from swaserve.scheduler.req import Req
from swaserve.scheduler.scheduler import Scheduler

VOCAB = 50


@dataclass
class Params:  # the fields of SamplingParams the scheduler reads
    max_tokens: int
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = None


def fake_next_token(ids: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole history."""
    return (sum(i * (k + 1) for k, i in enumerate(ids)) * 31 + len(ids)) % VOCAB


def make_scheduler(full: int, swa: int | None, window: int, chunk: int, max_running: int, ctx: int = 64):
    table = ReqToTokenPool(max_running + 2, ctx)
    if swa is None:
        alloc, ev = TokenToKVPoolAllocator(full), None
    else:
        alloc = SWATokenToKVPoolAllocator(full, swa)
        ev = SWAEvictor(alloc, table, window, margin=1, chunk=2)
    cfg = SchedulerConfig(max_running_requests=max_running, max_prefill_tokens=chunk)
    return Scheduler(cfg, ctx, table, alloc, ev)


def run_step(s: Scheduler, seen_positions: dict[str, set[int]]) -> None:
    batch = s.schedule()
    if batch is None:
        return
    for r, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        assert p == r.kv_len and p + n <= len(r.ids)
        if batch.mode is ForwardMode.DECODE:
            assert n == 1 and r.pending == 1
        seen_positions.setdefault(r.rid, set()).update(range(p, p + n))
    assert batch.num_tokens <= max(s.config.max_prefill_tokens, len(batch.reqs))
    tokens = [fake_next_token(batch.reqs[i].ids) for i in batch.sample_indices()]
    s.process_output(batch, tokens)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 20)),
        st.tuples(st.just("abort"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, hybrid=st.booleans(), swa=st.integers(16, 40), chunk=st.integers(3, 16), max_running=st.integers(1, 5))
def test_random_workloads_keep_integrity_and_free_everything(ops, hybrid, swa, chunk, max_running):
    window = 4
    s = make_scheduler(full=60, swa=swa if hybrid else None, window=window, chunk=chunk, max_running=max_running)
    reqs: list[Req] = []
    seen: dict[str, set[int]] = {}
    for op, a, b in ops:
        if op == "add":
            r = Req(f"r{len(reqs)}", f"r{len(reqs)}", 0, a, [(a * 7 + k) % VOCAB for k in range(a)], Params(b), 0, frozenset())
            try:
                s.add(r)
                reqs.append(r)
            except ValueError:
                assert a + b > 60
        elif op == "abort" and reqs:
            s.abort(reqs[a % len(reqs)].group_id)
        else:
            for _ in range(a):
                run_step(s, seen)
                s.check_integrity()
    for _ in range(2000):
        if not s.has_unfinished():
            break
        run_step(s, seen)
        s.check_integrity()
    assert not s.has_unfinished(), "no progress: a request starved"
    s.check_integrity()
    alloc = s.allocator
    full = getattr(alloc, "full", alloc)
    assert full.available() == 60, "every full slot freed"
    if hybrid:
        assert alloc.swa.available() == swa, "every SWA slot freed"
    for r in reqs:
        if r.finish_reason == "abort":
            continue
        assert r.finish_reason == "length" and r.num_output == r.params.max_tokens
        for k in range(r.prompt_len, len(r.ids)):  # retraction and chunking never change the result
            assert r.ids[k] == fake_next_token(r.ids[:k])


def test_chunked_prefill_and_retraction_happen():
    s = make_scheduler(full=40, swa=24, window=4, chunk=5, max_running=4)
    reqs = [Req(f"r{i}", f"r{i}", 0, 12, list(range(1 + i, 13 + i)), Params(18), 0, frozenset()) for i in range(3)]
    for r in reqs:
        s.add(r)
    modes = []
    seen: dict[str, set[int]] = {}
    while s.has_unfinished():
        b = s.schedule()
        modes.append((b.mode, b.num_tokens))
        s.process_output(b, [fake_next_token(b.reqs[i].ids) for i in b.sample_indices()])
        s.check_integrity()
        for r in s.running:  # the SWA bound holds for every running request
            assert r.kv_len - r.swa_evicted <= s.evictor.max_held()
    assert max(n for m, n in modes if m is ForwardMode.EXTEND) <= 5
    assert s.retractions_total > 0, "3 x 30 tokens cannot fit in 40 slots at once"
    assert all(r.num_output == 18 for r in reqs)


def test_request_that_can_never_fit_is_rejected():
    s = make_scheduler(full=30, swa=16, window=4, chunk=8, max_running=2)
    with pytest.raises(ValueError, match="exceeds the maximum context"):
        s.add(Req("a", "a", 0, 60, [1] * 60, Params(10), 0, frozenset()))
    with pytest.raises(ValueError, match="KV pool"):
        s.add(Req("b", "b", 0, 20, [1] * 20, Params(20), 0, frozenset()))
    with pytest.raises(ValueError, match="empty"):
        s.add(Req("c", "c", 0, 0, [], Params(2), 0, frozenset()))
    assert not s.has_unfinished()


def test_abort_mid_prefill_and_running():
    s = make_scheduler(full=60, swa=30, window=4, chunk=4, max_running=4)
    a = Req("a", "a", 0, 10, list(range(10)), Params(5), 0, frozenset())
    b = Req("b", "b", 0, 3, [1, 2, 3], Params(50), 0, frozenset())
    s.add(b)
    s.add(a)
    seen: dict[str, set[int]] = {}
    run_step(s, seen)  # b prefilled, a's first chunk
    assert a.kv_len > 0 and a.row is not None
    s.abort("a")
    s.check_integrity()
    run_step(s, seen)
    s.abort("b")
    s.check_integrity()
    assert not s.has_unfinished() and s.allocator.full.available() == 60
