"""What the Triton backend builds per step for its kernels: CSR key lists in either index space
(`KVList`) and the step's metadata (`TritonMetadata`); a captured extend step's is in
`triton_captured`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVList:
    """One CSR key list per request, oldest key first."""

    indptr: torch.Tensor  # [bs+1] int32, device
    indices: torch.Tensor  # [capacity] int32, device: pool slots (full or SWA space)
    start: torch.Tensor  # [bs] int32, device: position of each request's first listed key


@dataclass
class TritonMetadata:
    full: KVList | None  # full-context lists (decode: 0..seq_len-1; extend: the whole prefix)
    window: KVList | None  # window lists, in SWA space when SWA layers have their own pool
    swa_out_cache_loc: torch.Tensor | None  # [num_tokens] int32, device
    qo_indptr: torch.Tensor | None = None  # [bs+1] int32, device (extend)
    prefix_lens: torch.Tensor | None = None  # [bs] int32, device (extend)
    max_extend_len: int = 0
    # Deterministic mode: the first `num_decode` rows (one token each) run as a decode, their sliding
    # layers reading `slots` ([num_decode, window] int32, device: each row's window); the rest as an extend.
    slots: torch.Tensor | None = None
    num_decode: int = 0
