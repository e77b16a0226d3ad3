"""Static decode inputs replayed by graph runners, and the padding rules of DESIGN.md §4."""

from __future__ import annotations

import torch

from swaserve.runner.forward_batch import ForwardBatch, ForwardMode

SEQ_LEN_FILL = 1  # padded rows attend one key: the dummy slot 0 their own token writes


class DecodeInputBuffers:
    """Fixed device buffers a captured decode step reads, sized for the largest captured batch.

    Invariant after `populate(batch, bs)`: rows [0, raw_bs) hold the live batch; rows [raw_bs, bs)
    are padding that reads row 0 of `req_to_token` (all zeros), writes K/V only to slot 0 of both
    pools and attends a single key. Nothing from an earlier, larger batch survives in the padded
    rows: every buffer is reset before the live rows are copied.
    """

    def __init__(self, max_bs: int, device: torch.device | str, hybrid: bool):
        dev = torch.device(device)
        self.max_bs = max_bs
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs] int64, device
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs] int64, device
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs] int64, device
        self.seq_lens = torch.full((max_bs,), SEQ_LEN_FILL, dtype=torch.int32, device=dev)  # [max_bs] int32, device
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs] int64, device: full pool
        # SWA write locations are int32, the dtype the translation yields, so no cast is captured.
        self.swa_out_cache_loc = (
            torch.zeros(max_bs, dtype=torch.int32, device=dev) if hybrid else None
        )  # [max_bs] int32, device: SWA pool

    def populate(self, batch: ForwardBatch, bs: int, full_to_swa: torch.Tensor | None) -> None:
        """Copy a live decode batch of raw_bs <= bs rows in, padding rows raw_bs .. bs-1."""
        raw = batch.batch_size
        assert batch.is_decode and raw <= bs <= self.max_bs, (raw, bs, self.max_bs)
        if bs != raw:
            self.seq_lens[raw:bs].fill_(SEQ_LEN_FILL)
            self.out_cache_loc[raw:bs].zero_()
            self.req_pool_indices[raw:bs].zero_()
            self.positions[raw:bs].zero_()
            self.input_ids[raw:bs].zero_()
            if self.swa_out_cache_loc is not None:
                self.swa_out_cache_loc[raw:bs].zero_()
        self.input_ids[:raw].copy_(batch.input_ids, non_blocking=True)
        self.positions[:raw].copy_(batch.positions, non_blocking=True)
        self.req_pool_indices[:raw].copy_(batch.req_pool_indices, non_blocking=True)
        self.seq_lens[:raw].copy_(batch.seq_lens, non_blocking=True)
        self.out_cache_loc[:raw].copy_(batch.out_cache_loc, non_blocking=True)
        if self.swa_out_cache_loc is not None:
            assert full_to_swa is not None
            # Translated from the live locations on every replay: never memoised across steps.
            torch.index_select(full_to_swa, 0, self.out_cache_loc[:raw], out=self.swa_out_cache_loc[:raw])

    def forward_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        """A ForwardBatch viewing the first bs rows (what a captured graph was recorded with)."""
        b = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=seq_lens_cpu,
        )
        b.swa_out_cache_loc = self.swa_out_cache_loc[:bs] if self.swa_out_cache_loc is not None else None
        return b


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, then steps of 16, up to max_bs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    b = 16
    while b <= max_bs:
        sizes.append(b)
        b += 8 if b < 64 else 16
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(raw_bs: int, sizes: list[int]) -> int | None:
    """Smallest captured size >= raw_bs, or None above the largest."""
    return next((b for b in sizes if b >= raw_bs), None)
