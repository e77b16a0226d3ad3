"""Unit tests of the memory layer: request table, allocators, pools, translation, eviction, planner."""

from __future__ import annotations

import pytest
import torch

from swaserve.memory import (
    KVPool,
    ReqToTokenPool,
    SWAEvictor,
    SWAKVPool,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    plan_memory,
)
from swaserve.model_config import KVGroup


def test_req_to_token_rows_and_reserved_row_zero():
    pool = ReqToTokenPool(max_reqs=3, max_context=8)
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3] and pool.alloc() is None
    pool.write(rows[0], 2, torch.tensor([5, 6, 7]))
    assert pool.req_to_token.dtype == torch.int32
    assert pool.req_to_token[rows[0]].tolist() == [0, 0, 5, 6, 7, 0, 0, 0]
    assert pool.slots(rows[0], 2, 5).tolist() == [5, 6, 7]
    pool.check_integrity()
    pool.free(rows[0])
    assert not pool.req_to_token[rows[0]].any(), "a freed row is zeroed"
    with pytest.raises(ValueError):
        pool.free(rows[0])
    with pytest.raises(ValueError):
        pool.free(0)
    with pytest.raises(ValueError):
        pool.write(rows[1], 6, torch.tensor([1, 2, 3]))
    pool.check_integrity()
    assert not pool.req_to_token[0].any()


def test_allocator_all_or_nothing_and_slot_zero_never_handed_out():
    a = TokenToKVPoolAllocator(5)
    assert a.alloc(6) is None and a.available() == 5
    s = a.alloc(5)
    assert s.dtype == torch.int64 and sorted(s.tolist()) == [1, 2, 3, 4, 5]
    assert a.alloc(1) is None
    a.check_integrity(owned=s)
    a.free(s[:2])
    a.check_integrity(owned=s[2:])
    assert a.available() == 2 and a.used() == 3


def test_allocator_recycles_in_non_monotonic_order():
    a = TokenToKVPoolAllocator(4)
    s = a.alloc(4)
    a.free(s[[2, 0]])
    assert a.alloc(2).tolist() == [3, 1]


@pytest.mark.parametrize("misuse", ["double_free", "free_zero", "owned_and_free"])
def test_allocator_misuse_is_caught(misuse):
    a = TokenToKVPoolAllocator(4)
    s = a.alloc(2)
    with pytest.raises(AssertionError):
        if misuse == "double_free":
            a.free(s)
            a.free(s[:1])
            a.check_integrity()
        elif misuse == "free_zero":
            a.free(torch.tensor([0]))
            a.check_integrity()
        else:
            a.free(s[:1])
            a.check_integrity(owned=s)


def test_kv_pool_shapes_and_set_kv():
    p = KVPool(size=6, num_layers=2, num_kv_heads=2, k_head_dim=6, v_head_dim=4)
    assert p.k_buffer(1).shape == (7, 2, 6) and p.v_buffer(1).shape == (7, 2, 4)
    k, v = torch.randn(3, 2, 6), torch.randn(3, 2, 4)
    p.set_kv(1, torch.tensor([4, 1, 6], dtype=torch.int32), k, v)
    assert torch.equal(p.k_buffer(1)[[4, 1, 6]], k) and torch.equal(p.v_buffer(1)[[4, 1, 6]], v)
    assert not p.k_buffer(0).any()
    assert p.bytes_per_token() == 2 * 2 * (6 + 4) * 4


def test_swa_kv_pool_routes_layers_with_their_own_shapes():
    # Gemma-4-like: SWA layers 8 heads x 16, full layers 2 heads x 32 (scaled down).
    full = KVPool(10, 2, 2, 32, dtype=torch.float32)
    swa = KVPool(4, 4, 8, 16, dtype=torch.float32)
    kv = SWAKVPool(full, swa, full_layer_ids=(2, 5), swa_layer_ids=(0, 1, 3, 4))
    assert kv.uses_swa_space(3) and not kv.uses_swa_space(5)
    assert kv.k_buffer(5) is full.k_buffer(1) and kv.k_buffer(4) is swa.k_buffer(3)
    assert kv.k_buffer(0).shape == (5, 8, 16) and kv.k_buffer(2).shape == (11, 2, 32)
    single = SWAKVPool(KVPool(10, 6, 2, 32), None, full_layer_ids=(2, 5), swa_layer_ids=(0, 1, 3, 4))
    assert not single.uses_swa_space(3) and single.k_buffer(3) is single.full.k_buffer(3)


def _gemma4_like(kv_shared: int):
    """Full layers (1, 5) 1 head x 32, sliding (0, 2, 3, 4) 2 x 16; the last `kv_shared` layers read
    the K/V of the last earlier layer of their type."""
    from types import SimpleNamespace

    from swaserve.model_config import ModelConfig

    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
             "full_attention"]
    hf = SimpleNamespace(num_hidden_layers=6, vocab_size=32, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                         attention_k_eq_v=True, sliding_window=8, layer_types=types, num_kv_shared_layers=kv_shared,
                         max_position_embeddings=64)
    return ModelConfig.from_hf(hf)


@pytest.mark.parametrize("hybrid", [True, False])
def test_swa_kv_pool_build_per_pool_shapes_and_kv_shared_layers(hybrid):
    cfg = _gemma4_like(kv_shared=2)
    assert cfg.kv_source == ((4, 3), (5, 1))
    assert cfg.full_group.layer_ids == (1,) and cfg.swa_group.layer_ids == (0, 2, 3)
    kv = SWAKVPool.build(cfg, full_tokens=20, swa_tokens=9, hybrid=hybrid, dtype=torch.float32)
    # KV-shared layers own no buffer: the pools hold only the computing layers, and a shared layer's
    # id reaches its source's buffers.
    assert kv.full.num_layers == 1 and kv.swa.num_layers == 3
    assert kv.k_buffer(4) is kv.k_buffer(3) and kv.v_buffer(5) is kv.v_buffer(1)
    assert kv.layer_ids == list(range(6))
    assert kv.k_buffer(1).shape[1:] == (1, 32) and kv.k_buffer(0).shape[1:] == (2, 16)
    # Hybrid: the SWA pool has its own slots (and index space); otherwise one index space with
    # full-sized SWA buffers, so nothing is translated.
    assert kv.swa_space == hybrid and kv.uses_swa_space(4) == hybrid and not kv.uses_swa_space(5)
    assert kv.swa.size == (9 if hybrid else 20)
    assert kv.total_bytes() == sum(p.total_bytes() for p in kv.pools())


def test_plan_prints_each_pools_shape_and_kv_shared_layers():
    cfg = _gemma4_like(kv_shared=2)
    plan = plan_memory(1 << 20, cfg.full_group, cfg.swa_group, torch.bfloat16, 64, 8, kv_shared_layers=2)
    text = plan.describe()
    assert "1 layers x 1 heads x (32 + 32)" in text and "3 layers x 2 heads x (16 + 16)" in text
    assert "2 KV-shared layers" in text
    assert plan.full_bytes_per_token == 1 * 1 * 64 * 2 and plan.swa_bytes_per_token == 3 * 2 * 32 * 2


def test_swa_allocator_atomic_and_translation():
    a = SWATokenToKVPoolAllocator(full_size=8, swa_size=3)
    assert a.available() == 3
    assert a.alloc(4) is None, "SWA pool too small: take from neither pool"
    assert a.full.available() == 8 and a.swa.available() == 3
    f = a.alloc(3)
    s = a.translate_full_to_swa(f)
    assert s.dtype == torch.int32 and sorted(s.tolist()) == [1, 2, 3]
    assert a.translate_full_to_swa(torch.tensor([0])).tolist() == [0], "mapping[0] == 0"
    assert a.translate_full_to_swa(torch.tensor([-1])).tolist() == [-1], "trailing -1 sentinel"
    unwritten = torch.zeros(4, dtype=torch.int32)  # unwritten req_to_token entries
    assert a.translate_full_to_swa(unwritten).tolist() == [0, 0, 0, 0]
    a.check_integrity(owned_full=f)
    a.free_swa(f[:2])
    assert a.translate_full_to_swa(f[:2]).tolist() == [0, 0] and a.available() == 2
    a.check_integrity(owned_full=f)
    a.free_swa(f[:2])  # already unmapped: nothing more is freed
    a.check_integrity(owned_full=f)
    a.free(f)
    a.check_integrity(owned_full=torch.empty(0, dtype=torch.int64))
    assert a.full.available() == 8 and a.swa.available() == 3
    with pytest.raises(ValueError):
        a.free_swa(torch.tensor([0]))


def test_stale_mapping_is_caught():
    a = SWATokenToKVPoolAllocator(full_size=4, swa_size=4)
    f = a.alloc(2)
    a.swa.free(a.full_to_swa[f[:1]])  # SWA slot freed behind the table's back
    with pytest.raises(AssertionError):
        a.check_integrity(owned_full=f)


def _request(a: SWATokenToKVPoolAllocator, table: ReqToTokenPool, n: int) -> int:
    row = table.alloc()
    table.write(row, 0, a.alloc(n))
    return row


@pytest.mark.parametrize("window", [4, 7])
@pytest.mark.parametrize("margin", [0, 2])
def test_eviction_at_window_boundaries(window, margin):
    """Positions W-1, W, W+1, 2W+3: exactly the positions no future query can see are freed."""
    for next_q in (window - 1, window, window + 1, 2 * window + 3):
        a = SWATokenToKVPoolAllocator(full_size=64, swa_size=64)
        table = ReqToTokenPool(2, 64)
        row = _request(a, table, next_q + 1)
        ev = SWAEvictor(a, table, window, margin=margin, chunk=1)
        evicted = ev.evict(row, next_query_pos=next_q, evicted=0)
        first_visible = max(0, next_q - window + 1)  # the query at next_q sees next_q-W+1 .. next_q
        assert evicted == max(0, first_visible - margin)
        swa = a.translate_full_to_swa(table.slots(row, 0, next_q + 1))
        assert (swa[:evicted] == 0).all(), "dead positions freed"
        assert (swa[evicted:] > 0).all(), "every position a query can still see keeps its SWA slot"
        assert (swa[first_visible:] > 0).all()
        a.check_integrity(owned_full=table.slots(row, 0, next_q + 1))


def test_eviction_chunks_and_bound():
    a = SWATokenToKVPoolAllocator(full_size=256, swa_size=256)
    table = ReqToTokenPool(1, 256)
    row = table.alloc()
    W, margin, chunk = 8, 1, 5
    ev = SWAEvictor(a, table, W, margin=margin, chunk=chunk)
    evicted = 0
    for pos in range(200):  # decode one token a step
        table.write(row, pos, a.alloc(1))
        evicted = ev.evict(row, next_query_pos=pos + 1, evicted=evicted)
        held = a.swa_used()
        assert held <= ev.max_held(), f"holds {held} > bound {ev.max_held()} at {pos}"
        assert held >= min(pos + 1, W), "never fewer than the window"
    assert a.full.used() == 200
    a.check_integrity(owned_full=table.slots(row, 0, 200))


def test_evict_many_equals_one_evict_per_request():
    """One free_swa call for a step's due requests frees exactly what per-request calls free."""
    W, chunk = 6, 3
    lens = [2, 9, 15, 30, 7]
    states = []
    for batched in (False, True):
        a = SWATokenToKVPoolAllocator(full_size=128, swa_size=128)
        table = ReqToTokenPool(len(lens), 64)
        rows = [_request(a, table, n) for n in lens]
        ev = SWAEvictor(a, table, W, margin=1, chunk=chunk)
        items = [(row, n, 2 if n > 20 else 0) for row, n in zip(rows, lens)]  # one with a head start
        if batched:
            new = ev.evict_many(items)
        else:
            new = [ev.evict(*item) for item in items]
        mapping = [a.translate_full_to_swa(table.slots(row, 0, n)).gt(0).tolist() for row, n in zip(rows, lens)]
        states.append((new, mapping, a.swa_used()))
        a.check_integrity(owned_full=torch.cat([table.slots(row, 0, n) for row, n in zip(rows, lens)]))
    assert states[0] == states[1]
    assert states[1][0] == [0, 3, 9, 24, 0], "requests below a chunk of dead positions (n = 2, 7) are left alone"


def test_memory_plan_gemma3_12b_shape():
    full = KVGroup(tuple(range(8)), 8, 256, 256)
    swa = KVGroup(tuple(range(8, 48)), 8, 256, 256)
    budget = 40 << 30
    hyb = plan_memory(budget, full, swa, torch.bfloat16, 32768, 1024, hybrid=True)
    one = plan_memory(budget, full, swa, torch.bfloat16, 32768, 1024, hybrid=False)
    assert hyb.total_bytes <= budget and one.total_bytes <= budget
    assert one.full_bytes_per_token == 48 * 8 * 512 * 2 and hyb.swa_bytes_per_token == 40 * 8 * 512 * 2
    n_h, n_1 = hyb.max_concurrent_requests(32768), one.max_concurrent_requests(32768)
    assert n_1 == 3 and n_h >= 16
    # Both pools run out at about the same time for max-context requests.
    assert hyb.full_tokens // 32768 - n_h <= 1 and hyb.swa_tokens // hyb.swa_tokens_per_request - n_h <= 1


def test_memory_plan_ratio_override_and_errors():
    full = KVGroup((5,), 1, 16, 16)
    swa = KVGroup((0, 1, 2, 3, 4), 1, 16, 16)
    p = plan_memory(1 << 20, full, swa, torch.float32, 1024, 64, swa_full_tokens_ratio=0.5)
    assert abs(p.swa_tokens / p.full_tokens - 0.5) < 0.01
    with pytest.raises(ValueError):
        plan_memory(10, full, swa, torch.float32, 1024, 64)
    no_swa = plan_memory(1 << 20, full, KVGroup((), 1, 16, 16), torch.float32, 1024, None)
    assert not no_swa.hybrid and no_swa.swa_tokens == 0
