"""MiMoMTPDrafter: MiMo-V2-Flash's first MTP layer (`models/mimo_v2_mtp.py`) drafting from the target's
final (normed) states. Its K/V entry at position t is computed from the target's state at t and the
embedding of token t + 1, in its own one-layer sliding-window cache (`DraftCache`, SWA pool with
eviction). Each step it catches up on the positions the target confirmed (one extend forward), then
chains k - 1 decode steps on its own output, the same layer at every depth."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swaserve.models.mimo_v2_mtp import HIDDEN_INPUT, MTP_LAYER, MiMoMTPHead, head_config
from swaserve.speculative.state_head import StateHeadDrafter, head_runtime

if TYPE_CHECKING:
    from swaserve.config import SchedulerConfig, SpeculativeConfig
    from swaserve.model_config import ModelConfig
    from swaserve.runtime import Runtime

class MiMoMTPDrafter(StateHeadDrafter):
    """Owns the MTP layer's runtime and one state sequence per speculating request
    (`StateHeadDrafter`); the layer reads the target's final states and chains on its own output."""

    name = "the MTP layer"
    extend_key = chain_key = HIDDEN_INPUT

    def __init__(self, rt: Runtime, head: MiMoMTPHead, start: Any = None):
        super().__init__(rt, head, head.hidden_size, start)

    @classmethod
    def build(cls, cfg: SpeculativeConfig, target: ModelConfig, device: torch.device, dtype: torch.dtype,
              target_sched: SchedulerConfig, load_format: str) -> MiMoMTPDrafter:
        from swaserve.model_config import ModelConfig

        thf = target.hf_config
        if load_format == "dummy":
            weights = None
            if not num_mtp_layers_declared(thf):
                raise ValueError("speculative_method 'mtp': this MiMo-V2-Flash config declares no MTP layers "
                                 "(num_nextn_predict_layers)")
        else:
            weights = mtp_weights(Path(getattr(thf, "_name_or_path", "") or "."))
        # An FP8 checkpoint's MTP projections are FP8 as stored (dummy weights: as its config says).
        stored = None if weights is None else {m.group(2): t.dtype for n, t in weights if (m := MTP_LAYER.match(n))}
        hf = head_config(thf, stored)
        with torch.device("meta"):
            head = MiMoMTPHead(hf)
        head = head.to(dtype=dtype).to_empty(device=device).eval()
        if weights is None:
            from swaserve.loader.dummy import init_dummy_weights

            init_dummy_weights(head)
        else:
            head.load_weights(weights)
        config = ModelConfig.from_hf(hf, max_context=target.max_context)
        group = config.swa_group
        scratch = ({HIDDEN_INPUT: head.hidden_size}, {HIDDEN_INPUT: head.hidden_size}, ())
        rt, start = head_runtime(config, head, group.num_kv_heads, group.k_head_dim + group.v_head_dim, target,
                          target_sched, device, dtype, scratch,
                          (cfg.speculative_max_batch_size, cfg.speculative_num_tokens + 1))
        return cls(rt, head, start)

    def attach(self, rt: Runtime) -> None:
        """Share the target's token embedding and LM head with the MTP layer; free its out-of-window
        SWA slots in the target's chunks (`swa_evict_chunk`)."""
        target = rt.runner.model
        self.head.share_target(target.model.embed_tokens, target.lm_head)
        if rt.evictor is not None and self.rt.evictor is not None:
            self.rt.evictor.chunk = rt.evictor.chunk


def num_mtp_layers_declared(hf: Any) -> int:
    """The MTP layer count a config states (the released config.json's `num_nextn_predict_layers`)."""
    return int(getattr(hf, "num_nextn_predict_layers", None) or getattr(hf, "num_mtp_layers", None) or 0)


def mtp_weights(path: Path) -> list[tuple[str, torch.Tensor]]:
    """The `model.mtp.layers.0.*` tensors of the target checkpoint at `path` (only those are read).
    Raises ValueError when it has none."""
    from safetensors import safe_open

    from swaserve.loader.safetensors import safetensors_files

    files = safetensors_files(path) if (path / "config.json").is_file() else []
    out = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                m = MTP_LAYER.match(name)
                if m is not None and m.group(1) == "0":
                    out.append((name, shard.get_tensor(name)))
    if not out:
        raise ValueError(f"speculative_method 'mtp': the MiMo-V2-Flash checkpoint at {path} has no MTP layers "
                         "(no model.mtp.layers.0.* tensors); give speculative_draft_model for another drafter "
                         "or turn speculation off")
    return out
