"""Tensor parallelism over torch.distributed: the group and collectives (`state`), rank 0's step
broadcast (`channel`), the other ranks' processes (`worker`) and how they are started (`launch`)."""
