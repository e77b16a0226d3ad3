"""Hybrid KV memory: a full pool and a small SWA pool, one allocator over both, and the
`full_to_swa` translation table.

Index spaces (see docs/memory.md)::

    req_to_token[row, pos] ──► full slot f ──► full pool rows  (full-attention layers)
                                   │
                                   └─ full_to_swa[f] ──► SWA slot s ──► SWA pool rows  (sliding layers)

The scheduler, the request table and `out_cache_loc` only speak full-pool slots. SWA slots exist
only below this interface and in attention metadata. Reserved zeros: slot 0 of both pools is never
handed out, and `full_to_swa[0] == 0` forever, so padded rows and unwritten table entries touch
only the dummy slots. The table has one trailing entry holding -1, so translating -1 gives -1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swaserve.h2d import to_device
from swaserve.memory.allocator import TokenToKVPoolAllocator
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.table_ops import TableOp

if TYPE_CHECKING:
    from swaserve.model_config import ModelConfig


class SWAKVPool:
    """Routes a global layer id to (pool, local layer, index space).

    - Hybrid (`swa_space=True`, the default): full layers live in `full`, SWA layers in `swa`, whose
      rows are SWA slots (reached through `full_to_swa`).
    - `swa=None`: every layer, sliding or not, lives in `full` (one K/V shape) and is read with
      full-pool indices; attention still applies the window.
    - `swa` given with `swa_space=False` (hybrid memory disabled for a model whose SWA layers have
      their own K/V shape, Gemma 4): SWA layers keep their own buffers, sized like the full pool and
      indexed by full slots, so there is one index space and nothing is freed early.
    - `kv_source` maps KV-shared layers (Gemma 4's tail) to the layer whose K/V they read: they share
      that layer's buffers and index space and own no slots.
    """

    def __init__(
        self,
        full: KVPool,
        swa: KVPool | None,
        full_layer_ids: tuple[int, ...],
        swa_layer_ids: tuple[int, ...],
        *,
        swa_space: bool = True,
        kv_source: dict[int, int] | None = None,
    ):
        self.full = full
        self.swa = swa
        self.swa_space = swa is not None and swa_space
        self._map: dict[int, tuple[KVPool, int, bool]] = {}
        if swa is None:
            for local, lid in enumerate(sorted(full_layer_ids + swa_layer_ids)):
                self._map[lid] = (full, local, False)
        else:
            if not swa_space:
                assert swa.size == full.size, "SWA layers indexed by full slots need a full-sized buffer"
            for local, lid in enumerate(full_layer_ids):
                self._map[lid] = (full, local, False)
            for local, lid in enumerate(swa_layer_ids):
                self._map[lid] = (swa, local, self.swa_space)
        assert full.num_layers == sum(1 for p, _, _ in self._map.values() if p is full), "full pool layer count"
        if swa is not None:
            assert swa.num_layers == len(swa_layer_ids), "SWA pool layer count"
        self.kv_source = dict(kv_source or {})  # KV-shared layer -> the layer whose K/V it reads
        for shared, source in self.kv_source.items():
            assert shared not in self._map and source in self._map, f"KV-shared layer {shared} -> {source}"
            self._map[shared] = self._map[source]

    @property
    def layer_ids(self) -> list[int]:
        """Every layer the pools serve, KV-shared layers included."""
        return sorted(self._map)

    def uses_swa_space(self, layer_id: int) -> bool:
        """True if this layer's K/V are indexed by SWA-pool slots (so its indices must be translated)."""
        return self._map[layer_id][2]

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local, _ = self._map[layer_id]
        return pool.k_buffer(local)

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local, _ = self._map[layer_id]
        return pool.v_buffer(local)

    def set_kv(self, layer_id: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`locs` must already be in the layer's own space (SWA slots for SWA layers)."""
        pool, local, _ = self._map[layer_id]
        pool.set_kv(local, locs, k, v)

    def kv_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(k_scale, v_scale)` (`[1]` float32, device) of a layer cached in FP8; None otherwise."""
        pool, local, _ = self._map[layer_id]
        return pool.scales(local)

    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """A layer's static FP8 scales (a KV-shared layer has its source's: set those)."""
        pool, local, _ = self._map[layer_id]
        pool.set_scales(local, k_scale, v_scale)

    def read_k(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """K rows at `slots` (the layer's own space), dequantised to float32 from FP8."""
        pool, local, _ = self._map[layer_id]
        return pool.read(local, slots)

    def read_v(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        pool, local, _ = self._map[layer_id]
        return pool.read(local, slots, value=True)

    def dtype_of(self, layer_id: int) -> torch.dtype:
        return self._map[layer_id][0].dtype

    def pools(self) -> list[KVPool]:
        return [self.full] + ([self.swa] if self.swa is not None else [])

    def total_bytes(self) -> int:
        return sum(p.total_bytes() for p in self.pools())

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        full_tokens: int,
        swa_tokens: int,
        *,
        hybrid: bool,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        swa_dtype: torch.dtype | None = None,
    ) -> SWAKVPool:
        """The pools for `config`: each group gets its own K/V shape; KV-shared layers get none.

        `hybrid`: SWA layers in a pool of `swa_tokens` SWA slots, stored as `swa_dtype` (default
        `dtype`). Otherwise one index space of `full_tokens` slots, every layer stored as `dtype`: one
        pool when both groups have the same K/V shape, else a full-sized buffer per group
        (`swa_tokens` is then ignored)."""
        fg, sg = config.full_group, config.swa_group
        sources = config.kv_sources
        full = KVPool(full_tokens, fg.num_layers, fg.num_kv_heads, fg.k_head_dim, fg.v_head_dim, dtype, device)
        if hybrid and sg.num_layers:
            swa = KVPool(swa_tokens, sg.num_layers, sg.num_kv_heads, sg.k_head_dim, sg.v_head_dim,
                         swa_dtype or dtype, device)
            return cls(full, swa, fg.layer_ids, sg.layer_ids, kv_source=sources)
        if not fg.num_layers or not sg.num_layers or fg.same_shape(sg):
            shape = fg if fg.num_layers else sg
            one = KVPool(full_tokens, fg.num_layers + sg.num_layers, shape.num_kv_heads, shape.k_head_dim,
                         shape.v_head_dim, dtype, device)
            return cls(one, None, fg.layer_ids, sg.layer_ids, kv_source=sources)
        swa = KVPool(full_tokens, sg.num_layers, sg.num_kv_heads, sg.k_head_dim, sg.v_head_dim, dtype, device)
        return cls(full, swa, fg.layer_ids, sg.layer_ids, swa_space=False, kv_source=sources)


class SWATokenToKVPoolAllocator:
    """One allocation = one full slot + one SWA slot, paired through `full_to_swa`.

    Invariants (checked by `check_integrity`): allocation is atomic across both pools; a full slot
    maps to at most one SWA slot and an SWA slot is mapped from exactly one full slot; a full slot
    that is free or whose SWA slot was freed maps to 0; `full_to_swa[0] == 0`, the trailing entry
    is -1. The CPU table is authoritative; `full_to_swa_device` mirrors it for kernels, written at once, or
    with `defer_device` (the runtime's) once before each forward (`sync_device`, the runner's
    `before_forward`): a decode step maps and unmaps slots in ~4 places, each a pinned copy and two device
    launches where one of each does (~0.35 ms of the host's step at 256 rows of the 1B shape on an H200).
    """

    def __init__(self, full_size: int, swa_size: int, device: torch.device | str = "cpu"):
        self.full = TokenToKVPoolAllocator(full_size)
        self.swa = TokenToKVPoolAllocator(swa_size)
        self.device = torch.device(device)
        self.full_to_swa = torch.zeros(full_size + 2, dtype=torch.int64)  # [full_size+2] int64, cpu
        self.full_to_swa[-1] = -1
        self.full_to_swa_device = (
            self.full_to_swa.to(torch.int32)
            if self.device.type == "cpu"
            else self.full_to_swa.to(device=self.device, dtype=torch.int32)
        )  # [full_size+2] int32, device
        self.log: list[list] | None = None  # tensor parallelism: mapping writes, for the other ranks
        self.defer_device = False
        # Full slots (int64, cpu) remapped since the device mirror was written; read at `sync_device`, so a
        # caller must not change a slot tensor it handed to `free_swa` (none does: slot tensors are copies).
        self._dirty: list[torch.Tensor] = []

    @property
    def size(self) -> int:
        return min(self.full.size, self.swa.size)

    def available(self) -> int:
        return min(self.full.available(), self.swa.available())

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa[:-1] = 0
        self.full_to_swa_device[:-1] = 0
        if self.log is not None:
            self.log.append([TableOp.CLEAR_MAP])

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take n full slots (int64, cpu), each paired with a fresh SWA slot; all or none."""
        if n > self.available():
            return None
        full = self.full.alloc(n)
        swa = self.swa.alloc(n)
        assert full is not None and swa is not None
        self._set_mapping(full, swa)
        return full

    def translate_full_to_swa(self, full_slots: torch.Tensor) -> torch.Tensor:
        """SWA slots paired with `full_slots` (int32, on the input's device); unmapped -> 0, -1 -> -1."""
        # By device type: `self.device` may be given without an index ("cuda" != "cuda:0").
        if full_slots.device.type != self.device.type:
            return self.full_to_swa[full_slots.long()].to(torch.int32)
        self.sync_device()
        return self.full_to_swa_device[full_slots.long()]

    def free(self, full_slots: torch.Tensor) -> None:
        self.free_swa(full_slots)
        self.full.free(full_slots)

    def free_swa(self, full_slots: torch.Tensor) -> None:
        """Release the SWA side of `full_slots` (those still mapped) and reset their mapping to 0."""
        full_slots = full_slots.reshape(-1).to(device="cpu", dtype=torch.int64)
        if not full_slots.numel():
            return
        if bool((full_slots <= 0).any()):
            raise ValueError("free_swa got slot 0 or a negative slot")
        swa = self.full_to_swa[full_slots]
        self.swa.free(swa[swa > 0])
        self._set_mapping(full_slots, torch.zeros_like(full_slots))

    def move_swa(self, src_full: torch.Tensor, dst_full: torch.Tensor) -> None:
        """Hand the SWA slots of `src_full` (all mapped) to `dst_full` (all unmapped), element-wise;
        `src_full` then maps to 0. The prefix cache heals a tombstoned node with the SWA K/V a
        request computed for the same tokens at the same positions."""
        src_full = src_full.reshape(-1).to(device="cpu", dtype=torch.int64)
        dst_full = dst_full.reshape(-1).to(device="cpu", dtype=torch.int64)
        swa = self.full_to_swa[src_full]
        assert bool((swa > 0).all()) and not self.full_to_swa[dst_full].any(), "move_swa: src unmapped or dst mapped"
        self._set_mapping(torch.cat([src_full, dst_full]), torch.cat([torch.zeros_like(swa), swa]))

    def _set_mapping(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        self.full_to_swa[full] = swa
        if self.defer_device:
            self._dirty.append(full)
        else:
            self._write_device(full)
        if self.log is not None:
            self.log.append([TableOp.MAP, full.tolist(), swa.tolist()])

    def sync_device(self) -> None:
        """Write the device mirror's entries remapped since the last write (`defer_device`), in one copy."""
        if self._dirty:
            dirty, self._dirty = self._dirty, []
            self._write_device(dirty[0] if len(dirty) == 1 else torch.cat(dirty))

    def _write_device(self, full: torch.Tensor) -> None:
        """`full` slots' host entries into the device mirror: one `[2, n]` int32 copy, one indexed write. The
        host table's values now, so a slot listed twice writes the same value twice."""
        pairs = torch.stack([full, self.full_to_swa[full]]).to(torch.int32)
        dev = to_device(pairs, self.device)
        self.full_to_swa_device[dev[0]] = dev[1]

    def swa_used(self) -> int:
        return self.swa.used()

    def check_integrity(self, owned_full: torch.Tensor | None = None) -> None:
        """Check both allocators and the table; with `owned_full` (all full slots callers hold),
        check the full pool's partition exactly."""
        table = self.full_to_swa
        assert int(table[0]) == 0, "full_to_swa[0] must stay 0"
        assert int(table[-1]) == -1, "full_to_swa's trailing sentinel must stay -1"
        body = table[1:-1]
        assert int(body.min()) >= 0 if body.numel() else True, "negative SWA slot in the mapping"
        mapped = body[body > 0]
        assert torch.unique(mapped).numel() == mapped.numel(), "an SWA slot is mapped from two full slots"
        assert mapped.numel() == self.swa.used(), (
            f"{mapped.numel()} mapped full slots but {self.swa.used()} SWA slots in use (leak or stale mapping)"
        )
        free_full = self.full.free_slots()
        assert not table[free_full].any(), "a free full slot still maps to an SWA slot"
        free_swa = set(self.swa.free_slots().tolist())
        assert not free_swa.intersection(mapped.tolist()), "a free SWA slot is still mapped (stale mapping)"
        self.full.check_integrity(owned_full)
        self.swa.check_integrity(mapped if mapped.numel() == self.swa.used() else None)
        self.sync_device()
        assert torch.equal(self.full_to_swa_device.cpu().long(), table), "device mapping differs from host table"
