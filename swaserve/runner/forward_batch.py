"""ForwardBatch: the device-side description of one model step, handed down to attention."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from swaserve.h2d import to_device


class BatchAttention(Protocol):
    """What a layer calls on `ForwardBatch.attn_backend` (`attention.base.AttentionBackend` implements
    it). Declared here, below attention: the batch is handed down to the backends, which import it."""

    fused_kv_store: bool

    def kv_target(self, spec: Any, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ...

    def kv_scales(self, spec: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, spec: Any,
                batch: ForwardBatch, sinks: torch.Tensor | None = None, kv_stored: bool = False,
                ) -> torch.Tensor:
        ...


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: new tokens on top of an optional cached prefix, per request
    DECODE = "decode"  # one new token per request


class ForwardInputs(NamedTuple):
    """A step's inputs as host lists: what `ForwardBatch.build` takes, and what rank 0 sends the other
    tensor-parallel ranks (`distributed.channel` encodes it with msgspec, no pickle)."""

    mode: str  # ForwardMode value
    input_ids: list[int] | None
    positions: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    out_cache_loc: Any  # [num_tokens] full-pool slots: an int64 CPU tensor, a list once encoded
    extend_prefix_lens: list[int] | None = None
    extend_seq_lens: list[int] | None = None
    table_inputs: list[tuple[int, int]] | None = None

    def build(self, device: torch.device | str) -> ForwardBatch:
        locs = self.out_cache_loc
        if not isinstance(locs, torch.Tensor):
            locs = torch.tensor(locs, dtype=torch.int64)
        return ForwardBatch.build(ForwardMode(self.mode), self.input_ids, self.positions, self.req_pool_indices,
                                  self.seq_lens, locs, device, self.extend_prefix_lens, self.extend_seq_lens,
                                  self.table_inputs)

    def encodable(self) -> ForwardInputs:
        """A copy whose every field msgspec can encode."""
        if not isinstance(self.out_cache_loc, torch.Tensor):
            return self
        return self._replace(out_cache_loc=self.out_cache_loc.tolist())


@dataclass
class ForwardBatch:
    """One step's inputs. New tokens of request i are laid out contiguously, request after request.

    Positions of request i's new tokens are prefix_len_i .. seq_len_i - 1; their K/V go to the
    full-pool slots `out_cache_loc` (the attention backend translates them for SWA layers). A decode
    batch from the engine carries no input ids: each request's input is its last sampled token,
    which the ModelRunner reads from its device table (the host may not know it yet).
    """

    mode: ForwardMode
    input_ids: torch.Tensor | None  # [num_tokens] int64, device; None (decode): the runner fills it
    positions: torch.Tensor  # [num_tokens] int64, device
    req_pool_indices: torch.Tensor  # [bs] int64, device: rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int32, device: tokens with K/V after this step (prefix + new)
    out_cache_loc: torch.Tensor  # [num_tokens] int64, device: full-pool slots of the new tokens
    seq_lens_cpu: list[int]  # [bs] host copy of seq_lens
    extend_prefix_lens_cpu: list[int] | None = None  # [bs] extend only: cached tokens before the new ones
    extend_seq_lens_cpu: list[int] | None = None  # [bs] extend only: new tokens per request
    # [num_tokens] int32, device: out_cache_loc in SWA space. Set by graph runners from their static
    # buffer so the captured write reads it; None: the backend translates once per forward.
    swa_out_cache_loc: torch.Tensor | None = None
    # [4, bs] int64, device (decode): positions, req_pool_indices, seq_lens, out_cache_loc as rows of
    # one block, so a graph runner copies its inputs in one go. The fields above are views of it.
    decode_inputs: torch.Tensor | None = None
    # [2, k] int64, device (mixed extend batches): (token index, request row) of inputs still in
    # flight, which the ModelRunner copies from its last-token table into input_ids; None: none.
    table_inputs: torch.Tensor | None = None
    attn_backend: BatchAttention | None = None
    attn_metadata: Any = field(default=None, repr=False)  # built by attn_backend.init_forward_metadata
    # Per-forward scratch shared by layers (e.g. rotary cos/sin); dies with the batch, so nothing
    # computed for one step or one capture run is ever reused by another.
    scratch: dict = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.numel()

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    def last_token_indices(self) -> torch.Tensor:
        """Index into the token dimension of each request's last new token: `[bs]` int64, device."""
        if self.is_decode:
            return torch.arange(self.batch_size, device=self.positions.device)
        assert self.extend_seq_lens_cpu is not None
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return to_device(ends, self.positions.device)

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[int] | None,
        positions: list[int],
        req_pool_indices: list[int],
        seq_lens: list[int],
        out_cache_loc: torch.Tensor,
        device: torch.device | str,
        extend_prefix_lens: list[int] | None = None,
        extend_seq_lens: list[int] | None = None,
        table_inputs: list[tuple[int, int]] | None = None,
    ) -> ForwardBatch:
        """Assemble from host lists (the scheduler's view) with one host-to-device copy: every field
        is packed into one int64 buffer and split on the device. `input_ids` may be None only for
        decode (the engine's case); given decode inputs are written to the runner's table first."""
        assert input_ids is not None or mode is ForwardMode.DECODE, "extend steps need their input ids"
        dev = torch.device(device)
        T, bs = len(positions), len(req_pool_indices)
        # Every segment starts 16-byte aligned (an even number of int64s): Triton specialises a
        # kernel on its pointers' alignment, so a misaligned slice would mean a new compile on
        # the serving path (and no vectorised loads).
        def pad(n: int) -> list[int]:
            return [0] * (n % 2)

        # One list -> tensor conversion for the host lists (per step, at hundreds of requests).
        head = positions + pad(T) + req_pool_indices + pad(bs) + seq_lens + pad(bs)
        host = torch.tensor(head + (input_ids + pad(T) if input_ids is not None else []), dtype=torch.int64)
        locs = out_cache_loc.to(dtype=torch.int64)
        parts = [host[: len(head)], locs, locs.new_zeros(T % 2), host[len(head) :]]
        packed = to_device(torch.cat(parts), dev)
        Tp, bsp = T + T % 2, bs + bs % 2
        pos, rows, lens, locs, ids = (t[:n] for t, n in zip(
            packed.split([Tp, bsp, bsp, Tp, Tp if input_ids is not None else 0]), (T, bs, bs, T, T)))
        return cls(
            mode=mode,
            input_ids=ids if input_ids is not None else None,
            positions=pos,
            req_pool_indices=rows,
            seq_lens=lens.to(torch.int32),
            out_cache_loc=locs,
            seq_lens_cpu=list(seq_lens),
            extend_prefix_lens_cpu=extend_prefix_lens,
            extend_seq_lens_cpu=extend_seq_lens,
            decode_inputs=packed[: 4 * bsp].view(4, bsp)[:, :bs] if mode is ForwardMode.DECODE else None,
            table_inputs=to_device(torch.tensor(table_inputs, dtype=torch.int64).T.contiguous(), dev)
            if table_inputs else None,
        )
