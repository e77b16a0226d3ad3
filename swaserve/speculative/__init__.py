"""Speculative decoding: drafters propose tokens (`ngram`, `draft_model`, `eagle3`, `frozen_kv`,
`mimo_mtp`), the target verifies them in one extend-shaped forward and `verify` decides what is
accepted (lossless for greedy and sampling)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from swaserve.config import SchedulerConfig, SpeculativeConfig
    from swaserve.model_config import ModelConfig


def build_drafter(cfg: SpeculativeConfig, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                  sched: SchedulerConfig, load_format: str) -> Any:
    """The drafter for `cfg.speculative_method`. A draft model is built before the target's KV pools,
    which then size themselves from the memory it leaves."""
    if cfg.speculative_method == "ngram":
        from swaserve.speculative.ngram import NgramDrafter

        return NgramDrafter(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
    if cfg.speculative_method == "draft":
        from swaserve.speculative.draft_model import DraftModelDrafter

        return DraftModelDrafter.build(cfg.speculative_draft_model, target, device, dtype, sched, load_format,
                                       verify=(cfg.speculative_max_batch_size, cfg.speculative_num_tokens + 1))
    if cfg.speculative_method == "eagle3":
        from swaserve.speculative.eagle3 import Eagle3Drafter

        return Eagle3Drafter.build(cfg, target, device, dtype, sched, load_format)
    if cfg.speculative_method == "mtp":
        if cfg.speculative_draft_model is None:
            if getattr(target.hf_config, "model_type", None) != "mimo_v2_flash":
                raise ValueError("speculative_method 'mtp' needs a target whose checkpoint has MTP layers "
                                 "(MiMo-V2-Flash) or speculative_draft_model (a gemma4_assistant directory)")
            from swaserve.speculative.mimo_mtp import MiMoMTPDrafter

            return MiMoMTPDrafter.build(cfg, target, device, dtype, sched, load_format)
        from swaserve.speculative.frozen_kv import FrozenKVDrafter

        return FrozenKVDrafter.build(cfg, target, device, dtype, sched, load_format)
    raise ValueError(f"unknown speculative_method {cfg.speculative_method!r}")
