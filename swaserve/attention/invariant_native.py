"""InvariantNativeAttnBackend: the torch-native backend of deterministic mode. Same masks and float32
math as the reference, reduced in fixed-shape tiles so a query's result depends on neither its batch
nor its chunking (the CPU counterpart of `kernels.unified_attention`).

Why tiles: a CPU GEMM's reduction order changes with its shape (measured: gemv at one row, other
kernels at 2-15 and 16+ rows), so the reference's per-request einsum gives a token different bits
alone and batched. Here every product is a `[ROWS, D] x [D, KEYS]` or `[ROWS, KEYS] x [KEYS, Dv]`
bmm item, keys sit in blocks aligned to absolute positions, and block sums are added in block order;
blocks a query cannot see add exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swaserve.attention.torch_native import TorchNativeAttnBackend, TorchNativeMetadata

if TYPE_CHECKING:
    from swaserve.attention.base import AttentionSpec
    from swaserve.runner.forward_batch import ForwardBatch

ROWS = 32  # (token, query head) rows per tile
KEYS = 64  # keys per block, aligned to multiples of KEYS in position


@dataclass
class Tiles:
    """Every query row of a step in tiles of ROWS rows (one request per tile), each tile with the
    position-aligned key blocks its rows may see; `nb` blocks per tile (short tiles padded)."""

    tok: torch.Tensor  # [nt, ROWS] int64: token index of the row (0 where invalid)
    g: torch.Tensor  # [nt, ROWS] int64: query head within the kv head's group
    valid: torch.Tensor  # [nt, ROWS] bool
    q_pos: torch.Tensor  # [nt, ROWS] int64
    k_pos: torch.Tensor  # [nt, nb * KEYS] int64
    k_valid: torch.Tensor  # [nt, nb * KEYS] bool: keys some row of the tile sees (others are not read)
    full: torch.Tensor  # [nt, nb * KEYS] int64: full-pool slots (0 where invalid)
    swa: torch.Tensor | None  # same, SWA-pool slots; None without an SWA pool or for full context
    nb: int


class InvariantNativeAttnBackend(TorchNativeAttnBackend):
    """Reads K/V through the same tables as the reference (window positions through `full_to_swa`);
    tiles are built once per step, window and GQA group, from the host's lengths."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        swa_loc = batch.swa_out_cache_loc
        if swa_loc is None and self.full_to_swa is not None:
            swa_loc = self.full_to_swa[batch.out_cache_loc].to(torch.int32)
        if swa_loc is not None:
            assert not bool(((swa_loc <= 0) & self._live_tokens(batch)).any()), "a new token's full slot has no SWA slot"
        batch.attn_metadata = TorchNativeMetadata(keys={}, swa_out_cache_loc=swa_loc)

    def _tiles(self, batch: ForwardBatch, window: int | None, group: int) -> Tiles:
        cache = batch.scratch.setdefault("invariant_tiles", {})
        if (window, group) not in cache:
            cache[window, group] = self._build_tiles(batch, window, group)
        return cache[window, group]

    def _build_tiles(self, batch: ForwardBatch, window: int | None, group: int) -> Tiles:
        dev = batch.positions.device
        seqs = batch.seq_lens_cpu
        news = [1] * len(seqs) if batch.is_decode else list(batch.extend_seq_lens_cpu or [])
        r = torch.arange(ROWS)
        tok, gs, valid, qpos, starts, los, his, rows = [], [], [], [], [], [], [], []
        q_lo = 0
        for b, (seq, n) in enumerate(zip(seqs, news)):
            for j in range((n * group + ROWS - 1) // ROWS):
                f = j * ROWS + r
                t = f // group
                ok = t < n
                first, last = seq - n + t[0].item(), seq - n + min(n - 1, t[-1].item())
                lo = 0 if window is None else max(first - window + 1, 0)
                tok.append(torch.where(ok, q_lo + t, 0))
                gs.append(f % group)
                valid.append(ok)
                qpos.append(seq - n + t)
                starts.append(lo // KEYS * KEYS)
                los.append(lo)
                his.append(last)
                rows.append(b)
            q_lo += n
        nb = max((h - s) // KEYS + 1 for s, h in zip(starts, his))
        k_pos = torch.tensor(starts)[:, None] + torch.arange(nb * KEYS)[None, :]
        k_valid = (k_pos >= torch.tensor(los)[:, None]) & (k_pos <= torch.tensor(his)[:, None])
        k_pos, k_valid = k_pos.to(dev), k_valid.to(dev)
        table_rows = batch.req_pool_indices[torch.tensor(rows, device=dev)]
        ctx = self.req_to_token.req_to_token.shape[1]
        full = self.req_to_token.req_to_token[table_rows[:, None], k_pos.clamp(max=ctx - 1)].long()
        full = torch.where(k_valid, full, 0)
        swa = None
        if window is not None and self.full_to_swa is not None:
            swa = torch.where(k_valid, self.full_to_swa[full].long(), 0)
        stack = lambda xs: torch.stack(xs).to(dev)  # noqa: E731
        return Tiles(stack(tok), stack(gs), stack(valid), stack(qpos), k_pos, k_valid, full, swa, nb)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        spec: AttentionSpec,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,  # [num_heads] float
        kv_stored: bool = False,
    ) -> torch.Tensor:
        lid = spec.layer_id
        in_swa = self.kv.uses_swa_space(lid)
        if not kv_stored:
            _, _, locs = self.kv_target(spec, batch)
            self.kv.set_kv(lid, locs, k, v)
        hkv = spec.num_kv_heads
        group = spec.num_heads // hkv
        tiles = self._tiles(batch, spec.sliding_window, group)
        slots = tiles.swa if in_swa else tiles.full
        assert slots is not None
        nt, nb = tiles.tok.shape[0], tiles.nb
        heads = torch.arange(hkv, device=q.device)[:, None, None] * group + tiles.g[None]  # [Hkv, nt, ROWS]
        qf = torch.where(tiles.valid[None, :, :, None], q.float()[tiles.tok[None], heads], 0.0)  # [Hkv, nt, ROWS, D]
        keep = tiles.k_valid[:, :, None, None]
        # Rows as stored, or dequantised from an FP8 pool (elementwise: no batch-dependent order).
        kf = torch.where(keep, self.kv.read_k(lid, slots).float(), 0.0).permute(2, 0, 1, 3)  # [Hkv, nt, L, D]
        vf = torch.where(keep, self.kv.read_v(lid, slots).float(), 0.0).permute(2, 0, 1, 3)
        d, dv = qf.shape[-1], vf.shape[-1]
        qb = qf[:, :, None].expand(hkv, nt, nb, ROWS, d).reshape(-1, ROWS, d)
        s = torch.bmm(qb, kf.reshape(-1, KEYS, d).transpose(1, 2)).view(hkv, nt, nb, ROWS, KEYS) * spec.scaling
        if spec.logit_softcap is not None:
            s = spec.logit_softcap * torch.tanh(s / spec.logit_softcap)
        k_pos = tiles.k_pos.view(nt, nb, 1, KEYS)
        q_pos = tiles.q_pos.view(nt, 1, ROWS, 1)
        vis = tiles.valid.view(nt, 1, ROWS, 1) & tiles.k_valid.view(nt, nb, 1, KEYS) & (k_pos <= q_pos)
        if spec.sliding_window is not None:
            vis &= q_pos - k_pos < spec.sliding_window
        s = s.masked_fill(~vis[None], float("-inf"))
        m = s.amax(dim=-1).amax(dim=2)  # [Hkv, nt, ROWS]: a max, exact in any order
        if sinks is not None:
            sink = sinks.float()[heads]
            m = torch.maximum(m, sink)
        m = torch.where(m == float("-inf"), 0.0, m)
        p = torch.exp(s - m[:, :, None, :, None])
        block_l = p.sum(dim=-1)  # [Hkv, nt, nb, ROWS]
        block_o = torch.bmm(p.reshape(-1, ROWS, KEYS), vf.reshape(-1, KEYS, dv)).view(hkv, nt, nb, ROWS, dv)
        l, acc = block_l[:, :, 0], block_o[:, :, 0]
        for i in range(1, nb):  # block order: a query's unseen blocks add exact zeros
            l = l + block_l[:, :, i]
            acc = acc + block_o[:, :, i]
        if sinks is not None:
            l = l + torch.exp(sink - m)
        rows = torch.where(l[..., None] > 0, acc / torch.where(l > 0, l, 1.0)[..., None], 0.0)
        out = q.new_zeros(q.shape[0], spec.num_heads, dv)
        ok = tiles.valid[None].expand(hkv, nt, ROWS)
        out[tiles.tok[None].expand(hkv, nt, ROWS)[ok], heads[ok]] = rows[ok].to(q.dtype)
        return out
