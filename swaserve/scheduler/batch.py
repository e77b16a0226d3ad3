"""ScheduleBatch: the scheduler's host-side view of one step, turned into a device ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.runner.forward_batch import ForwardBatch, ForwardInputs, ForwardMode
from swaserve.scheduler.req import Req


@dataclass
class ScheduleBatch:
    """Requests of one step with the new tokens each computes.

    `extend_lens[i]` new tokens of `reqs[i]` start at position `prefix_lens[i]` (its kv_len before
    the step); their full-pool slots are `out_cache_loc` in request order. A mixed step is an
    extend batch whose first `num_decode` rows are decodes (one new token each), then prefill chunks. `sample[i]` says whether
    request i's last new token is its last pending one, i.e. whether its logits give a new token.
    """

    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64, cpu: full-pool slots
    sample: list[bool]
    num_decode: int = 0  # extend batches: the first num_decode rows are decodes (one new token each)
    # Speculative verify steps: the drafted tokens of each of the first len(drafts) rows, computed
    # after the row's input token (its extend length is 1 + len(drafts[i])); None: no verify rows.
    drafts: list[list[int]] | None = None

    @property
    def kind(self) -> str:
        """"decode", "extend" (prefill chunks only), "mixed" (decode rows first, then prefill chunks) or
        "verify" (speculative: drafted rows first, then any prefill chunks)."""
        if self.drafts is not None:
            return "verify"
        return "mixed" if self.num_decode and self.mode is ForwardMode.EXTEND else self.mode.value

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def sample_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.sample) if s]

    def to_forward_batch(self, device: torch.device | str, host_decode_inputs: bool = False) -> ForwardBatch:
        """`host_decode_inputs`: give a decode batch its input ids from the host (each request's
        last known token), for drivers that sample on the host and never fill the runner's table;
        only right when no step is in flight (a mixed batch takes every input the host has from
        the host, whatever this says)."""
        return self.forward_inputs(host_decode_inputs).build(device)

    def forward_inputs(self, host_decode_inputs: bool = False) -> ForwardInputs:
        """The step's inputs as host lists (`to_forward_batch` builds on them)."""
        seq_lens = [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]
        rows: list[int] = [r.row for r in self.reqs]  # type: ignore[misc]
        locs = self.out_cache_loc
        if self.mode is ForwardMode.DECODE and not host_decode_inputs:
            # Inputs are the last sampled tokens, read on the device (the host may not have them yet).
            return ForwardInputs(self.mode.value, None, list(self.prefix_lens), rows, seq_lens, locs)
        input_ids: list[int] = []
        positions: list[int] = []
        # A mixed batch's decode row whose input (the token sampled by the step in flight) the host
        # does not have yet reads it from the runner's last-token table on the device.
        from_table: list[tuple[int, int]] = []
        drafts = self.drafts or []
        for i, (r, p, n) in enumerate(zip(self.reqs, self.prefix_lens, self.extend_lens)):
            if i < len(drafts):
                input_ids.extend(r.ids[p : p + 1] + drafts[i])  # the input, then what the drafter proposed
            elif i < self.num_decode and p >= len(r.ids):
                from_table.append((len(input_ids), r.row))  # type: ignore[arg-type]
                input_ids.append(0)
            else:
                input_ids.extend(r.ids[p : p + n])
            positions.extend(range(p, p + n))
        return ForwardInputs(self.mode.value, input_ids, positions, rows, seq_lens, locs, list(self.prefix_lens),
                             list(self.extend_lens), from_table or None)
