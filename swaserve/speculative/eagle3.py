"""Eagle3Drafter: an EAGLE-3 head (`models/llama_eagle3.py`) drafting from the target's own states. The
target keeps the residual stream entering three of its layers (`aux_hidden_layers`); the head's K/V
entry at position t is computed from those states at t and the embedding of token t + 1, in its own
one-layer cache (`DraftCache`). Each step it catches up on the positions the target confirmed (one
extend forward), then chains k - 1 decode steps on its own pre-norm output."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swaserve.models.llama_eagle3 import AUX_INPUT, EAGLE3_ARCHITECTURES, HIDDEN_INPUT, PRENORM, Eagle3Head
from swaserve.speculative.state_head import StateHeadDrafter, head_runtime

if TYPE_CHECKING:
    from swaserve.config import SchedulerConfig, SpeculativeConfig
    from swaserve.model_config import ModelConfig
    from swaserve.runner.forward_batch import ForwardBatch
    from swaserve.runtime import Runtime

class Eagle3Drafter(StateHeadDrafter):
    """Owns the head's runtime and one state sequence per speculating request (`StateHeadDrafter`);
    the head reads the target's auxiliary states (3 x hidden) and chains on its pre-norm output."""

    name = "the EAGLE-3 head"
    extend_key, chain_key = AUX_INPUT, HIDDEN_INPUT

    def __init__(self, rt: Runtime, head: Eagle3Head, layers: tuple[int, ...], start: Any = None):
        super().__init__(rt, head, head.fc.in_features, start)
        self.layers = layers

    def chain_states(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        prenorm = batch.scratch[PRENORM]
        return prenorm if batch.is_decode else prenorm[batch.last_token_indices()]

    @classmethod
    def build(cls, cfg: SpeculativeConfig, target: ModelConfig, device: torch.device, dtype: torch.dtype,
              target_sched: SchedulerConfig, load_format: str) -> Eagle3Drafter:
        from swaserve.loader.hf_dir import load_hf_config
        from swaserve.model_config import ModelConfig

        path = cfg.speculative_draft_model
        if path is None:
            raise ValueError("speculative_method eagle3 needs speculative_draft_model: an EAGLE-3 head's HF directory")
        hf = load_hf_config(path)
        arch = (getattr(hf, "architectures", None) or [None])[0]
        if arch not in EAGLE3_ARCHITECTURES:
            raise ValueError(f"{path} is not an EAGLE-3 head (architectures {arch!r}; expected one of "
                             f"{', '.join(EAGLE3_ARCHITECTURES)})")
        if hf.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 heads with {hf.num_hidden_layers} decoder layers are not supported (1 only)")
        thf = target.hf_config
        target_hidden = int(getattr(hf, "target_hidden_size", None) or hf.hidden_size)
        if target_hidden != thf.hidden_size:
            raise ValueError(f"the EAGLE-3 head expects a target of hidden size {target_hidden}; this target's is "
                             f"{thf.hidden_size}")
        if hf.vocab_size != target.vocab_size:
            raise ValueError(f"the EAGLE-3 head's vocabulary ({hf.vocab_size}) differs from the target's "
                             f"({target.vocab_size})")
        layers = aux_layers(hf, target.num_layers)
        weights = None if load_format == "dummy" else dict(_head_weights(Path(path)))
        has_embed = weights is not None and any(n.removeprefix("model.") == "embed_tokens.weight" for n in weights)
        if not has_embed and hf.hidden_size != thf.hidden_size:
            raise ValueError("the EAGLE-3 head has no embed_tokens and its hidden size differs from the target's")
        hf.sliding_window, hf.layer_types = None, None  # one full-attention layer
        with torch.device("meta"):
            head = Eagle3Head(hf, target_hidden, has_embed)
        head = head.to(dtype=dtype).to_empty(device=device).eval()
        if weights is None:
            from swaserve.loader.dummy import init_dummy_weights

            init_dummy_weights(head)
            head.d2t.zero_()
        else:
            head.load_weights(weights.items())
        config = ModelConfig.from_hf(hf, max_context=target.max_context)
        group = config.full_group
        scratch = ({HIDDEN_INPUT: head.hidden_size}, {AUX_INPUT: head.fc.in_features}, (PRENORM,))
        rt, start = head_runtime(config, head, group.num_kv_heads, group.k_head_dim + group.v_head_dim, target,
                          target_sched, device, dtype, scratch,
                          (cfg.speculative_max_batch_size, cfg.speculative_num_tokens + 1))
        return cls(rt, head, layers, start)

    def attach(self, rt: Runtime) -> None:
        """Make the target keep the states of `layers` (before its decode graphs are captured) and, for
        a head without its own, share the target's embedding table (unscaled, as EAGLE-3 trains it)."""
        stack = rt.runner.model.model
        if not hasattr(stack, "aux_hidden_layers"):
            raise ValueError(f"{type(rt.runner.model).__name__} does not keep auxiliary states for EAGLE-3")
        stack.aux_hidden_layers = self.layers
        if self.head.embed_tokens is None:
            from swaserve.layers.embedding import VocabEmbedding

            with torch.device("meta"):
                embed = VocabEmbedding(self.head.hf_config.vocab_size, self.head.hidden_size)
            embed.weight = stack.embed_tokens.weight
            self.head.embed_tokens = embed


def aux_layers(hf: Any, num_layers: int) -> tuple[int, ...]:
    """The target layers whose entering residual stream the head reads: the config's
    `eagle_aux_hidden_state_layer_ids` name layer outputs (so the input of the next layer), else
    (2, L // 2, L - 3)."""
    eagle = getattr(hf, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    layers = tuple(int(i) + 1 for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(layers) != 3 or not all(0 <= i <= num_layers for i in layers):
        raise ValueError(f"EAGLE-3 auxiliary layers {layers} do not fit a target of {num_layers} layers")
    return layers


def _head_weights(path: Path):
    """(name, tensor) pairs of a head directory: safetensors, else pytorch_model.bin."""
    from swaserve.loader.safetensors import iter_safetensors, safetensors_files

    if safetensors_files(path):
        yield from iter_safetensors(path)
        return
    bin_file = path / "pytorch_model.bin"
    if not bin_file.is_file():
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin weights in {path}")
    yield from torch.load(bin_file, map_location="cpu", weights_only=True).items()
