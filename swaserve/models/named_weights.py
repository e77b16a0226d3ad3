"""Loading (HF name, tensor) pairs into a module by parameter name: q/k/v and gate/up into their merged
projections' shards, the rest into their parameters (tensor-parallel slices, FP8 scales), with what no
tensor filled reported by name."""

from __future__ import annotations

import torch
from torch import nn

from swaserve.layers.linear import MergedLinear

# HF projection -> (merged parameter, shard). Patterns carry their dots so ".up_proj." never
# matches inside ".gate_up_proj." (GPT-OSS experts keep that name unmerged).
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


def hf_module_names(name: str, module: nn.Module) -> list[str]:
    """The HF modules one of the model's modules holds: q/k/v (or gate/up) of a merged projection."""
    if isinstance(module, MergedLinear):
        parts = sorted((shard, (name + ".").replace(dst, src)[:-1]) for src, dst, shard in STACKED_PARAMS
                       if dst in name + ".")
        return [n for _, n in parts[: len(module.out_sizes)]] or [name]
    return [name]


class NamedWeights:
    """Loads (HF name, tensor) pairs into `module` by parameter name: q/k/v and gate/up into their
    merged parameter's shards (`STACKED_PARAMS`), each other tensor into its parameter (a
    tensor-parallel layer takes its `tp_slice`), shapes checked. `finish()` raises ValueError naming
    what no tensor loaded. Extra entries (a head's buffers) join through `expect` / `mark`."""

    def __init__(self, module: nn.Module, what: str = "checkpoint", buffers: bool = False):
        self.module, self.what = module, what
        self.params: dict[str, torch.Tensor] = dict(module.named_parameters())
        if buffers:
            self.params.update(module.named_buffers())
        self.merged = {f"{n}.{p}": m for n, m in module.named_modules() if isinstance(m, MergedLinear)
                       for p in ("weight", "bias", "weight_scale_inv") if getattr(m, p, None) is not None}
        self.expected = {(n, None) for n in self.params if n not in self.merged}
        self.expected |= {(n, i) for n, m in self.merged.items() for i in range(len(m.out_sizes))}
        self.loaded: set[tuple[str, int | None]] = set()

    def expect(self, target: str) -> None:
        self.expected.add((target, None))

    def mark(self, target: str) -> None:
        self.loaded.add((target, None))

    def load(self, name: str, target: str, tensor: torch.Tensor) -> None:
        """`tensor` (checkpoint name `name`) into the parameter `target` names in this module."""
        for src, dst, shard in STACKED_PARAMS:
            pname = target.replace(src, dst)
            if src in target and pname in self.merged:
                prefix = pname.rsplit(".", 1)[0]
                for filled in self.merged[pname].load_shard(shard, pname.rsplit(".", 1)[1], tensor):
                    self.loaded.add((f"{prefix}.{filled}", shard))
                return
        param = self.params.get(target)
        if param is None:
            hint = " (an FP8 scale of a module kept unquantised: see ignored_layers)" if name.endswith("_scale_inv") else ""
            raise ValueError(f"unknown weight {name!r} for {type(self.module).__name__}{hint}")
        owner, _, pname = target.rpartition(".")
        if tensor.dtype == torch.float8_e4m3fn and param.dtype != tensor.dtype:
            raise ValueError(f"{name!r} is stored as FP8 but swaserve keeps {target} in {param.dtype} (listed in the "
                             "checkpoint's ignored_layers, or a module without an FP8 path)")
        submodule = self.module.get_submodule(owner)
        load_param = getattr(submodule, "load_param", None)
        filled = load_param(pname, tensor) if load_param is not None else ()
        if filled:  # the module loaded it itself (FP8 scales, weights quantised at load)
            self.loaded.update((f"{owner}.{p}", None) for p in filled)
            return
        tp_slice = getattr(submodule, "tp_slice", None)
        if tp_slice is not None:  # tensor parallelism: this rank's part of the HF tensor
            tensor = tp_slice(pname, tensor)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
        if param.dtype == torch.float8_e4m3fn and tensor.dtype != param.dtype:
            raise ValueError(f"{name!r} is stored as {tensor.dtype} but the checkpoint's FP8 quantization_config "
                             "quantises it (is it missing from ignored_layers?)")
        param.data.copy_(tensor)
        self.loaded.add((target, None))

    def finish(self) -> None:
        missing = sorted(n + ("" if s is None else f"[shard {s}]") for n, s in self.expected - self.loaded)
        if missing:
            raise ValueError(f"{self.what} is missing {len(missing)} weights, e.g. {missing[:5]}")
