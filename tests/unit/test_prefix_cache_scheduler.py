"""The scheduler with the prefix cache on a fake device that keeps a fingerprint of every K/V it
writes (full pool and SWA pool): random workloads of prompts sharing prefixes, n > 1, aborts, tiny
pools, overlap. Every step checks that each query reads exactly the K/V of its own history, and
integrity of requests, tree and pools; at the end nothing leaks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import VOCAB, FakeDevice, check_outputs

from swaserve.config import SCHEDULE_POLICIES, SchedulerConfig
from swaserve.memory import ReqToTokenPool, SWAEvictor, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from swaserve.prefix_cache import RadixCache
from swaserve.prefix_cache.integrity import check_tree
from swaserve.scheduler.batch import ScheduleBatch
from swaserve.scheduler.integrity import check_scheduler
from swaserve.scheduler.req import Req
from swaserve.scheduler.scheduler import Scheduler

WINDOW = 4


@dataclass
class Params:
    max_tokens: int
    n: int = 1
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None


def make(full: int, swa: int | None, chunk: int, max_running: int, policy: str = "mixed", ctx: int = 64) -> Scheduler:
    table = ReqToTokenPool(max_running + 2, ctx)
    if swa is None:
        alloc, ev = TokenToKVPoolAllocator(full), None
    else:
        alloc = SWATokenToKVPoolAllocator(full, swa)
        ev = SWAEvictor(alloc, table, WINDOW, margin=1, chunk=2)
    cfg = SchedulerConfig(max_running_requests=max_running, max_prefill_tokens=chunk, schedule_policy=policy)
    cache = RadixCache(alloc, WINDOW if swa is not None else None, check_tree)
    return Scheduler(cfg, ctx, table, alloc, ev, cache, check_scheduler)


class KVDevice(FakeDevice):
    """FakeDevice that also 'writes K/V': slot -> fingerprint of the history up to that position,
    in the full pool and (through full_to_swa at launch) the SWA pool, and checks every read."""

    def __init__(self, s: Scheduler, overlap: bool):
        super().__init__(s, overlap)
        self.full_kv: dict[int, tuple] = {}
        self.swa_kv: dict[int, tuple] = {}
        self.computed = 0

    def _launch(self, batch: ScheduleBatch):
        s = self.s
        table = getattr(s.allocator, "full_to_swa", None)
        loc = batch.out_cache_loc.tolist()
        k = 0
        for r, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            hist = r.ids + self.unseen.get(r.rid, [])
            row = s.table.slots(r.row, 0, p + n).tolist()
            for q in range(p, p + n):  # what each new query attends, before the writes
                lo = 0 if table is None else max(0, q - WINDOW + 1)
                for j in range(p):
                    fp = tuple(hist[: j + 1])
                    assert self.full_kv.get(row[j]) == fp, f"{r.rid}: full K/V of position {j} is not its own"
                    if table is not None and j >= lo:
                        assert self.swa_kv.get(int(table[row[j]])) == fp, f"{r.rid}: SWA K/V of {j} (query {q})"
            for j in range(p, p + n):
                assert row[j] == loc[k]
                self.full_kv[loc[k]] = tuple(hist[: j + 1])
                if table is not None:
                    assert int(table[loc[k]]) > 0
                    self.swa_kv[int(table[loc[k]])] = tuple(hist[: j + 1])
                k += 1
            self.computed += n
        return super()._launch(batch)


ops = st.lists(
    st.one_of(
        # (add, base, shared length, own suffix, max_tokens, n)
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 30), st.integers(0, 6), st.integers(1, 12),
                  st.integers(1, 2)),
        st.tuples(st.just("abort"), st.integers(0, 40), st.just(0), st.just(0), st.just(0), st.just(1)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0), st.just(0), st.just(1)),
    ),
    min_size=1,
    max_size=40,
)
BASES = [[(b * 13 + 5 * k + k * k) % VOCAB for k in range(40)] for b in range(3)]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, hybrid=st.booleans(), swa=st.integers(16, 40), chunk=st.integers(3, 16),
       max_running=st.integers(1, 5), overlap=st.booleans(), policy=st.sampled_from(SCHEDULE_POLICIES))
def test_random_shared_prefix_workloads(ops, hybrid, swa, chunk, max_running, overlap, policy):
    s = make(full=80, swa=swa if hybrid else None, chunk=chunk, max_running=max_running, policy=policy)
    dev = KVDevice(s, overlap)
    reqs: list[Req] = []
    for op, a, b, c, d, n in ops:
        if op == "add":
            prompt = BASES[a][: max(1, b)] + [(a + b + c * 7 + k) % VOCAB for k in range(c)]
            gid = f"g{len(reqs)}"
            group = [Req(f"{gid}#{i}", gid, i, len(prompt), list(prompt), Params(d, n), 0, frozenset())
                     for i in range(n)]
            try:
                for r in group:
                    s.add(r)
                reqs.extend(group)
            except ValueError:
                assert len(prompt) + d > 64 and not any(r in s.waiting for r in group)
        elif op == "abort" and reqs:
            s.abort(reqs[a % len(reqs)].group_id)
        else:
            for _ in range(a):
                dev.step()
                s.check_integrity()
    for _ in range(3000):
        if not dev.busy():
            break
        dev.step()
        s.check_integrity()
    assert not dev.busy(), "no progress: a request starved"
    check_outputs(reqs)
    cache = s.prefix.cache
    assert all(n.lock == 0 for n in cache.nodes()), "a finished request still locks the tree"
    full = getattr(s.allocator, "full", s.allocator)
    assert full.used() == cache.full_cached and (not hybrid or s.allocator.swa.used() == cache.swa_cached)
    s.reset_prefix_cache()
    s.check_integrity()
    assert full.available() == 80 and cache.full_cached == 0, "every full slot freed"
    if hybrid:
        assert s.allocator.swa.available() == swa, "every SWA slot freed"


@pytest.mark.parametrize("overlap", [False, True])
def test_follow_up_reuses_the_conversation_and_counts_hits(overlap):
    """A second request extending the first's prompt + output computes only its new tokens; a
    third one diverging inside the first prompt reuses nothing there (the tombstoned window)."""
    s = make(full=200, swa=60, chunk=64, max_running=4, ctx=120)
    dev = KVDevice(s, overlap)
    first = Req("a", "a", 0, 30, list(range(1, 31)), Params(10), 0, frozenset())
    s.add(first)
    while dev.busy():
        dev.step()
        s.check_integrity()
    hist = first.ids + [7, 8, 9]
    second = Req("b", "b", 0, len(hist), list(hist), Params(3), 0, frozenset())
    s.add(second)
    before = dev.computed
    while dev.busy():
        dev.step()
        s.check_integrity()
    # 39 positions had K/V (the last output token's was never computed): 39 matched.
    assert second.num_cached_tokens == 39
    assert dev.computed - before == (len(hist) - 39) + 2, "only the new tokens and the decodes were computed"
    third = Req("c", "c", 0, 15, list(range(1, 15)) + [99], Params(2), 0, frozenset())
    s.add(third)
    while dev.busy():
        dev.step()
        s.check_integrity()
    assert third.num_cached_tokens == 0, "the window before position 14 was freed long ago"
    assert s.prefix.hit_tokens == 39 and s.prefix.query_tokens == 30 + len(hist) + 15
    check_outputs([first, second, third])


def test_system_prompt_then_short_questions_share_the_prompt():
    """The prompt's last 2W - 1 positions keep their SWA slots, so a prompt that diverges up to W
    tokens before the cached one's end reuses everything before the divergence."""
    s = make(full=300, swa=80, chunk=64, max_running=4, ctx=120)
    dev = KVDevice(s, False)
    system = [(3 * k + 1) % VOCAB for k in range(40)]
    reqs = []
    for i, q in enumerate(([5, 6, 7], [8, 9], [10, 11, 12])):
        r = Req(f"q{i}", f"q{i}", 0, 43 if len(q) == 3 else 42, system + q, Params(6), 0, frozenset())
        s.add(r)
        reqs.append(r)
        while dev.busy():
            dev.step()
            s.check_integrity()
    assert [r.num_cached_tokens for r in reqs] == [0, 40, 40]
    check_outputs(reqs)


def test_n_siblings_prefill_the_prompt_once():
    s = make(full=200, swa=60, chunk=8, max_running=4, ctx=80)
    dev = KVDevice(s, True)
    prompt = list(range(2, 22))
    group = [Req(f"g#{i}", "g", i, 20, list(prompt), Params(5, n=3), 0, frozenset()) for i in range(3)]
    for r in group:
        s.add(r)
    while dev.busy():
        dev.step()
        s.check_integrity()
    assert [r.num_cached_tokens for r in group] == [0, 19, 19]
    assert dev.computed == 20 + 1 + 1 + 3 * 4, "the prompt once, one token per sibling, then decodes"
    check_outputs(group)


def test_abort_mid_prefill_and_memory_pressure_evicts_before_retracting():
    s = make(full=60, swa=30, chunk=4, max_running=4, ctx=60)
    dev = KVDevice(s, False)
    a = Req("a", "a", 0, 20, list(range(20)), Params(5), 0, frozenset())
    s.add(a)
    dev.step()
    s.abort("a")
    s.check_integrity()
    assert s.prefix.cache.full_cached == 4, "the aborted prefill's computed chunk is cached"
    for i in range(6):  # fills the pool: the cache must give way, retracting nobody at first
        s.add(Req(f"r{i}", f"r{i}", 0, 8, [40 + i] * 8, Params(3), 0, frozenset()))
        while dev.busy():
            dev.step()
            s.check_integrity()
    assert s.retractions_total == 0
    cache = s.prefix.cache
    assert cache.match(list(range(20)), 19)[0] == 0, "the oldest entry was evicted"
    assert cache.match([45] * 8 + [1], 8)[0] == 8, "the newest stays"
