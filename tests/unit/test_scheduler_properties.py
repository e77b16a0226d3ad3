"""Scheduler property tests with a fake model: random arrivals, lengths, aborts and tiny pools that
force chunked prefill, SWA eviction and retraction. Integrity is checked after every step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.config import SCHEDULE_POLICIES, SchedulerConfig
from swaserve.memory import ReqToTokenPool, SWAEvictor, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from swaserve.runner.forward_batch import ForwardMode
from swaserve.scheduler.batch import ScheduleBatch
from swaserve.scheduler.integrity import check_scheduler
from swaserve.scheduler.req import Req
from swaserve.scheduler.scheduler import Scheduler

VOCAB = 50


@dataclass
class Params:  # the fields of SamplingParams the scheduler reads
    max_tokens: int
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None


def fake_next_token(ids: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole history."""
    return (sum(i * (k + 1) for k, i in enumerate(ids)) * 31 + len(ids)) % VOCAB


def make_scheduler(full: int, swa: int | None, window: int, chunk: int, max_running: int, ctx: int = 64,
                   policy: str = "mixed", mixed_cap: int | None = None):
    table = ReqToTokenPool(max_running + 2, ctx)
    if swa is None:
        alloc, ev = TokenToKVPoolAllocator(full), None
    else:
        alloc = SWATokenToKVPoolAllocator(full, swa)
        ev = SWAEvictor(alloc, table, window, margin=1, chunk=2)
    cfg = SchedulerConfig(max_running_requests=max_running, max_prefill_tokens=chunk, schedule_policy=policy,
                          max_mixed_prefill_tokens=mixed_cap)
    return Scheduler(cfg, ctx, table, alloc, ev, check=check_scheduler)


class FakeDevice:
    """Runs scheduled steps the way the engine does. With `overlap`, step N+1 is scheduled and
    launched before step N's tokens reach the scheduler; the 'device' knows every token it sampled
    at once (`unseen`: sampled, not yet processed), the host only after processing."""

    def __init__(self, s: Scheduler, overlap: bool):
        self.s, self.overlap = s, overlap
        self.unseen: dict[str, list[int]] = {}
        self.inflight: tuple[ScheduleBatch, list[int]] | None = None
        self.seen_positions: dict[str, set[int]] = {}

    def busy(self) -> bool:
        return self.s.has_unfinished() or self.inflight is not None

    def step(self) -> ScheduleBatch | None:
        batch = self.s.schedule()
        launched = self._launch(batch) if batch is not None else None
        done, self.inflight = (self.inflight, launched) if self.overlap else (launched, None)
        if done is not None:
            self._process(*done)
        return batch

    def _launch(self, batch: ScheduleBatch) -> tuple[ScheduleBatch, list[int]]:
        assert batch.num_tokens <= max(self.s.config.max_prefill_tokens, len(batch.reqs))
        tokens = []
        assert batch.num_decode == 0 or batch.mode is ForwardMode.EXTEND
        for i, (r, p, n, sample) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample)):
            history = r.ids + self.unseen.get(r.rid, [])  # what the device knows of the sequence
            assert p + n == r.kv_len and p + n <= len(history), "computes only tokens that exist"
            if batch.mode is ForwardMode.DECODE or i < batch.num_decode:
                assert n == 1 and p == len(history) - 1 and r.pending == 1, "decode reads the last token"
            self.seen_positions.setdefault(r.rid, set()).update(range(p, p + n))
            if sample:
                assert p + n == len(history), "a step samples only after the last token"
                tokens.append(fake_next_token(history))
                self.unseen.setdefault(r.rid, []).append(tokens[-1])
        return batch, tokens

    def _process(self, batch: ScheduleBatch, tokens: list[int]) -> None:
        for i in batch.sample_indices():
            self.unseen[batch.reqs[i].rid].pop(0)
        self.s.process_output(batch, tokens)


def run_step(s: Scheduler, seen_positions: dict[str, set[int]]) -> None:
    dev = FakeDevice(s, overlap=False)
    dev.seen_positions = seen_positions
    dev.step()


def check_outputs(reqs: list[Req]) -> None:
    """Chunking, retraction and overlap never change a result, and nothing runs past its end."""
    for r in reqs:
        if r.finish_reason == "abort":
            continue
        for k in range(r.prompt_len, len(r.ids)):
            assert r.ids[k] == fake_next_token(r.ids[:k])
        stops = set(r.params.stop_token_ids or [])
        out = r.output_ids
        assert not stops.intersection(out[:-1]), "tokens after a stop token"
        if r.finish_reason == "stop":
            assert out[-1] in stops
        else:
            assert r.finish_reason == "length" and r.num_output == r.params.max_tokens


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 20), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 40), st.just(0), st.just(False)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(False)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, hybrid=st.booleans(), swa=st.integers(16, 40), chunk=st.integers(3, 16), max_running=st.integers(1, 5),
       overlap=st.booleans(), policy=st.sampled_from(SCHEDULE_POLICIES), mixed_cap=st.none() | st.integers(1, 6))
def test_random_workloads_keep_integrity_and_free_everything(ops, hybrid, swa, chunk, max_running, overlap, policy,
                                                             mixed_cap):
    window = 4
    s = make_scheduler(full=60, swa=swa if hybrid else None, window=window, chunk=chunk, max_running=max_running,
                       policy=policy, mixed_cap=mixed_cap)
    dev = FakeDevice(s, overlap)
    reqs: list[Req] = []
    for op, a, b, stops in ops:
        if op == "add":
            # Stop tokens (one in ten of the vocabulary) end requests in the middle of a step in flight.
            params = Params(b, stop_token_ids=list(range(0, VOCAB, 10)) if stops else None)
            r = Req(f"r{len(reqs)}", f"r{len(reqs)}", 0, a, [(a * 7 + k) % VOCAB for k in range(a)], params, 0, frozenset())
            try:
                s.add(r)
                reqs.append(r)
            except ValueError:
                assert a + b > 60
        elif op == "abort" and reqs:
            s.abort(reqs[a % len(reqs)].group_id)
        else:
            for _ in range(a):
                dev.step()
                s.check_integrity()
    for _ in range(2000):
        if not dev.busy():
            break
        dev.step()
        s.check_integrity()
    assert not dev.busy(), "no progress: a request starved"
    s.check_integrity()
    alloc = s.allocator
    full = getattr(alloc, "full", alloc)
    assert full.available() == 60, "every full slot freed"
    if hybrid:
        assert alloc.swa.available() == swa, "every SWA slot freed"
    check_outputs(reqs)


@pytest.mark.parametrize("policy", SCHEDULE_POLICIES)
@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_and_retraction_happen(overlap, policy):
    s = make_scheduler(full=40, swa=24, window=4, chunk=5, max_running=4, policy=policy)
    reqs = [Req(f"r{i}", f"r{i}", 0, 12, list(range(1 + i, 13 + i)), Params(18), 0, frozenset()) for i in range(3)]
    for r in reqs:
        s.add(r)
    modes = []
    dev = FakeDevice(s, overlap)
    while dev.busy():
        b = dev.step()
        if b is not None:
            modes.append((b.mode, b.num_tokens))
        s.check_integrity()
        for r in s.running:  # the SWA bound holds for every running request
            assert r.kv_len - r.swa_evicted <= s.evictor.max_held()
    assert max(n for m, n in modes if m is ForwardMode.EXTEND) <= 5
    assert s.retractions_total > 0, "3 x 30 tokens cannot fit in 40 slots at once"
    assert all(r.num_output == 18 for r in reqs)
    check_outputs(reqs)


def test_mixed_prefill_cap_bounds_prefill_only_while_decoding():
    """`max_mixed_prefill_tokens`: a step that decodes carries at most that many prefill tokens; a
    step with nothing to decode prefills under the whole budget."""
    s = make_scheduler(full=200, swa=None, window=4, chunk=16, max_running=4, ctx=64, mixed_cap=3)
    reqs = [Req(f"r{i}", f"r{i}", 0, 20, list(range(1 + i, 21 + i)), Params(6), 0, frozenset()) for i in range(3)]
    for r in reqs:
        s.add(r)
    steps = []
    dev = FakeDevice(s, overlap=False)
    while dev.busy():
        b = dev.step()
        if b is not None:
            steps.append((b.num_decode, b.num_tokens - b.num_decode))
        s.check_integrity()
    assert steps[0] == (0, 16), "nothing decodes yet: the whole budget prefills"
    mixed = [p for d, p in steps if d and p]
    assert mixed and max(mixed) == 3, steps
    assert all(r.num_output == 6 for r in reqs)
    check_outputs(reqs)


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


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_that_fills_the_swa_pool_still_decodes(overlap):
    """Found by hypothesis: a 16-token prompt takes all 16 SWA slots; with a step in flight, the
    next decode must be able to use the slots the prefill moved out of the window before that
    step's results are processed."""
    s = make_scheduler(full=60, swa=16, window=4, chunk=16, max_running=1)
    r = Req("a", "a", 0, 16, list(range(16)), Params(2), 0, frozenset())
    s.add(r)
    dev = FakeDevice(s, overlap)
    while dev.busy():
        dev.step()
        s.check_integrity()
    check_outputs([r])
    assert r.num_output == 2 and s.allocator.swa.available() == 16


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_keep_every_stream_decoding(overlap):
    """Under the mixed policy a prompt arriving while others decode never skips a decode: every
    running request that can take a token is in every step, first, with prefill chunks behind it
    under the rest of the budget; prefill_first stalls them for the arrival's prefill."""
    results = {}
    for policy in SCHEDULE_POLICIES:
        s = make_scheduler(full=200, swa=None, window=4, chunk=6, max_running=6, ctx=80, policy=policy)
        dev = FakeDevice(s, overlap)
        reqs = []
        stalls = mixed = 0
        for step in range(200):
            if step % 5 == 0 and len(reqs) < 6:
                r = Req(f"r{step}", f"r{step}", 0, 9, [(step + k) % VOCAB for k in range(9)], Params(20), 0, frozenset())
                s.add(r)
                reqs.append(r)
            decodable = [r for r in s.running if r.needs_decode(s.max_context)]
            b = dev.step()
            s.check_integrity()
            if not dev.busy() and len(reqs) == 6:
                break
            if b is None:
                continue
            in_batch = {id(r) for r in b.reqs[: b.num_decode or (len(b.reqs) if b.mode is ForwardMode.DECODE else 0)]}
            stalls += sum(id(r) not in in_batch for r in decodable)
            mixed += b.kind == "mixed"
            if b.kind == "mixed":
                assert b.num_tokens <= 6 and all(n == 1 for n in b.extend_lens[: b.num_decode])
                assert all(r.prompt_len >= p + n for r, p, n in zip(b.reqs[b.num_decode :], b.prefix_lens[b.num_decode :],
                                                                    b.extend_lens[b.num_decode :])), "prefill rows"
        assert not dev.busy()
        check_outputs(reqs)
        results[policy] = (stalls, mixed)
    assert results["mixed"][0] == 0 and results["mixed"][1] > 0
    assert results["prefill_first"][0] > 0 and results["prefill_first"][1] == 0
