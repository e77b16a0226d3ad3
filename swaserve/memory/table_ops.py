"""The device-table writes of the memory layer as plain records, so the other tensor-parallel ranks
can replay on their copies of `req_to_token` and `full_to_swa` exactly what rank 0 wrote."""

from __future__ import annotations

import enum

import torch

from swaserve.h2d import to_device


class TableOp(enum.IntEnum):
    ZERO_ROW = 0  # [op, row]
    WRITE = 1  # [op, row, start, slots]: req_to_token[row, start:start+n] = slots
    WRITE_TOKENS = 2  # [op, rows, positions, slots]: req_to_token[rows[i], positions[i]] = slots[i]
    MAP = 3  # [op, full, swa]: full_to_swa[full[i]] = swa[i]
    CLEAR_MAP = 4  # [op]: every full_to_swa entry but the trailing -1 back to 0


def apply_table_ops(ops: list[list], req_to_token: torch.Tensor, full_to_swa: torch.Tensor | None) -> None:
    """Replay `ops` (in order) on a rank's device tables: `req_to_token` `[R+1, C]` int32 and
    `full_to_swa` `[full_size+2]` int32 (None without an SWA pool)."""
    dev = req_to_token.device
    for op in ops:
        kind = op[0]
        if kind == TableOp.ZERO_ROW:
            req_to_token[op[1]].zero_()
        elif kind == TableOp.WRITE:
            slots = to_device(torch.tensor(op[3], dtype=torch.int32), dev)
            req_to_token[op[1], op[2] : op[2] + slots.numel()] = slots
        elif kind == TableOp.WRITE_TOKENS:
            rps = to_device(torch.tensor([op[1], op[2], op[3]], dtype=torch.int64), dev)
            req_to_token[rps[0], rps[1]] = rps[2].to(torch.int32)
        elif kind == TableOp.MAP:
            assert full_to_swa is not None, "a mapping write without an SWA pool"
            fs = to_device(torch.tensor([op[1], op[2]], dtype=torch.int64), dev)
            full_to_swa[fs[0]] = fs[1].to(torch.int32)
        elif kind == TableOp.CLEAR_MAP:
            assert full_to_swa is not None, "a mapping clear without an SWA pool"
            full_to_swa[:-1] = 0
        else:
            raise ValueError(f"unknown table op {kind!r}")


def table_digest(req_to_token: torch.Tensor, full_to_swa: torch.Tensor | None) -> torch.Tensor:
    """`[2]` int64 (CPU): position-weighted sums of both tables; equal tables give equal digests, and
    a slot written to the wrong place or not at all changes them (tensor-parallel ranks compare)."""
    out = []
    for t in (req_to_token, full_to_swa):
        if t is None:
            out.append(torch.zeros((), dtype=torch.int64))
            continue
        flat = t.reshape(-1).to(device="cpu", dtype=torch.int64)
        weights = torch.arange(flat.numel(), dtype=torch.int64) % 1_000_003 + 1
        out.append((flat * weights).sum())
    return torch.stack(out)
