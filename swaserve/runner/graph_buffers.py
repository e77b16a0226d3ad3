"""Static decode inputs replayed by graph runners, and the padding rules of DESIGN.md §4."""

from __future__ import annotations

import torch

from swaserve.runner.forward_batch import ForwardBatch, ForwardMode

SEQ_LEN_FILL = 1  # padded rows attend one key: the dummy slot 0 their own token writes


class DecodeInputBuffers:
    """Fixed device buffers a captured decode step reads, sized for the largest captured batch.

    `inputs` holds the four host-given fields as rows (positions, req_pool_indices, seq_lens,
    out_cache_loc), so one copy brings a live batch in. The rest is derived from them by `derive`
    (recorded into the CUDA graph, so it is recomputed on every replay): input ids from the runner's
    last-token table, int32 seq_lens, and the SWA write locations translated from the live
    `out_cache_loc` (never memoised across steps).

    Invariant after `populate(batch, bs)`: rows [0, raw_bs) hold the live batch; rows [raw_bs, bs)
    are padding that reads row 0 of `req_to_token` (all zeros), writes K/V only to slot 0 of both
    pools and attends a single key. Nothing from an earlier, larger batch survives in the padded
    rows: they are reset in the same pass that copies the live rows.
    """

    FIELDS = ("positions", "req_pool_indices", "seq_lens", "out_cache_loc")
    PAD = (0, 0, SEQ_LEN_FILL, 0)  # DESIGN.md §4 fill value of each field, in FIELDS order

    def __init__(self, max_bs: int, device: torch.device | str, hybrid: bool):
        dev = torch.device(device)
        self.max_bs = max_bs
        self.inputs = torch.tensor(self.PAD, dtype=torch.int64, device=dev)[:, None].repeat(1, max_bs)  # [4, max_bs] int64, device
        self._pad = torch.tensor(self.PAD, dtype=torch.int64, device=dev)[:, None]  # [4, 1] int64, device
        self.positions, self.req_pool_indices, self.seq_lens_i64, self.out_cache_loc = self.inputs.unbind(0)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs] int64, device
        self.seq_lens = torch.full((max_bs,), SEQ_LEN_FILL, dtype=torch.int32, device=dev)  # [max_bs] int32, device
        # SWA write locations are int32, the dtype the translation yields and the kernels read.
        self.swa_out_cache_loc = (
            torch.zeros(max_bs, dtype=torch.int32, device=dev) if hybrid else None
        )  # [max_bs] int32, device: SWA pool

    def populate(self, batch: ForwardBatch, bs: int) -> None:
        """Copy a live decode batch of raw_bs <= bs rows in, padding rows raw_bs .. bs-1."""
        raw = batch.batch_size
        assert batch.is_decode and raw <= bs <= self.max_bs, (raw, bs, self.max_bs)
        if bs != raw:
            self.inputs[:, raw:bs].copy_(self._pad.expand(-1, bs - raw))
        live = batch.decode_inputs
        if live is None:
            live = torch.stack([batch.positions, batch.req_pool_indices, batch.seq_lens.long(), batch.out_cache_loc])
        self.inputs[:, :raw].copy_(live, non_blocking=True)

    def derive(self, bs: int, last_tokens: torch.Tensor, full_to_swa: torch.Tensor | None) -> None:
        """Compute the derived buffers of rows [0, bs) from `inputs` (graph-capturable: device only).
        Padded rows read `last_tokens[0]` and `full_to_swa[0]`, both 0 forever."""
        torch.index_select(last_tokens, 0, self.req_pool_indices[:bs], out=self.input_ids[:bs])
        self.seq_lens[:bs].copy_(self.seq_lens_i64[:bs])
        if self.swa_out_cache_loc is not None:
            assert full_to_swa is not None
            torch.index_select(full_to_swa, 0, self.out_cache_loc[:bs], out=self.swa_out_cache_loc[:bs])

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


class ExtendTokenBuffers:
    """Static per-token inputs of a captured extend step (prefill chunks, mixed steps) of up to N tokens:
    (input id, position, full-pool slot) as the rows of `tokens`, so one copy brings a live step in;
    `populate` resets tokens T..N-1 to token 0 at position 0 in slot 0 (DESIGN.md §4). `derive(n)`,
    recorded in the graph, translates the SWA write locations from the live slots (never memoised) and
    marks the live tokens (slot != 0: `moe_routed_rows`, so padded tokens reach no expert)."""

    def __init__(self, n: int, device: torch.device | str, full_to_swa: torch.Tensor | None):
        self.tokens = torch.zeros(3, n, dtype=torch.int64, device=device)  # [3, N] int64
        self.live = torch.zeros(n, dtype=torch.bool, device=device)  # [N]
        self.full_to_swa = full_to_swa
        self.swa = torch.zeros(n, dtype=torch.int32, device=device) if full_to_swa is not None else None

    def populate(self, batch: ForwardBatch, n: int) -> None:
        T = batch.num_tokens
        self.tokens[:, T:n].zero_()
        self.tokens[:, :T].copy_(torch.stack([batch.input_ids, batch.positions, batch.out_cache_loc]))

    def derive(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(SWA write locations `[n]` int32 or None, live mask `[n]` bool) of the static tokens."""
        swa = None
        if self.swa is not None:
            swa = self.swa[:n]
            torch.index_select(self.full_to_swa, 0, self.tokens[2, :n], out=swa)
        torch.ne(self.tokens[2, :n], 0, out=self.live[:n])
        return swa, self.live[:n]

    def batch(self, n: int, **requests) -> ForwardBatch:
        """An extend batch over the first n static tokens (`derive`d first), with `requests`' fields."""
        swa, live = self.derive(n)
        fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=self.tokens[0, :n], positions=self.tokens[1, :n],
                          out_cache_loc=self.tokens[2, :n], swa_out_cache_loc=swa, **requests)
        fb.scratch["moe_routed_rows"] = live
        return fb


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 to 512, then of 64, up to max_bs (always
    included): a padded batch of more than 64 rows wastes under a quarter of them, above 256 under an
    eighth, and at most 39 graphs are captured for the largest running limit (1024)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    b = 16
    while b <= max_bs:
        sizes.append(b)
        b += 8 if b < 64 else 16 if b < 256 else 32 if b < 512 else 64
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(raw_bs: int, sizes: list[int]) -> int | None:
    """Smallest captured size >= raw_bs, or None above the largest."""
    return next((b for b in sizes if b >= raw_bs), None)


class ScratchSlots:
    """Static buffers for batch-scratch tensors a captured program reads (`inputs`: key -> width, one
    row per token; e.g. a drafter head's state input) and the scratch keys it writes that callers
    read back (`outputs`; e.g. a head's pre-norm output). `fill` resets every row up to the padded
    size before copying the live rows in, so a padded row reads zeros, never a gone request's state."""

    def __init__(self, inputs: dict[str, int], outputs: tuple[str, ...], rows: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.buffers = {k: torch.zeros(rows, w, dtype=dtype, device=device) for k, w in inputs.items()}
        self.outputs = ("aux_hidden", *outputs)  # the target's auxiliary states, for an EAGLE-3 drafter

    def bind(self, batch: ForwardBatch, n: int) -> None:
        """Point the static batch's scratch at the first n rows of each input buffer."""
        for k, b in self.buffers.items():
            batch.scratch[k] = b[:n]

    def fill(self, batch: ForwardBatch, n: int, dest: torch.Tensor | None = None) -> None:
        """Copy the live batch's scratch inputs into rows `dest` (default 0..) after zeroing rows [0, n)."""
        for k, b in self.buffers.items():
            b[:n].zero_()
            live = batch.scratch.get(k)
            if live is None:  # the eager program would read no input either: zeros
                continue
            if dest is None:
                b[: live.shape[0]].copy_(live)
            else:
                b.index_copy_(0, dest, live)

    def written(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """The output keys the program wrote into `batch.scratch` (at capture: tensors of its pool)."""
        return {k: batch.scratch[k] for k in self.outputs if k in batch.scratch}
