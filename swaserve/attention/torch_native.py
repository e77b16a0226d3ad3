"""TorchNativeAttnBackend: the reference attention. Plain gathers from the KV pools and dense masked
attention in float32; every faster backend is tested against it (DESIGN.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swaserve.attention.base import AttentionBackend, AttentionSpec

if TYPE_CHECKING:
    from swaserve.memory.req_to_token import ReqToTokenPool
    from swaserve.memory.swa import SWAKVPool
    from swaserve.runner.forward_batch import ForwardBatch


@dataclass
class KeyIndex:
    """The keys every query of a step may read, for one window (or full context), in both spaces.

    Decode: one padded row per request, `[bs, L]`. Extend: `[total_keys]` for all requests back to
    back, with `lens` giving each request's share. Key positions of request i are `pos`; entries
    with `valid == False` are padding, point at slot 0 and are masked out.
    """

    full: torch.Tensor  # [bs, L] (decode) or [total_keys] (extend) int64, device: full-pool slots
    swa: torch.Tensor | None  # same shape, int64, device: SWA-pool slots; None without an SWA pool
    pos: torch.Tensor  # same shape, int64, device: key positions
    valid: torch.Tensor  # same shape, bool, device
    lens: list[int] | None = None  # [bs] extend only: keys per request


@dataclass
class TorchNativeMetadata:
    """Index lists of one forward step. `keys[None]` is full context; `keys[W]` the window of W keys."""

    keys: dict[int | None, KeyIndex]
    swa_out_cache_loc: torch.Tensor | None  # [num_tokens] int32, device: out_cache_loc in SWA space
    q_pos: list[torch.Tensor] = field(default_factory=list)  # extend: [extend_len_i] int64 per request


class TorchNativeAttnBackend(AttentionBackend):
    """Dense masked attention over K/V gathered from the pools; simple enough to be obviously right.

    Invariants: a query at position p reads exactly the keys at positions p-W+1 .. p (W = the layer's
    window; 0 .. p for full layers), through `req_to_token` and, for layers in the SWA pool, through
    `full_to_swa`. Positions before the window are never gathered (their SWA slots may be freed), and
    every gathered slot of a live request is checked to be mapped (non-zero).
    """

    def __init__(
        self,
        kv: SWAKVPool,
        req_to_token: ReqToTokenPool,
        full_to_swa: torch.Tensor | None,
        sliding_window: int | None = None,
    ):
        super().__init__(kv, req_to_token, full_to_swa)
        self.sliding_window = sliding_window  # built eagerly each step; other windows on first use

    # ---- metadata -------------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        swa_loc = batch.swa_out_cache_loc  # a graph runner's static buffer, translated per replay
        if swa_loc is None and self.full_to_swa is not None:
            swa_loc = self.full_to_swa[batch.out_cache_loc].to(torch.int32)
        if swa_loc is not None:
            # A live row writing to the reserved slot 0 stores nothing: a read-only query (the
            # frozen-KV drafter's, whose layers all read another model's K/V).
            live = self._live_tokens(batch) & (batch.out_cache_loc != 0)
            assert not bool(((swa_loc <= 0) & live).any()), "a new token's full slot has no SWA slot"
        meta = TorchNativeMetadata(keys={}, swa_out_cache_loc=swa_loc)
        if not batch.is_decode:
            assert batch.extend_prefix_lens_cpu is not None and batch.extend_seq_lens_cpu is not None
            dev = batch.input_ids.device
            meta.q_pos = [
                torch.arange(p, p + n, device=dev)
                for p, n in zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)
            ]
        batch.attn_metadata = meta
        self._keys(batch, None)
        if self.sliding_window is not None:
            self._keys(batch, self.sliding_window)

    def _keys(self, batch: ForwardBatch, window: int | None) -> KeyIndex:
        meta: TorchNativeMetadata = batch.attn_metadata
        if window not in meta.keys:
            build = self._decode_keys if batch.is_decode else self._extend_keys
            meta.keys[window] = build(batch, window)
        return meta.keys[window]

    def _decode_keys(self, batch: ForwardBatch, window: int | None) -> KeyIndex:
        # The query is at seq_len - 1; its keys are the last min(seq_len, W) positions.
        seq = batch.seq_lens.long()  # [bs]
        max_len = max(batch.seq_lens_cpu)
        width = max_len if window is None else min(window, max_len)
        start = torch.zeros_like(seq) if window is None else (seq - window).clamp(min=0)
        pos = start[:, None] + torch.arange(width, device=seq.device)[None, :]  # [bs, width]
        valid = pos < seq[:, None]
        pos = torch.where(valid, pos, 0)
        rows = batch.req_pool_indices[:, None].expand_as(pos)
        return self._index(rows, pos, valid, None, window)

    def _extend_keys(self, batch: ForwardBatch, window: int | None) -> KeyIndex:
        # The earliest query of request i is at prefix_len_i, so it needs keys from
        # max(0, prefix_len_i - W + 1); the window mask trims this per query later.
        assert batch.extend_prefix_lens_cpu is not None
        dev = batch.input_ids.device
        starts = [0 if window is None else max(0, p - window + 1) for p in batch.extend_prefix_lens_cpu]
        lens = [s - b for s, b in zip(batch.seq_lens_cpu, starts)]
        pos = torch.cat([torch.arange(b, s, device=dev) for b, s in zip(starts, batch.seq_lens_cpu)])
        rows = torch.repeat_interleave(batch.req_pool_indices, torch.tensor(lens, device=dev))
        return self._index(rows, pos, torch.ones_like(pos, dtype=torch.bool), lens, window)

    def _index(
        self,
        rows: torch.Tensor,  # same shape as pos, int64: req_to_token rows
        pos: torch.Tensor,  # key positions
        valid: torch.Tensor,  # bool
        lens: list[int] | None,
        window: int | None,
    ) -> KeyIndex:
        full = self.req_to_token.req_to_token[rows, pos].long()
        full = torch.where(valid, full, 0)
        live = valid & (rows != 0)  # row 0 is the padding row: it legitimately reads slot 0
        assert not bool(((full <= 0) & live).any()), "req_to_token has an unwritten slot inside a request"
        swa = None
        if window is not None and self.full_to_swa is not None:
            # Only window lists are translated: older positions may have lost their SWA slot.
            swa = self.full_to_swa[full].long()
            swa = torch.where(valid, swa, 0)
            assert not bool(((swa <= 0) & live).any()), "a position inside the window has no SWA slot"
        return KeyIndex(full=full, swa=swa, pos=pos, valid=valid, lens=lens)

    @staticmethod
    def _live_tokens(batch: ForwardBatch) -> torch.Tensor:
        if batch.is_decode:
            return batch.req_pool_indices != 0
        assert batch.extend_seq_lens_cpu is not None
        n = torch.tensor(batch.extend_seq_lens_cpu, device=batch.req_pool_indices.device)
        return torch.repeat_interleave(batch.req_pool_indices != 0, n)

    # ---- attention ------------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None when kv_stored
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, v_head_dim]
        spec: AttentionSpec,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,  # [num_heads] float
        kv_stored: bool = False,  # this step's K/V are in the pool already (a KV-shared layer's source wrote them)
    ) -> torch.Tensor:
        meta: TorchNativeMetadata = batch.attn_metadata
        lid = spec.layer_id
        in_swa = self.kv.uses_swa_space(lid)
        if not kv_stored:
            _, _, locs = self.kv_target(spec, batch)
            self.kv.set_kv(lid, locs, k, v)

        keys = self._keys(batch, spec.sliding_window)
        slots = keys.swa if in_swa else keys.full
        assert slots is not None
        # `read_k`/`read_v`: rows as stored, or dequantised to float32 from an FP8 pool (the math is float32).
        kv = self.kv
        if batch.is_decode:
            mask = keys.valid[:, None, :]  # [bs, 1, L]: the window is already in the index list
            out = _attend(q[:, None], kv.read_k(lid, slots), kv.read_v(lid, slots), mask, keys.valid, spec, sinks)
            return out[:, 0].to(q.dtype)

        assert keys.lens is not None
        outs = []
        q_off = 0
        for q_pos, k_slots, k_pos in zip(
            meta.q_pos, slots.split(keys.lens), keys.pos.split(keys.lens)
        ):
            n = q_pos.numel()
            mask = k_pos[None, :] <= q_pos[:, None]  # [n, L] causal
            if spec.sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - spec.sliding_window
            kv_valid = torch.ones_like(k_pos, dtype=torch.bool)[None]
            out = _attend(q[None, q_off : q_off + n], kv.read_k(lid, k_slots)[None],
                          kv.read_v(lid, k_slots)[None],
                          mask[None], kv_valid, spec, sinks)
            outs.append(out[0])
            q_off += n
        return torch.cat(outs).to(q.dtype)


def _attend(
    q: torch.Tensor,  # [B, T, H, D]
    k: torch.Tensor,  # [B, L, Hkv, D]
    v: torch.Tensor,  # [B, L, Hkv, Dv]
    mask: torch.Tensor,  # [B, T, L] bool: query t may read key l
    kv_valid: torch.Tensor,  # [B, L] bool: key l is real (not padding)
    spec: AttentionSpec,
    sinks: torch.Tensor | None,  # [H]
) -> torch.Tensor:
    """Dense attention in float32; returns `[B, T, H, Dv]` float32."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    assert h == spec.num_heads and hkv == spec.num_kv_heads and h % hkv == 0
    g = h // hkv  # query head j reads KV head j // g, as HF's repeat_kv
    # Padding keys point at slot 0, which may hold anything (NaN included); 0 * NaN would leak
    # through the softmax-weighted sum, so zero them instead of relying on the mask alone.
    keep = kv_valid[:, :, None, None]
    kf = torch.where(keep, k.float(), 0.0)
    vf = torch.where(keep, v.float(), 0.0)
    qf = q.float().view(b, t, hkv, g, d)
    logits = torch.einsum("btkgd,blkd->bkgtl", qf, kf) * spec.scaling
    if spec.logit_softcap is not None:
        logits = spec.logit_softcap * torch.tanh(logits / spec.logit_softcap)
    logits = logits.masked_fill(~mask[:, None, None], float("-inf"))
    if sinks is not None:
        # GPT-OSS: one extra logit per head in the softmax denominator that contributes no value.
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, t, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bkgtl,blkv->btkgv", probs, vf)
    return out.reshape(b, t, h, vf.shape[-1])
