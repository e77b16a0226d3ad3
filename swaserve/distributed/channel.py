"""StepChannel: rank 0 tells the other tensor-parallel ranks what to run, one message per step, over
the gloo host group (msgspec-encoded, no pickle); the model's collectives keep the ranks in step."""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import torch.distributed as dist

from swaserve.runner.forward_batch import ForwardInputs


class StepMessage(msgspec.Struct, array_like=True, omit_defaults=True):
    """`ops`: device-table writes since the last message (`memory.table_ops`), replayed first;
    `inputs`: the step to run (None: tables only); `sample`: the batch rows whose last token samples
    (every rank computes their logits; rank 0 broadcasts the tokens); `check`: gather a digest of the
    device tables to rank 0 (`TensorParallel.check_tables`); `stop`: leave the loop.
    A speculative verify step also has `select` (the token rows whose final states it keeps) and
    `heads` (the LM-head calls rank 0 makes on them, in its order: `[start, rows]` each); `sample` is
    then the batch rows whose last appended token rank 0 broadcasts. `greedy`: the `sample` rows take
    the LM head's greedy path (`runner.greedy_tokens`: a gather of each rank's best token per row)
    instead of the logits gather."""

    ops: list[list[Any]] = []
    inputs: ForwardInputs | None = None
    sample: list[int] = []
    select: list[int] = []
    heads: list[list[int]] = []
    check: bool = False
    stop: bool = False
    greedy: bool = False


class StepChannel:
    """Broadcast from rank 0 on `group` (a gloo group): a length, then the encoded message."""

    def __init__(self, group: Any):
        self.group = group
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(StepMessage)
        self._len = torch.zeros(1, dtype=torch.int64)

    def send(self, msg: StepMessage) -> None:
        data = self._enc.encode(msg)
        self._len[0] = len(data)
        dist.broadcast(self._len, src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def recv(self) -> StepMessage:
        dist.broadcast(self._len, src=0, group=self.group)
        buf = torch.empty(int(self._len[0]), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return self._dec.decode(buf.numpy().tobytes())
