"""TorchNativeAttnBackend vs a dense reference written here, on random pools, hybrid and single-pool.

Every slot that no live position owns (slot 0, free slots, SWA slots freed when they left the
window) is poisoned with NaN, so a read outside the window shows up as a NaN or a wrong output.
"""

from __future__ import annotations

import pytest
import torch

from swaserve.attention.base import AttentionSpec
from swaserve.attention.torch_native import TorchNativeAttnBackend
from swaserve.memory import (
    KVPool,
    ReqToTokenPool,
    SWAEvictor,
    SWAKVPool,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from swaserve.runner.forward_batch import ForwardBatch, ForwardMode

W = 8
H, HKV = 4, 2  # GQA: two query heads per KV head
FULL_DIMS = (8, 6)  # (k, v) head dims of the full layer: V differs from K
SWA_DIMS = (12, 4)  # the SWA layer's own K/V shape (hybrid only: one pool holds one shape)
FULL, SLIDING = 0, 1  # global layer ids


class Setup:
    """Two layers (0 full, 1 sliding), a request table, allocator and backend; K/V history per row."""

    def __init__(self, hybrid: bool, full_size: int = 160, swa_size: int = 96):
        torch.manual_seed(0)
        self.hybrid = hybrid
        self.dims = {FULL: FULL_DIMS, SLIDING: SWA_DIMS if hybrid else FULL_DIMS}
        if hybrid:
            self.full_pool = KVPool(full_size, 1, HKV, *FULL_DIMS)
            self.swa_pool = KVPool(swa_size, 1, HKV, *SWA_DIMS)
            self.kv = SWAKVPool(self.full_pool, self.swa_pool, (FULL,), (SLIDING,))
            self.alloc = SWATokenToKVPoolAllocator(full_size, swa_size)
            f2s = self.alloc.full_to_swa_device
        else:
            self.full_pool, self.swa_pool = KVPool(full_size, 2, HKV, *FULL_DIMS), None
            self.kv = SWAKVPool(self.full_pool, None, (FULL,), (SLIDING,))
            self.alloc, f2s = TokenToKVPoolAllocator(full_size), None
        for pool in (self.full_pool, self.swa_pool):
            if pool is not None:
                for i in range(pool.num_layers):
                    pool.k_buffer(i).fill_(float("nan"))
                    pool.v_buffer(i).fill_(float("nan"))
        self.r2t = ReqToTokenPool(8, 128)
        self.backend = TorchNativeAttnBackend(self.kv, self.r2t, f2s, sliding_window=W)
        self.hist: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def space(self, layer: int, full_slots: torch.Tensor) -> torch.Tensor:
        if self.kv.uses_swa_space(layer):
            return self.alloc.translate_full_to_swa(full_slots).long()
        return full_slots

    def add_request(self, prefix: int) -> int:
        """A request with `prefix` positions already cached, out-of-window SWA slots freed."""
        row = self.r2t.alloc()
        slots = self.alloc.alloc(prefix)
        self.r2t.write(row, 0, slots)
        self.hist[row] = {}
        for layer, (dk, dv) in self.dims.items():
            k, v = torch.randn(prefix, HKV, dk), torch.randn(prefix, HKV, dv)
            self.kv.set_kv(layer, self.space(layer, slots), k, v)
            self.hist[row][layer] = (k, v)
        if self.hybrid:
            # The next query is at `prefix`; positions before prefix-W+1 are dead in the SWA pool.
            dead = self.alloc.translate_full_to_swa(slots[: max(0, prefix - W + 1)]).long()
            SWAEvictor(self.alloc, self.r2t, W, margin=0, chunk=1).evict(row, prefix, 0)
            self.swa_pool.k_buffer(0)[dead] = float("nan")
            self.swa_pool.v_buffer(0)[dead] = float("nan")
            self.alloc.check_integrity()
        return row

    def batch(self, rows: list[int], n_new: list[int], decode: bool) -> ForwardBatch:
        prefix = [self.hist[r][FULL][0].shape[0] for r in rows]
        locs = []
        for r, p, n in zip(rows, prefix, n_new):
            slots = self.alloc.alloc(n)
            assert slots is not None
            self.r2t.write(r, p, slots)
            locs.append(slots)
        positions = [p + i for p, n in zip(prefix, n_new) for i in range(n)]
        return ForwardBatch.build(
            ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=[0] * len(positions),
            positions=positions,
            req_pool_indices=rows,
            seq_lens=[p + n for p, n in zip(prefix, n_new)],
            out_cache_loc=torch.cat(locs),
            device="cpu",
            extend_prefix_lens=None if decode else prefix,
            extend_seq_lens=None if decode else n_new,
        )


def reference(q, k_all, v_all, q_pos, window, scaling, softcap, sinks):
    """Per query, dense softmax over keys max(0, p-W+1) .. p in float64, looping over heads."""
    out = torch.zeros(q.shape[0], H, v_all.shape[-1], dtype=torch.float64)
    g = H // HKV
    for t, p in enumerate(q_pos):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(H):
            ks, vs = k_all[lo : p + 1, h // g].double(), v_all[lo : p + 1, h // g].double()
            logits = ks @ q[t, h].double() * scaling
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            probs = torch.softmax(logits, 0)
            out[t, h] = probs[: ks.shape[0]] @ vs
    return out


def specs(s: Setup, softcap: float | None) -> dict[int, AttentionSpec]:
    # The sliding layer uses a non-default scale so a mixed-up spec shows in the outputs.
    return {
        FULL: AttentionSpec(FULL, H, HKV, *s.dims[FULL], s.dims[FULL][0] ** -0.5, None, softcap),
        SLIDING: AttentionSpec(SLIDING, H, HKV, *s.dims[SLIDING], 0.3, W, softcap),
    }


def snapshot(s: Setup) -> dict[str, torch.Tensor]:
    out = {}
    for name, pool in (("full", s.full_pool), ("swa", s.swa_pool)):
        if pool is not None:
            for i in range(pool.num_layers):
                out[f"{name}.k{i}"] = pool.k_buffer(i).clone()
                out[f"{name}.v{i}"] = pool.v_buffer(i).clone()
    return out


def run_and_check(s: Setup, rows, n_new, decode, softcap, use_sinks):
    sp = specs(s, softcap)
    batch = s.batch(rows, n_new, decode)
    s.backend.init_forward_metadata(batch)
    sinks = torch.randn(H) * 2 if use_sinks else None
    before = snapshot(s)
    written: dict[str, torch.Tensor] = {}
    for layer in (FULL, SLIDING):
        dk, dv = s.dims[layer]
        n = batch.num_tokens
        q, k, v = torch.randn(n, H, dk), torch.randn(n, HKV, dk), torch.randn(n, HKV, dv)
        out = s.backend.forward(q, k, v, sp[layer], batch, sinks)
        assert out.shape == (n, H, dv) and torch.isfinite(out).all()

        # K/V landed at the right slots of the right pool.
        locs = s.space(layer, batch.out_cache_loc)
        pool = s.swa_pool if s.kv.uses_swa_space(layer) else s.full_pool
        local = 0 if s.hybrid else layer
        assert torch.equal(pool.k_buffer(local)[locs], k) and torch.equal(pool.v_buffer(local)[locs], v)
        tag = "swa" if pool is s.swa_pool else "full"
        written[f"{tag}.k{local}"] = written[f"{tag}.v{local}"] = locs

        off = 0
        for r, m in zip(rows, n_new):
            hk, hv = s.hist[r][layer]
            k_all, v_all = torch.cat([hk, k[off : off + m]]), torch.cat([hv, v[off : off + m]])
            p0 = hk.shape[0]
            ref = reference(q[off : off + m], k_all, v_all, list(range(p0, p0 + m)),
                            sp[layer].sliding_window, sp[layer].scaling, softcap, sinks)
            torch.testing.assert_close(out[off : off + m].double(), ref, atol=2e-5, rtol=1e-5)
            off += m

    # Nothing outside the new tokens' slots changed.
    after = snapshot(s)
    for key, buf in before.items():
        keep = torch.ones(buf.shape[0], dtype=torch.bool)
        if key in written:
            keep[written[key]] = False
        torch.testing.assert_close(after[key][keep], buf[keep], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "single_pool"])
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
def test_decode_window_boundaries(hybrid, variant):
    s = Setup(hybrid)
    # Decode queries at positions W-1, W, W+1, 2W+3 (one batch, different lengths).
    rows = [s.add_request(p) for p in (W - 1, W, W + 1, 2 * W + 3)]
    run_and_check(s, rows, [1] * len(rows), True, 5.0 if variant == "softcap" else None, variant == "sinks")


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "single_pool"])
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
def test_extend_with_and_without_prefix(hybrid, variant):
    s = Setup(hybrid)
    # (cached prefix, new tokens): fresh prompt crossing the window twice, a cached prefix that
    # crosses the window, a prefix shorter than the window that the new tokens push past it,
    # and a one-token extend right at the boundary.
    cases = [(0, 2 * W + 3), (2 * W + 1, 5), (3, W + 2), (W, 1)]
    rows = [s.add_request(p) for p, _ in cases]
    run_and_check(s, rows, [n for _, n in cases], False,
                  5.0 if variant == "softcap" else None, variant == "sinks")


def test_decode_with_padded_row_reads_only_slot_zero():
    # A graph-padded lane: row 0, seq_len 1, writing slot 0; live requests must be unaffected.
    s = Setup(True)
    rows = [s.add_request(p) for p in (W + 1, 2 * W + 3)]
    batch = s.batch(rows, [1, 1], True)
    pad = ForwardBatch.build(
        ForwardMode.DECODE, [0, 0, 0], batch.positions.tolist() + [0], rows + [0],
        batch.seq_lens_cpu + [1], torch.cat([batch.out_cache_loc, torch.zeros(1, dtype=torch.int64)]), "cpu",
    )
    s.backend.init_forward_metadata(pad)
    sp = specs(s, None)[SLIDING]
    q, k, v = torch.randn(3, H, SWA_DIMS[0]), torch.randn(3, HKV, SWA_DIMS[0]), torch.randn(3, HKV, SWA_DIMS[1])
    out = s.backend.forward(q, k, v, sp, pad)
    assert torch.isfinite(out).all()
    assert torch.equal(s.swa_pool.k_buffer(0)[0], k[2])  # the padded lane wrote the dummy slot only
    for i, r in enumerate(rows):
        hk, hv = s.hist[r][SLIDING]
        p0 = hk.shape[0]
        ref = reference(q[i : i + 1], torch.cat([hk, k[i : i + 1]]), torch.cat([hv, v[i : i + 1]]),
                        [p0], W, sp.scaling, None, None)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=2e-5, rtol=1e-5)


def test_freed_window_slot_is_detected():
    # A scheduler bug that frees an SWA slot still inside the window must trip the oracle.
    s = Setup(True)
    row = s.add_request(2 * W)
    s.alloc.free_swa(s.r2t.slots(row, 2 * W - 2, 2 * W - 1))
    batch = s.batch([row], [1], True)
    with pytest.raises(AssertionError, match="inside the window"):
        s.backend.init_forward_metadata(batch)

