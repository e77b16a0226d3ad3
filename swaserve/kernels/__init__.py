"""Triton kernels: the only package that imports triton. Pure functions over tensors, no engine imports.

Index spaces (DESIGN.md §3): `req_to_token` holds full-pool slots; SWA layers read lists translated
through `full_to_swa` (int32, 0 = dummy). Slot 0 of every pool is the dummy slot. The window: a query
at position p sees keys p-W+1 .. p (W keys including itself). Every launch is graph-capturable (no
host sync, grids fixed by host ints) unless stated otherwise.

- `store_kv(k_buf, v_buf, locs, k, v, loc_map=None)`: write K/V rows of new tokens at `locs`
  (int32/int64, or `loc_map[locs]`, e.g. full_to_swa); negative slots are skipped; int64 addressing.
- `build_kv_indices(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_indices, window=None,
  full_to_swa=None, first_query_pos=None, kv_start=None)`: per request the slots of positions
  `max(0, first_q - W + 1) .. kv_len - 1` (all of them without a window) as a CSR list, indptr
  included, optionally translated to SWA space. Buffers are sized for the worst case
  (`kv_indices_capacity`); the kernel reads lengths on the device.
- `decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, out, scaling, logit_softcap, sinks,
  num_kv_splits, ...)`: split-K flash decoding, GQA heads of one kv head in one program, soft-cap,
  per-head sinks, Dk != Dv (padded to powers of 2). Window-agnostic: the list is the window.
  0 keys -> output 0; padded rows (one key at slot 0) are finite. `num_kv_splits_for` picks splits.
  With `split_counters` (opt-in, SWASERVE_FUSED_SPLIT_COMBINE=1 in the backend) the last split
  program combines the splits: one launch instead of two.
- `extend_attention(q, k_new, v_new, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
  prefix_lens, scaling, max_extend_len, window, logit_softcap, sinks, prefix_start)`: new tokens
  attend the cached prefix through its list (entry j at position prefix_start + j) and each other
  from k_new/v_new, causal + windowed. Its grid needs `max_extend_len` from the host.
- FP8 KV pools (`torch.float8_e4m3fn`, kv_quant.py): every store and attention kernel above (and
  `qk_norm_rope_store`, `unified_attention`) takes `k_scale=`, `v_scale=` (`[1]` float32 device
  tensors: a layer's static scales) for an e4m3 pool and refuses them for another. Stores write
  `e4m3(clamp(x / scale, +-448))`; reads fold K's scale into the logit scale and V's into the output,
  so an e4m3 tile is only converted to the compute dtype (exact). Extend then takes e4m3 new K/V.
- `add_rms_norm(x, residual, post_weight, next_weight, eps, ...)` (norm.py): `h = residual +
  norm(x)` and `norm(h)` in one launch (a sandwich norm's add plus the next block's input norm).
- `qk_norm_rope_store(qkv, ..., k_buf, v_buf, locs, loc_map=None)` (qk_norm_rope.py): per-head q/k RMSNorm, rotary
  and the K/V store of one attention layer in one launch, in place on the qkv projection; Gemma 4's
  forms: `v_norm` (weightless V norm), `v_from_k` (K = V: qkv holds q|k) and q only (`k_buf=None`,
  KV-shared layers).
- `act_and_mul(gate_up, activation)`: `act(gate) * up` for silu, gelu and gelu_tanh (activation.py).
- `skinny_gemm(x, weight, splits)` / `skinny_gated_gemm(x, weight, activation)` (skinny_gemm.py):
  decode-sized (<= 64 rows) weight-streaming GEMMs; split-K float32 partial sums that `add_rms_norm`
  sums, and gate/up + activation in one launch. Opt-in (`use_skinny`, SWASERVE_SKINNY_GEMM=1).
- `gemv(x, weight, bias=None)` (gemv.py): one row's projection, each program a block of weight rows over
  the whole of K (no split, no reduce launch). The layers take it at one row where the output is at most
  twice the input (`use_gemv`; on by default, SWASERVE_GEMV=0 turns it off).
- `pdl.py`: programmatic dependent launch for the decode step's kernels, opt-in (SWASERVE_PDL=1).
- `lm_head_argmax(x, weight, softcap, inv_temperature=None, seeds=None)` (lm_head_argmax.py): the
  LM head straight to tokens without writing logits: each row's argmax, or a Gumbel-max draw at
  temperature T with noise hashed from the row's seed; `gumbel_noise(seeds, n)` is the same noise
  for a sampler that has the logits.
- `top_p_threshold(logits, top_p)` (top_p.py): each row's nucleus threshold by search in the int
  image of the float32 logits, no sort.
- Deterministic mode (docs/deterministic.md): `bi_linear` (bi_matmul.py, one MMA chain along K for
  every M) and `unified_attention` (unified_attention.py: decode and extend through the request
  table; its reduction order, key blocks folded into chunks, in unified_reduce.py).

Numerics: fp32 accumulation; fp32 inputs use true-fp32 dots (not tf32); bf16 probabilities are
rounded to bf16 for the P.V product. Measured on one H100 (triton 3.6, bf16): decode at 2.9 TB/s
of K/V for bs=64 x 8k keys (Gemma 3 and Gemma 4 d512 shapes), extend 116-246 TFLOP/s at 4k tokens.
"""

from __future__ import annotations

from swaserve.kernels.decode_attention import decode_attention, num_kv_splits_for, split_counter_count
from swaserve.kernels.extend_attention import extend_attention
from swaserve.kernels.index_builders import build_kv_indices, kv_indices_capacity, window_slots
from swaserve.kernels.store_kv import store_kv

__all__ = [
    "build_kv_indices",
    "decode_attention",
    "extend_attention",
    "kv_indices_capacity",
    "num_kv_splits_for",
    "split_counter_count",
    "store_kv",
    "window_slots",
]
