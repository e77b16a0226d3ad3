"""WeightPrefetcher: inside a captured decode step, pulls the projection weights a layer is about to
read into L2 on a side stream, while the latency-bound kernels before them (rotary + K/V store,
attention, norms) leave HBM idle. A prefetch is a hint, so outputs are bit-identical with it on or off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# point -> weights: at `point` of layer i (qkv: after the qkv GEMM is launched; attn: after o_proj;
# mlp: after down_proj), prefetch these weights; "+1" names the next layer's.
DEFAULT_SCHEDULE = "qkv:o,gate_up;attn:down,qkv+1"
POINTS = ("qkv", "attn", "mlp")


def schedule_from_env() -> str | None:
    """SWASERVE_L2_PREFETCH: unset or "0" off, "1" the default schedule, else a schedule string."""
    v = os.environ.get("SWASERVE_L2_PREFETCH", "0")
    return None if v == "0" else DEFAULT_SCHEDULE if v == "1" else v


def _layer_weights(layer: nn.Module) -> dict[str, torch.Tensor]:
    attn, mlp = layer.self_attn, layer.mlp
    w = {"qkv": attn.qkv_proj.weight, "o": attn.o_proj.weight}
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):  # dense MLPs only (no experts)
        w |= {"gate_up": mlp.gate_up_proj.weight, "down": mlp.down_proj.weight}
    return w


def parse_schedule(schedule: str, layers: list[nn.Module]) -> dict[tuple[str, int], list[torch.Tensor]]:
    """(point, layer id) -> weights, from "point:name[,name+1...];..."; ValueError on a bad entry."""
    per_layer = [_layer_weights(layer) for layer in layers]
    ids = [layer.self_attn.spec.layer_id for layer in layers]
    plan: dict[tuple[str, int], list[torch.Tensor]] = {}
    for entry in filter(None, (e.strip() for e in schedule.split(";"))):
        point, _, names = entry.partition(":")
        if point not in POINTS:
            raise ValueError(f"prefetch schedule {schedule!r}: unknown point {point!r}; known: {POINTS}")
        for name in filter(None, (n.strip() for n in names.split(","))):
            base, ahead = (name[:-2], 1) if name.endswith("+1") else (name, 0)
            if base not in per_layer[0]:
                raise ValueError(f"prefetch schedule {schedule!r}: unknown weight {base!r}")
            for i, lid in enumerate(ids):
                if i + ahead < len(layers) and base in per_layer[i + ahead]:
                    plan.setdefault((point, lid), []).append(per_layer[i + ahead][base])
    return plan


class WeightPrefetcher:
    """Forks a side stream at each scheduled point (it waits for everything launched so far) and
    issues bulk L2 prefetches there; `join()` makes the main stream wait for the side stream, as a
    graph capture requires before it ends. Owns the side stream."""

    def __init__(self, layers: list[nn.Module], schedule: str, device: torch.device):
        self.schedule = schedule
        self.plan = parse_schedule(schedule, layers)
        self.side = torch.cuda.Stream(device)

    def __call__(self, point: str, layer_id: int) -> None:
        from swaserve.kernels.l2_prefetch import l2_prefetch

        weights = self.plan.get((point, layer_id))
        if not weights:
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            for w in weights:
                l2_prefetch(w)

    def join(self) -> None:
        torch.cuda.current_stream(self.side.device).wait_stream(self.side)
