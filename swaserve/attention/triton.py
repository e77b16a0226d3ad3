"""TritonAttnBackend: device-built index lists (both index spaces) and the Triton kernels.

Per step it builds at most two CSR key lists with `kernels.build_kv_indices`: full-context lists
for layers in the full pool, and window lists — translated into SWA space when SWA layers live in
their own pool — for sliding layers. No host sync; in graph mode the lists land in fixed buffers
sized for the largest captured batch, so the builders can be recorded into a CUDA graph.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from swaserve.attention.base import AttentionBackend, AttentionSpec
from swaserve.attention.triton_captured import CapturedExtendInputs, CapturedExtendMetadata, captured_attention
from swaserve.attention.triton_metadata import KVList, TritonMetadata
from swaserve.h2d import to_device
from swaserve.kernels import (
    build_kv_indices,
    decode_attention,
    extend_attention,
    kv_indices_capacity,
    num_kv_splits_for,
    split_counter_count,
    store_kv,
    window_slots,
)
from swaserve.kernels.common import num_sms
from swaserve.kernels.unified_attention import unified_attention

if TYPE_CHECKING:
    from swaserve.memory.req_to_token import ReqToTokenPool
    from swaserve.memory.swa import SWAKVPool
    from swaserve.runner.forward_batch import ForwardBatch


class TritonAttnBackend(AttentionBackend):
    """Triton decode/extend attention over pool index lists.

    Invariants: every list an SWA-pool layer reads is in SWA space (window lists translated by
    the builder, new tokens written at `swa_out_cache_loc`); a decode window list holds the last
    min(seq_len, W) positions, an extend prefix window list starts at max(0, prefix_len - W + 1).

    `deterministic`: every step, decode or extend, runs `unified_attention`, which reads all keys
    through the request table (SWA layers via `full_to_swa`; a decode step's sliding layers via one
    `window_slots` table built per step) in position-aligned blocks: no key lists are built, and a
    query's result depends on neither its batch nor its chunking. A mixed step's decode rows run as
    a decode of their own, its prefill chunks as an extend (the same bits either way).
    """

    fused_kv_store = True
    captures_extend = True  # extend steps can be recorded whole (`captured_extend_metadata`)

    def __init__(
        self,
        kv: SWAKVPool,
        req_to_token: ReqToTokenPool,
        full_to_swa: torch.Tensor | None,
        sliding_window: int | None = None,
        deterministic: bool = False,
    ):
        super().__init__(kv, req_to_token, full_to_swa)
        self.window = sliding_window
        self.deterministic = deterministic
        self.device = req_to_token.req_to_token.device
        # [max_reqs+2] int32, device: decode's qo_indptr (query b is token b) for the unified kernel.
        self._arange = torch.arange(req_to_token.max_reqs + 2, dtype=torch.int32, device=self.device)
        self._has_full = any(not kv.uses_swa_space(lid) for lid in kv.layer_ids)
        self._graph: dict[str, KVList] | None = None
        self._num_sms = num_sms(self.device)
        self._kv_heads = min(p.num_kv_heads for p in kv.pools())
        self._splits: dict[tuple[int, bool, int, int], int] = {}
        # Opt-in (SWASERVE_FUSED_SPLIT_COMBINE=1, not yet measured on a GPU): decode splits combined
        # by their last program instead of a stage-2 launch. The counters return to 0 after every
        # launch, so one zeroed buffer serves all layers, eager steps and graph replays.
        self._split_counters = None
        if os.environ.get("SWASERVE_FUSED_SPLIT_COMBINE") == "1":
            # Room for 16 (kv head x head block) programs per request; wider layers use stage 2.
            self._split_counters = torch.zeros((req_to_token.max_reqs + 1) * 16, dtype=torch.int32,
                                               device=self.device)

    # ---- metadata ------------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._build(batch, static=None)

    def init_graph_state(self, max_bs: int) -> None:
        """Allocate fixed list buffers for graphs of up to `max_bs` requests (decode and verify
        graphs share them; a smaller request keeps the larger buffers)."""
        if self._graph is not None and self._graph["full"].start.numel() >= max_bs:
            return
        ctx = self.req_to_token.max_context
        self._graph = {"full": self._alloc(max_bs, kv_indices_capacity(max_bs, ctx))}
        if self.window is not None:
            self._graph["window"] = self._alloc(max_bs, kv_indices_capacity(max_bs, ctx, self.window))

    def init_forward_metadata_graph(self, batch: ForwardBatch) -> None:
        """Like `init_forward_metadata`, into the graph buffers, reading only device tensors (so it
        can be captured and replays against whatever the static inputs hold)."""
        assert self._graph is not None and batch.is_decode, "call init_graph_state first; decode only"
        self._build(batch, static=self._graph)

    def _alloc(self, bs: int, capacity: int) -> KVList:
        dev = self.device
        return KVList(
            torch.zeros(bs + 1, dtype=torch.int32, device=dev),
            torch.zeros(max(capacity, 1), dtype=torch.int32, device=dev),
            torch.zeros(bs, dtype=torch.int32, device=dev),
        )

    def init_forward_metadata_strided(self, batch: ForwardBatch, q_len: int, prefix_lens: torch.Tensor,
                                      qo_indptr: torch.Tensor) -> None:
        """Extend metadata for `q_len` query slots per request (a padded verify step), into the graph
        buffers from device tensors only, so it can be captured: `prefix_lens` `[bs]` int32 (keys
        before each request's first slot), `qo_indptr` `[bs+1]` int32 (`b * q_len`)."""
        assert self._graph is not None and not batch.is_decode and not self.deterministic
        meta = TritonMetadata(None, None, self._swa_locs(batch), qo_indptr, prefix_lens, q_len)
        self._lists(batch, meta, self._graph, prefix_lens, prefix_lens, 0, 0)

    def captured_extend_metadata(self, batch: ForwardBatch, inputs: CapturedExtendInputs) -> None:
        """A captured extend step's metadata onto `batch` (its N tokens from static buffers, its requests
        in `inputs`), from device tensors only: recorded with the step (attention/triton_captured.py)."""
        batch.attn_metadata = CapturedExtendMetadata(inputs, batch.num_tokens, self._swa_locs(batch))

    def _swa_locs(self, batch: ForwardBatch) -> torch.Tensor | None:
        if batch.swa_out_cache_loc is None and self.full_to_swa is not None:
            return self.full_to_swa[batch.out_cache_loc]  # int32: once per forward
        return batch.swa_out_cache_loc

    def _build(self, batch: ForwardBatch, static: dict[str, KVList] | None) -> None:
        bs = batch.batch_size
        meta = TritonMetadata(None, None, self._swa_locs(batch))
        if self.deterministic:
            self._build_unified(batch, meta)
            return
        if batch.is_decode:
            kv_lens, first_q = batch.seq_lens, None
            full_cap = sum(batch.seq_lens_cpu) if static is None else 0
        else:
            assert batch.extend_prefix_lens_cpu is not None and batch.extend_seq_lens_cpu is not None
            prefix = torch.tensor(batch.extend_prefix_lens_cpu, dtype=torch.int32)
            ext = torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int32)
            qo = torch.zeros(bs + 1, dtype=torch.int32)
            qo[1:] = ext.cumsum(0)
            meta.qo_indptr = to_device(qo, self.device)
            meta.prefix_lens = to_device(prefix, self.device)
            meta.max_extend_len = max(batch.extend_seq_lens_cpu)
            kv_lens = first_q = meta.prefix_lens  # the earliest query of request b is at prefix_len_b
            full_cap = sum(batch.extend_prefix_lens_cpu)
        self._lists(batch, meta, static, kv_lens, first_q, full_cap, bs * (self.window or 0))

    def _lists(self, batch: ForwardBatch, meta: TritonMetadata, static: dict[str, KVList] | None,
               kv_lens: torch.Tensor, first_q: torch.Tensor | None, full_cap: int, win_cap: int) -> None:
        """The full-context and window key lists into `meta` (fresh buffers of the given capacities,
        or the graph buffers `static`), then `meta` onto the batch."""
        bs = batch.batch_size
        table = self.req_to_token.req_to_token

        def lists(name: str, cap: int, window: int | None, table_map: torch.Tensor | None) -> KVList:
            kl = static[name] if static is not None else self._alloc(bs, cap)
            indptr = kl.indptr[: bs + 1]
            start = kl.start[:bs]
            build_kv_indices(table, batch.req_pool_indices, kv_lens, indptr, kl.indices, window=window,
                             full_to_swa=table_map, first_query_pos=first_q, kv_start=start)
            return KVList(indptr, kl.indices, start)

        if self._has_full:
            meta.full = lists("full", full_cap, None, None)
        if self.window is not None:
            meta.window = lists("window", win_cap, self.window, self.full_to_swa)
        batch.attn_metadata = meta

    def _build_unified(self, batch: ForwardBatch, meta: TritonMetadata) -> None:
        """The unified kernel reads the table itself: it needs where each request's queries are, and
        for decode rows the sliding layers' window slots (one table for all of them). A decode step
        is all decode rows. A mixed step's leading one-token rows (its decodes), where they alone
        fill the SMs, run as a decode of their own: a decode program streams a request's keys on a
        16-row tile, where an extend tile carries 64 rows for the one token (H100, Gemma-3-4B, 239
        rows: 854 us a layer). Fewer stay in the extend: two more launches a layer would cost the host
        more than they save the GPU."""
        bs = batch.batch_size
        lens = batch.extend_seq_lens_cpu
        if batch.is_decode:
            nd = bs
        else:
            assert lens is not None
            nd = next((i for i, n in enumerate(lens) if n != 1), bs)
            if nd < bs and nd * self._kv_heads < self._num_sms:
                nd = 0
        meta.num_decode = nd
        if nd and self.window is not None and self.full_to_swa is not None:
            # Sliding layers read their window here, not through the table then `full_to_swa`.
            meta.slots = window_slots(self.req_to_token.req_to_token, batch.req_pool_indices[:nd],
                                      batch.seq_lens[:nd], self.full_to_swa, self.window)
        if nd < bs:
            qo = torch.zeros(bs + 1, dtype=torch.int32)
            qo[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
            meta.qo_indptr = to_device(qo, self.device)
            meta.max_extend_len = max(lens[nd:])
        batch.attn_metadata = meta

    # ---- attention -----------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: read back from the pool
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, v_head_dim]
        spec: AttentionSpec,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        meta: TritonMetadata = batch.attn_metadata
        lid = spec.layer_id
        in_swa = self.kv.uses_swa_space(lid)
        k_buf, v_buf, locs = self.kv_target(spec, batch)
        scales = self.kv.kv_scales(lid)  # FP8 pools: ([1], [1]) float32; every kernel below takes them
        sk = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
        if not kv_stored:
            store_kv(k_buf, v_buf, locs, k, v, **sk)
        if isinstance(meta, CapturedExtendMetadata):
            return captured_attention(meta, self.req_to_token, q, k_buf, v_buf, spec,
                                      self.full_to_swa if in_swa else None, sinks, sk)
        if self.deterministic:
            return self._unified(q, k_buf, v_buf, spec, batch, in_swa, sinks, sk)
        if (k is None or v is None or scales is not None) and not batch.is_decode:
            # The extend kernel reads new tokens' K/V from tensors: gather them back from the pool
            # (KV-shared layers, layers whose stored V is not a slice of their projection, and FP8
            # pools, whose new keys are then read as quantised as every later step reads them).
            rows = locs.long()
            k, v = _rows(k_buf, rows), _rows(v_buf, rows)
        windowed = spec.sliding_window is not None
        kl = meta.window if windowed else meta.full
        assert kl is not None, f"no key list for layer {lid}"
        assert not in_swa or windowed, f"full-attention layer {lid} cannot read the SWA pool"
        out = q.new_empty(q.shape[0], spec.num_heads, spec.v_head_dim)
        softcap = spec.logit_softcap or 0.0
        if batch.is_decode:
            splits = self._num_splits(batch.batch_size, spec, windowed)
            counters = self._split_counters
            need = split_counter_count(batch.batch_size, spec.num_heads, spec.num_kv_heads)
            if counters is not None and need > counters.numel():
                counters = None
            decode_attention(q, k_buf, v_buf, kl.indptr, kl.indices, out, spec.scaling,
                             logit_softcap=softcap, sinks=sinks, num_kv_splits=splits, split_counters=counters, **sk)
        else:
            extend_attention(q, k, v, out, k_buf, v_buf, meta.qo_indptr, kl.indptr, kl.indices, meta.prefix_lens,
                             spec.scaling, max_extend_len=meta.max_extend_len, window=spec.sliding_window,
                             logit_softcap=softcap, sinks=sinks, prefix_start=kl.start, **sk)
        return out

    def _unified(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, spec: AttentionSpec,
                 batch: ForwardBatch, in_swa: bool, sinks: torch.Tensor | None,
                 scales: dict[str, torch.Tensor]) -> torch.Tensor:
        """Deterministic mode: the decode rows (`num_decode`, first) as a decode, the rest as an extend."""
        meta: TritonMetadata = batch.attn_metadata
        nd, bs = meta.num_decode, batch.batch_size
        out = q.new_empty(q.shape[0], spec.num_heads, spec.v_head_dim)
        kw = dict(window=spec.sliding_window, full_to_swa=self.full_to_swa if in_swa else None,
                  logit_softcap=spec.logit_softcap or 0.0, sinks=sinks, **scales)
        table, rows, seq = self.req_to_token.req_to_token, batch.req_pool_indices, batch.seq_lens
        if nd:
            slots = meta.slots if in_swa and spec.sliding_window == self.window else None
            unified_attention(q[:nd], out[:nd], k_buf, v_buf, table, rows[:nd], seq[:nd],
                              self._arange[: nd + 1], spec.scaling, max_extend_len=1, slots=slots, **kw)
        if nd < bs:  # whole tensors from row nd: a slice's alignment would be a new compile
            unified_attention(q, out, k_buf, v_buf, table, rows, seq, meta.qo_indptr, spec.scaling,
                              max_extend_len=meta.max_extend_len, first_row=nd, **kw)
        return out

    def _num_splits(self, bs: int, spec: AttentionSpec, windowed: bool) -> int:
        # Depends only on static shapes, so the value a graph was captured with stays valid.
        key = (bs, windowed, spec.num_heads, spec.num_kv_heads)
        if key not in self._splits:
            max_len = self.window if windowed and self.window else self.req_to_token.max_context
            self._splits[key] = num_kv_splits_for(bs, spec.num_heads, spec.num_kv_heads, max_len, self._num_sms)
        return self._splits[key]


def _rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`buf[rows]`; FP8 buffers through a uint8 view (not every device indexes float8 tensors)."""
    if buf.element_size() == 1 and buf.dtype != torch.uint8:
        return buf.view(torch.uint8)[rows].view(buf.dtype)
    return buf[rows]
