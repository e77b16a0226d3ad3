"""The deterministic mode's kernels: `bi_linear` (one reduction order for every M: every tiling bitwise
equal) and `unified_attention` (decode and extend through the request
table, SWA space for sliding layers) against references, and bitwise invariance of a row to its batch
and chunking."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; kernel tests need it (CPU: TRITON_INTERPRET=1)")

from kernel_ref import attend_ref, make_pools, tolerances, window_mask

from swaserve.kernels import bi_matmul, unified_launch
from swaserve.kernels.bi_matmul import Tiling, bi_linear, tiling
from swaserve.kernels.index_builders import window_slots
from swaserve.kernels.unified_attention import PROGRAMS, decode_programs, unified_attention
from swaserve.kernels.unified_launch import extend_launch, extend_tile_rows, flat_extend

# ---- bi_linear -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_bi_linear_matches_reference(dtype, bias, device, seed):
    g = torch.Generator().manual_seed(seed)
    M, K, N = 37, 600, 200  # ragged in every dim: masks on M, N and the last K chunk
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = torch.randn(N, K, generator=g).to(dtype).to(device) * K**-0.5
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
    for out_dtype in (None, torch.float32):
        y = bi_linear(x, w, b, out_dtype=out_dtype)
        assert y.dtype == (out_dtype or dtype)
        torch.testing.assert_close(y.double(), ref, **tolerances(y.dtype if out_dtype is None else dtype))


def test_bi_linear_rule_prefill_tiles_follow_the_last_wave():
    """Past 256 rows the rule takes 256x128 tiles unless 128x128 ones fill the last wave better, and
    a narrow weight at one row gets the narrowest decode tile (the H100's 132 SMs, bf16)."""
    def rule(m, n, k):
        return bi_matmul._tiling(m, n, k, torch.bfloat16, 132, False)

    assert rule(2048, 13824, 1152) == bi_matmul.BIG  # 864 or 1728 tiles: 93.5% full waves either way
    assert rule(2048, 2560, 2048) == bi_matmul.WIDE  # 160 big tiles: a second wave of 28 of 132 SMs
    assert rule(8192, 2560, 2048) == bi_matmul.BIG  # 640 big tiles: 97% full waves
    assert rule(1, 1152, 6912) == bi_matmul._LADDERS[256][0][1][-1]  # 1B's down: 36 programs, not 18


def test_bi_linear_rows_are_batch_invariant_across_tilings(device, seed):
    """A row's bits whatever its batch: the rule's tilings (which follow M and the GPU's SM count),
    every tiling of its ladders, and others of other widths and K steps all give the row it gets alone,
    in bf16 and as float32 (the accumulator's own bits, which a bf16 store can round alike even when
    the sums were added in another order). K = 2048 selects the ladders of the long K steps; the
    interpreter runs every tiling with one K step (`INTERPRET_BLOCK_K`), so there a shorter K gives
    the same tilings at an eighth of the cost."""
    g = torch.Generator().manual_seed(seed)
    K, N = (2048 if device == "cuda" else 256), 96
    w = torch.randn(N, K, generator=g).bfloat16().to(device)
    # Input-major storage (GPT-OSS experts): the same weight through a transposed view.
    w_t = w.T.contiguous().T
    probe = torch.randn(1, K, generator=g).bfloat16().to(device)
    alone, alone32 = bi_linear(probe, w), bi_linear(probe, w, out_dtype=torch.float32)
    assert torch.equal(bi_linear(probe, w_t), alone)
    ms = (2, 70, 130, 300)
    assert len({tiling(m, N, K, torch.bfloat16, 8) for m in (1, *ms)}) >= 3, "the rule must vary with M here"
    ladders = {tiling(m, N, K, torch.bfloat16, sms) for m in (1, 20, 100, 200, 300)
               for sms in (1, 100, 10**6)}
    assert ladders == {tiling(m, N, 2048, torch.bfloat16, sms) for m in (1, 20, 100, 200, 300)
                       for sms in (1, 100, 10**6)}, "K picks the same tilings as 2048"
    tiles = (*ladders, Tiling(16, 16, 128, 4, 2), Tiling(64, 128, 64, 4, 3), Tiling(32, 64, 128, 4, 2, True))
    for M, at in ((2, 1), (70, 0), (70, 66), (130, 64), (300, 299)):
        x = torch.randn(M, K, generator=g).bfloat16().to(device)
        x[at] = probe[0]
        assert torch.equal(bi_linear(x, w)[at], alone[0]), (M, at)
        assert torch.equal(bi_linear(x, w, out_dtype=torch.float32)[at], alone32[0]), (M, at)
        for t in tiles:
            assert torch.equal(bi_linear(x, w, tile=t, out_dtype=torch.float32)[at], alone32[0]), (M, at, t)


def test_fused_greedy_head_matches_bi_linear_logits(device, seed):
    """Deterministic mode's greedy tokens come from the fused head (`lm_head_argmax`), sampled ones
    from `bi_linear` logits: a greedy row must get the argmax of those logits on either side of the
    head's batch-size switch (natively the logits are the same bits; the interpreter's differ in
    rounding only)."""
    from swaserve.kernels.lm_head_argmax import SMALL_M, lm_head_argmax

    g = torch.Generator().manual_seed(seed)
    K, V = 256, 1000
    w = (torch.randn(V, K, generator=g) * K**-0.5).bfloat16().to(device)
    probe = torch.randn(1, K, generator=g).bfloat16().to(device)
    alone = lm_head_argmax(probe, w)
    for M, at in ((1, 0), (SMALL_M, 7), (SMALL_M + 9, SMALL_M + 3)):
        x = torch.randn(M, K, generator=g).bfloat16().to(device)
        x[at] = probe[0]
        tokens = lm_head_argmax(x, w)
        assert torch.equal(tokens, bi_linear(x, w, out_dtype=torch.float32).argmax(-1)), M
        assert tokens[at] == alone[0], M


# ---- unified_attention -----------------------------------------------------------------------------

def _attend(pools, reqs, H, Hkv, window, dtype, g, device, softcap=0.0, sinks=None, chunk=None, which=None,
            programs=None, slots=False, launch=None):
    """reqs: (prefix, new) per request (`which`: their indices among the pools' requests, default
    0..); runs the kernel with every K/V already in the pools (`slots`: a decode step of a sliding
    layer reading its window's slots from `window_slots`)."""
    swa = window is not None
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)
    Dk, Dv = k_buf.shape[2], v_buf.shape[2]
    T = sum(n for _, n in reqs)
    q = torch.randn(T, H, Dk, generator=g).to(dtype).to(device)
    out = torch.full((T, H, Dv), float("nan"), dtype=dtype, device=device)  # poison: every row must be written
    qo = torch.tensor([0] + [n for _, n in reqs], device=device).cumsum(0).int()
    seq = torch.tensor([p + n for p, n in reqs], dtype=torch.int32, device=device)
    rows = pools.rows[: len(reqs)] if which is None else pools.rows[torch.tensor(which, device=pools.rows.device)]
    unified_attention(q, out, k_buf, v_buf, pools.req_to_token, rows, seq, qo, 0.125,
                      max_extend_len=max(n for _, n in reqs), window=window,
                      full_to_swa=pools.full_to_swa if swa else None, logit_softcap=softcap, sinks=sinks,
                      chunk=chunk, programs=programs, launch=launch,
                      slots=window_slots(pools.req_to_token, rows, seq, pools.full_to_swa, window) if slots
                      else None)
    return q, out


@pytest.mark.parametrize("H,Hkv,Dk,Dv,dtype,window,softcap,use_sinks", [
    pytest.param(4, 2, 48, 32, torch.float32, 8, 0.0, True, id="gqa2-swa-dk48dv32-sinks"),
    pytest.param(8, 2, 32, 32, torch.bfloat16, 8, 30.0, False, id="gqa4-swa-bf16-softcap"),
    pytest.param(2, 2, 64, 64, torch.float32, None, 0.0, False, id="mha-full"),
    pytest.param(3, 1, 16, 16, torch.float32, 70, 0.0, True, id="gqa3-window-past-a-block"),
])
@pytest.mark.parametrize("chunk", [None, 64, 128])
def test_unified_attention_matches_reference(H, Hkv, Dk, Dv, dtype, window, softcap, use_sinks, chunk, device,
                                             seed):
    """`chunk` 64: keys reduced in chunks of 64 positions, one key block (decode: split over programs
    and merged), contexts of up to 4 chunks; 128: two blocks a chunk; None: the engine's (one chunk
    here). Decode rows run with programs per chunk, per key block and per request, sliding layers
    also reading their window's slots from one table (`window_slots`): the same bits."""
    g = torch.Generator().manual_seed(seed)
    # (prefix, new): decode rows (new = 1) and extend rows, positions W-1, W, W+1, 2W+3 and past 64.
    reqs = [(0, 21), (5, 7), (7, 1), (8, 1), (19, 1), (60, 20), (100, 1), (190, 1), (120, 70)]
    lens = [p + n for p, n in reqs]
    # Sliding layers: positions no query can see are evicted (full_to_swa = 0 -> NaN dummy slot).
    swa_from = [max(0, p - window + 1) for p, _ in reqs] if window else None
    pools = make_pools(lens, Hkv, Dk, Dv, dtype, g, device, swa_from=swa_from)
    sinks = torch.randn(H, generator=g).to(device) if use_sinks else None
    q, out = _attend(pools, reqs, H, Hkv, window, dtype, g, device, softcap, sinks, chunk)
    which = [b for b, (_, n) in enumerate(reqs) if n == 1]  # the decode rows alone: split and merged
    dec = [reqs[b] for b in which]
    q_dec, out_dec = _attend(pools, dec, H, Hkv, window, dtype, torch.Generator().manual_seed(seed + 1),
                             device, softcap, sinks, chunk, which, programs="chunk")
    for programs in ("block", "chunk", "request"):
        for slots in (False, True) if window else (False,):
            _, other = _attend(pools, dec, H, Hkv, window, dtype, torch.Generator().manual_seed(seed + 1),
                               device, softcap, sinks, chunk, which, programs=programs, slots=slots)
            assert torch.equal(other, out_dec), (programs, slots)
    for i, b in enumerate(which):
        p = reqs[b][0]
        pos = torch.arange(p + 1)
        ref = attend_ref(q_dec[i: i + 1], pools.k_true[b].to(device), pools.v_true[b].to(device),
                         window_mask(pos[p:], pos, window).to(device), 0.125, softcap, sinks)
        torch.testing.assert_close(out_dec[i: i + 1].double(), ref, **tolerances(dtype))
    off = 0
    for b, (p, n) in enumerate(reqs):
        pos = torch.arange(p + n)
        vis = window_mask(pos[p:], pos, window).to(device)
        ref = attend_ref(q[off: off + n], pools.k_true[b].to(device), pools.v_true[b].to(device), vis, 0.125,
                         softcap, sinks)
        torch.testing.assert_close(out[off: off + n].double(), ref, **tolerances(dtype))
        off += n


@pytest.mark.parametrize("window", [8, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_extend_tile_height_changes_no_bits(window, dtype, device, seed):
    """Extend tiles of 16, 32 and 64 rows (`extend_tile_rows` picks by the step's tokens) give every query
    the same bits, and a decode row the bits the decode launch gives it."""
    H, Hkv, D = 8, 2, 32
    reqs = [(0, 21), (5, 7), (7, 1), (60, 20), (120, 37)]
    swa_from = [max(0, p - window + 1) for p, _ in reqs] if window else None
    outs = []
    for rows, warps, stages in ((64, 4, 2), (32, 4, 2), (16, 4, 2)):
        g = torch.Generator().manual_seed(seed)
        pools = make_pools([p + n for p, n in reqs], Hkv, D, D, dtype, g, device, swa_from=swa_from)
        outs.append(_attend(pools, reqs, H, Hkv, window, dtype, g, device, launch=(rows, warps, stages))[1])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    g = torch.Generator().manual_seed(seed)
    pools = make_pools([p + n for p, n in reqs], Hkv, D, D, dtype, g, device, swa_from=swa_from)
    q, _ = _attend(pools, reqs, H, Hkv, window, dtype, g, device)  # (the same draw of q as above)
    dec = torch.full((1, H, D), float("nan"), dtype=dtype, device=device)
    unified_attention(q[28:29], dec, *((pools.k_swa, pools.v_swa) if window else (pools.k_full, pools.v_full)),
                      pools.req_to_token, pools.rows[2:3], torch.tensor([8], dtype=torch.int32, device=device),
                      torch.tensor([0, 1], dtype=torch.int32, device=device), 0.125, max_extend_len=1, window=window,
                      full_to_swa=pools.full_to_swa if window else None)
    assert torch.equal(dec[0], outs[0][28])


@pytest.mark.parametrize("window", [8, 100, None])
@pytest.mark.parametrize("dtype,H,Hkv,D", [
    pytest.param(torch.float32, 8, 2, 32, id="fp32-d32"),
    pytest.param(torch.bfloat16, 8, 2, 32, id="bf16-d32"),
    pytest.param(torch.bfloat16, 4, 1, 256, id="bf16-d256-1b"),  # on sm_90: the 5-stage launch
])
def test_unified_extend_flat_loop_gives_the_chunked_bits(window, dtype, H, Hkv, D, device, seed):
    """`flat` (`unified_launch.flat_extend`): an extend program's keys in one loop, each block folded into its
    chunk's state and the chunk into the result at its last block, gives the chunk loop's bits: chunks of one
    and of two key blocks, the engine's (one chunk here), a tile's keys starting mid-chunk (window 100). At
    d256 in bf16 (Gemma 3's heads) also the engine's 32- and 64-row launches (`extend_launch`): on sm_90 the
    one loop's with 5 pipeline stages against the chunk loop's with 3."""
    reqs = [(0, 21), (5, 7), (7, 1), (60, 20), (120, 70), (300, 40)]
    swa_from = [max(0, p - window + 1) for p, _ in reqs] if window else None
    tiles = (None, 32, 64) if D == 256 else (None,)
    for chunk, rows in itertools.product((64, 128, None), tiles):
        outs = []
        for flat in (False, True):
            launch = None if rows is None else (rows, *extend_launch(rows, D, 2, flat)[1:])
            g = torch.Generator().manual_seed(seed)
            pools = make_pools([p + n for p, n in reqs], Hkv, D, D, dtype, g, device, swa_from=swa_from)
            swa = window is not None
            T = sum(n for _, n in reqs)
            q = torch.randn(T, H, D, generator=g).to(dtype).to(device)
            out = torch.full((T, H, D), float("nan"), dtype=dtype, device=device)
            qo = torch.tensor([0] + [n for _, n in reqs], device=device).cumsum(0).int()
            seq = torch.tensor([p + n for p, n in reqs], dtype=torch.int32, device=device)
            unified_attention(q, out, *((pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)),
                              pools.req_to_token, pools.rows[: len(reqs)], seq, qo, 0.125, max_extend_len=70,
                              window=window, full_to_swa=pools.full_to_swa if swa else None, chunk=chunk, flat=flat,
                              launch=launch)
            outs.append(out)
        assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1]), (chunk, launch)


def test_extend_tile_rows_fill_the_sms():
    """The tallest extend tile whose programs fill 7/8 of the SMs (132), never below a GQA group or 16 rows."""
    assert extend_tile_rows(512, 4, 1, 132) == 16  # Gemma-3-1B: 32 / 64 / 128 programs
    assert extend_tile_rows(1024, 4, 1, 132) == 32
    assert extend_tile_rows(2048, 4, 1, 132) == 64
    assert extend_tile_rows(512, 2, 4, 132) == 32  # Gemma-3-4B
    assert extend_tile_rows(1024, 2, 4, 132) == 64
    assert extend_tile_rows(8, 4, 1, 132) == 16
    assert extend_tile_rows(8, 32, 1, 132) == 32  # a tile holds a whole GQA group
    assert extend_tile_rows(8, 64, 1, 132) == 64


def test_flat_extend_where_the_device_holds_it(monkeypatch):
    """The one-loop form is the default where a block may take sm_90's shared memory (its 32- and 64-row
    launches at d256 bf16 take 5 stages); SWASERVE_UNIFIED_FLAT forces either way."""
    assert not flat_extend(torch.device("cpu"))
    monkeypatch.setattr(unified_launch, "UNIFIED_FLAT", True)
    assert flat_extend(torch.device("cpu"))
    assert extend_launch(64, 256, 2, flat=True) == extend_launch(32, 256, 2, flat=True) == (64, 8, 5)
    assert extend_launch(64, 256, 2, flat=False) == extend_launch(32, 256, 2, flat=False) == (64, 8, 3)
    assert extend_launch(64, 256, 4, flat=True) == extend_launch(64, 256, 4, flat=False)  # fp32: no room
    assert extend_launch(16, 256, 2, flat=True) == (64, 4, 2)


def test_unified_extend_from_a_first_row_leaves_the_rows_before_it(device, seed):
    """A mixed step's split: an extend launched from request `first_row` over whole tensors writes the
    rows of the requests from there, with the bits the whole batch's extend gives them, and leaves
    the rows before it (the decode launch's) alone."""
    g = torch.Generator().manual_seed(seed)
    reqs = [(7, 1), (30, 1), (5, 1), (0, 21), (60, 20), (3, 9)]
    pools = make_pools([p + n for p, n in reqs], 2, 32, 32, torch.float32, g, device)
    q, whole = _attend(pools, reqs, 4, 2, None, torch.float32, g, device)
    out = torch.full_like(whole, float("nan"))
    qo = torch.tensor([0] + [n for _, n in reqs], device=device).cumsum(0).int()
    seq = torch.tensor([p + n for p, n in reqs], dtype=torch.int32, device=device)
    unified_attention(q, out, pools.k_full, pools.v_full, pools.req_to_token, pools.rows[: len(reqs)], seq, qo,
                      0.125, max_extend_len=21, first_row=3)
    assert torch.isnan(out[:3]).all()
    assert torch.equal(out[3:], whole[3:])


# The deliberately wrong call at the end reads NaN rows: the interpreter's max warns on all-NaN rows.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_unified_attention_reads_new_tokens_in_swa_space(device, seed):
    """A sliding layer in its own pool: every key, this step's new tokens included, is read through
    full_to_swa (SGLang's first unified kernel read new tokens by full-pool index: out of range or
    another token's K/V). Full and SWA slots differ here, so the wrong space gives a wrong result."""
    g = torch.Generator().manual_seed(seed)
    reqs = [(12, 9), (3, 1)]
    window = 6
    pools = make_pools([p + n for p, n in reqs], 1, 16, 16, torch.float32, g, device,
                       swa_from=[max(0, p - window + 1) for p, _ in reqs])
    assert not torch.equal(pools.full_to_swa[pools.req_to_token[pools.rows[0], :21].long()],
                           pools.req_to_token[pools.rows[0], :21])
    # Pad the SWA pool with NaN rows so that a read by full-pool index stays inside the buffer.
    pad = torch.full((pools.k_full.shape[0],) + pools.k_swa.shape[1:], float("nan"), device=device)
    pools.k_swa, pools.v_swa = torch.cat([pools.k_swa, pad]), torch.cat([pools.v_swa, pad])
    q, out = _attend(pools, reqs, 2, 1, window, torch.float32, g, device)
    off = 0
    for b, (p, n) in enumerate(reqs):
        pos = torch.arange(p + n)
        ref = attend_ref(q[off: off + n], pools.k_true[b].to(device), pools.v_true[b].to(device),
                         window_mask(pos[p:], pos, window).to(device), 0.125)
        torch.testing.assert_close(out[off: off + n].double(), ref, **tolerances(torch.float32))
        off += n
    # The same kernel told the SWA pool is indexed like the full pool (no map): wrong everywhere.
    bad = torch.zeros_like(out)
    unified_attention(q, bad, pools.k_swa, pools.v_swa, pools.req_to_token, pools.rows[:2],
                      torch.tensor([21, 4], dtype=torch.int32, device=device),
                      torch.tensor([0, 9, 10], dtype=torch.int32, device=device), 0.125,
                      max_extend_len=9, window=window, full_to_swa=None)
    assert not torch.allclose(bad, out)


@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("window", [40, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_attention_row_is_invariant_to_chunking_and_batch(dtype, window, chunk, device, seed):
    """One request's 150 queries computed as one extend, as chunks at other boundaries (the earlier
    chunks' K/V cached), as decode rows (keys split over programs by chunk or by key block, then
    merged), and next to other requests: bitwise the same rows. Reduction chunks of 64 keys (one
    key block) and 256 (four)."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, N = 4, 1, 32, 150
    lens = [N, 50, 9]
    pools = make_pools(lens, Hkv, D, D, dtype, g, device, finite_dummy=True)
    q_all = torch.randn(N, H, D, generator=g).to(dtype).to(device)

    def run(reqs_order: list[tuple[int, int, int]], programs: str | None = None) -> dict[int, torch.Tensor]:
        """reqs_order: (request, prefix, new); returns request 0's rows by position (`programs`: a
        decode step's, by key block, chunk or request)."""
        qs, q_other = [], torch.randn(sum(n for _, _, n in reqs_order), H, D, generator=g).to(dtype).to(device)
        off = 0
        for r, p, n in reqs_order:
            qs.append(q_all[p: p + n] if r == 0 else q_other[off: off + n])
            off += n
        qo = torch.tensor([0] + [n for _, _, n in reqs_order], device=device).cumsum(0).int()
        seq = torch.tensor([p + n for _, p, n in reqs_order], dtype=torch.int32, device=device)
        rows = pools.rows[torch.tensor([r for r, _, _ in reqs_order], device=device)]
        q = torch.cat(qs)
        out = torch.empty_like(q)
        unified_attention(q, out, pools.k_full, pools.v_full, pools.req_to_token, rows, seq, qo, 0.125,
                          max_extend_len=max(n for _, _, n in reqs_order), window=window, chunk=chunk,
                          programs=programs)
        res, off = {}, 0
        for r, p, n in reqs_order:
            if r == 0:
                res.update({p + i: out[off + i] for i in range(n)})
            off += n
        return res

    whole = run([(0, 0, N)])
    variants = [
        run([(0, 0, 33), (1, 20, 30)]) | run([(2, 3, 6), (0, 33, N - 33)]),  # two chunks, other traffic
        run([(0, 0, 64)]) | run([(1, 0, 1), (0, 64, N - 64)]),  # a prefill edge on a key-chunk edge
        {**run([(0, 0, 120)]),  # then decode, programs by key block, chunk and request in turn
         **{p: run([(1, 49, 1), (0, p, 1), (2, 8, 1)], programs=PROGRAMS[p % 3])[p] for p in range(120, N)}},
    ]
    for v in variants:
        assert sorted(v) == list(range(N))
        for p in range(N):
            assert torch.equal(v[p], whole[p]), p


@pytest.mark.parametrize("window", [40, None])
def test_unified_decode_padded_rows_read_slot_0_and_leave_live_rows_alone(window, device, seed):
    """DESIGN.md §4 for the split decode path: padded rows of a graph batch (table row 0, seq_len 1)
    read reserved slot 0 and give finite values, and the live rows beside them (contexts of several
    128-key chunks of two key blocks, split over programs by chunk or by key block and merged, or one
    program per request) keep
    the bits they have without padding. With a window also in the SWA pool through the step's window
    slot table (`window_slots`), as the engine's sliding layers read it: a padded row's table holds
    SWA slot 0."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = 4, 1, 32
    lens = [150, 64, 1, 97]
    swa_from = None if window is None else [max(0, n - window) for n in lens]
    pools = make_pools(lens, Hkv, D, D, torch.float32, g, device, finite_dummy=True, swa_from=swa_from)
    q = torch.randn(len(lens) + 2, H, D, generator=g).to(device)

    def decode(rows: torch.Tensor, seq: list[int], q_rows: torch.Tensor, programs: str,
               slots: bool) -> torch.Tensor:
        out = torch.full_like(q_rows, float("nan"))
        qo = torch.arange(len(seq) + 1, dtype=torch.int32, device=device)
        seq_t = torch.tensor(seq, dtype=torch.int32, device=device)
        k, v, swa = pools.k_full, pools.v_full, {}
        if slots:
            k, v = pools.k_swa, pools.v_swa
            swa = dict(full_to_swa=pools.full_to_swa,
                       slots=window_slots(pools.req_to_token, rows, seq_t, pools.full_to_swa, window))
        unified_attention(q_rows, out, k, v, pools.req_to_token, rows, seq_t, qo, 0.125, max_extend_len=1,
                          window=window, chunk=128, programs=programs, **swa)
        return out

    pad_row = torch.zeros(1, dtype=pools.rows.dtype, device=device)
    rows = torch.cat([pools.rows[:2], pad_row, pools.rows[2:4], pad_row])
    for slots in (False, True) if window is not None else (False,):
        live = decode(pools.rows[: len(lens)], lens, q[: len(lens)], "chunk", slots)
        for programs in PROGRAMS:
            padded = decode(rows, [lens[0], lens[1], 1, lens[2], lens[3], 1],
                            torch.cat([q[:2], q[4:5], q[2:4], q[5:6]]), programs, slots)
            assert torch.equal(padded[[0, 1, 3, 4]], live), (programs, slots)
            assert torch.isfinite(padded[[2, 5]]).all(), (programs, slots)


@pytest.mark.parametrize("window", [100, None])
def test_unified_gemma_heads_decode_match_extend(window, device, seed):
    """Gemma 3's head (d256, 4 query heads a kv head, bf16), whose extend programs take their own
    launch (8 warps, 3 stages): a prompt's last queries prefilled in one extend give the bits that
    decode steps give them, with programs per key block, per chunk and per request."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, N, last = 4, 1, 256, 200, 6
    pools = make_pools([N], Hkv, D, D, torch.bfloat16, g, device, finite_dummy=True)
    q = torch.randn(N, H, D, generator=g).bfloat16().to(device)
    out = torch.empty_like(q)
    qo = torch.tensor([0, N], dtype=torch.int32, device=device)
    unified_attention(q, out, pools.k_full, pools.v_full, pools.req_to_token, pools.rows[:1],
                      torch.tensor([N], dtype=torch.int32, device=device), qo, 0.0625, max_extend_len=N,
                      window=window, chunk=128)
    qo1 = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for p in range(N - last, N):
        for programs in PROGRAMS:
            dec = torch.empty_like(q[:1])
            seq = torch.tensor([p + 1], dtype=torch.int32, device=device)
            unified_attention(q[p: p + 1], dec, pools.k_full, pools.v_full, pools.req_to_token,
                              pools.rows[:1], seq, qo1, 0.0625, max_extend_len=1, window=window, chunk=128,
                              programs=programs)
            assert torch.equal(dec[0], out[p]), (p, programs)


@pytest.mark.parametrize("programs", PROGRAMS)
def test_unified_decode_reads_the_window_slot_table(programs, device, seed):
    """A sliding layer's decode step given `window_slots` reads its keys there and nowhere else, with
    programs per key block, chunk or request: the right table gives the bits of the table +
    full_to_swa path, another request's table does not."""
    g = torch.Generator().manual_seed(seed)
    window, reqs = 40, [(130, 1), (97, 1)]
    pools = make_pools([p + n for p, n in reqs], 1, 32, 32, torch.float32, g, device,
                       swa_from=[max(0, p - window + 1) for p, _ in reqs])
    q, plain = _attend(pools, reqs, 4, 1, window, torch.float32, torch.Generator().manual_seed(seed), device,
                       programs=programs)
    _, table = _attend(pools, reqs, 4, 1, window, torch.float32, torch.Generator().manual_seed(seed), device,
                       programs=programs, slots=True)
    assert torch.equal(table, plain)
    seq = torch.tensor([p + n for p, n in reqs], dtype=torch.int32, device=device)
    swapped = window_slots(pools.req_to_token, pools.rows[:2], seq, pools.full_to_swa, window).flip(0)
    swapped = swapped.contiguous()
    wrong = torch.empty_like(plain)
    unified_attention(q, wrong, pools.k_swa, pools.v_swa, pools.req_to_token, pools.rows[:2], seq,
                      torch.arange(3, dtype=torch.int32, device=device), 0.125, max_extend_len=1,
                      window=window, full_to_swa=pools.full_to_swa, slots=swapped, programs=programs)
    assert not torch.allclose(wrong, plain)


def test_decode_programs_follow_the_batch():
    """A decode step's programs from static shapes only (132 SMs): per key block for a few requests
    (unless their partials would be too many), per request once requests fill the SMs 1.25 times, per
    chunk between."""
    assert decode_programs(pairs=1, chunks=16, blocks_per_chunk=4, sms=132) == "block"
    assert decode_programs(pairs=1, chunks=32, blocks_per_chunk=64, sms=132) == "chunk"  # 2048 partials
    assert decode_programs(pairs=64, chunks=16, blocks_per_chunk=4, sms=132) == "chunk"
    assert decode_programs(pairs=164, chunks=16, blocks_per_chunk=4, sms=132) == "chunk"
    assert decode_programs(pairs=165, chunks=3, blocks_per_chunk=4, sms=132) == "request"
    assert decode_programs(pairs=1024, chunks=16, blocks_per_chunk=4, sms=132) == "request"
