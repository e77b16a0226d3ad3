"""Padding rules of the static decode buffers (DESIGN.md §4): padded rows never keep values from an
earlier, larger batch; input ids and SWA write locations are re-derived from the live buffers."""

from __future__ import annotations

import torch

from swaserve.runner.forward_batch import ForwardBatch, ForwardMode
from swaserve.runner.graph_buffers import DecodeInputBuffers, capture_batch_sizes, padded_batch_size


def decode_batch(rows: list[int], lens: list[int], locs: list[int]) -> ForwardBatch:
    return ForwardBatch.build(ForwardMode.DECODE, None, [n - 1 for n in lens], rows, lens, torch.tensor(locs), "cpu")


def test_shrinking_batch_resets_every_padded_row():
    table = torch.arange(100, dtype=torch.int32) % 37  # a full->swa table, [0] == 0
    last_tokens = torch.arange(100, 120)  # [0] would be 0 in the runner; poisoned here to 100
    last_tokens[0] = 0
    buf = DecodeInputBuffers(8, "cpu", hybrid=True)
    buf.populate(decode_batch([1, 2, 3, 4, 5, 6, 7, 8], [9] * 8, [11, 12, 13, 14, 15, 16, 17, 18]), 8)
    buf.derive(8, last_tokens, table)
    buf.populate(decode_batch([5, 2, 9], [4, 5, 6], [40, 41, 42]), 8)  # stale-row scenario
    buf.derive(8, last_tokens, table)
    assert buf.req_pool_indices.tolist() == [5, 2, 9, 0, 0, 0, 0, 0]
    assert buf.seq_lens.tolist() == [4, 5, 6, 1, 1, 1, 1, 1]
    assert buf.out_cache_loc.tolist() == [40, 41, 42, 0, 0, 0, 0, 0]
    assert buf.swa_out_cache_loc.tolist() == [table[40], table[41], table[42], 0, 0, 0, 0, 0]
    assert buf.swa_out_cache_loc.dtype == torch.int32
    assert buf.positions.tolist() == [3, 4, 5, 0, 0, 0, 0, 0]
    assert buf.input_ids.tolist() == [105, 102, 109, 0, 0, 0, 0, 0], "inputs are the rows' last tokens"


def test_translation_follows_mapping_changes():
    table = torch.zeros(10, dtype=torch.int32)
    table[3] = 5
    buf = DecodeInputBuffers(2, "cpu", hybrid=True)
    last_tokens = torch.zeros(4, dtype=torch.int64)
    buf.populate(decode_batch([1], [2], [3]), 1)
    buf.derive(1, last_tokens, table)
    assert buf.swa_out_cache_loc[0] == 5
    table[3] = 7  # the allocator re-paired slot 3: the next replay must see it
    last_tokens[1] = 42  # and the row's newest token is its next input
    buf.populate(decode_batch([1], [2], [3]), 1)
    buf.derive(1, last_tokens, table)
    assert buf.swa_out_cache_loc[0] == 7 and buf.input_ids[0] == 42


def test_capture_sizes_and_padding():
    sizes = capture_batch_sizes(64)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 64 and sizes == sorted(set(sizes))
    assert padded_batch_size(3, sizes) == 4 and padded_batch_size(9, sizes) == 16
    assert padded_batch_size(65, sizes) is None
