"""Speculative decoding: drafters propose tokens (`ngram`, `draft_model`), the target verifies them in
one extend-shaped forward and `verify` decides what is accepted (lossless for greedy and sampling)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swaserve.config import SpeculativeConfig
    from swaserve.scheduler.speculate import Speculation


def build_speculation(cfg: SpeculativeConfig, engine: Any) -> Speculation:
    """The scheduler's `Speculation` for `cfg.speculative_method`, drafting for `engine`'s model."""
    from swaserve.scheduler.speculate import Speculation

    if cfg.speculative_method == "ngram":
        from swaserve.speculative.ngram import NgramDrafter

        drafter: Any = NgramDrafter(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
    elif cfg.speculative_method == "draft":
        from swaserve.speculative.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter.build(cfg.speculative_draft_model, engine)
    else:
        raise ValueError(f"unknown speculative_method {cfg.speculative_method!r}")
    return Speculation(drafter, cfg.speculative_num_tokens, cfg.speculative_max_batch_size)
