"""LLM: offline batch generation over one in-process Engine (`LLM().generate(prompts, params)`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from typing_extensions import Self

from swaserve.engine import Engine
from swaserve.request import RequestOutput, SamplingParams


class LLM:
    """Offline batch generation: `LLM().generate(prompts, SamplingParams(...))`.

    `model=None` loads the embedded Gemma 3 270M; `device=None` picks CUDA when available. With
    `tensor_parallel_size=N` the other N-1 ranks run in processes of their own until `close()`
    (or the end of a `with` block, or of this process).
    """

    def __init__(self, model: str | None = None, device: Any = None, dtype: Any = None, **engine_options: Any):
        self.engine = Engine(model, device=device, dtype=dtype, **engine_options)
        self._ids = itertools.count()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _normalise_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"got {len(params)} sampling params for {len(prompt_list)} prompts")
        ids = [str(next(self._ids)) for _ in prompt_list]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompt_list, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        from tqdm.auto import tqdm

        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while len(results) < len(ids):
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in ids]

    def memory_stats(self) -> dict[str, int]:
        return self.engine.memory_stats()

    def kv_cache_dtypes(self) -> dict[str, str]:
        """Each KV pool's storage dtype by name, e.g. {"full": "fp8_e4m3", "swa": "bfloat16"}."""
        return self.engine.kv_cache_dtypes()

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix no running request holds (frees its K/V memory)."""
        self.engine.scheduler.reset_prefix_cache()

    def stats(self) -> dict[str, int]:
        """Every engine counter in one dict: a superset of `memory_stats()`, with the names the
        server's /metrics exports (swaserve_kv_used_tokens, swaserve_generation_tokens_total, ...)."""
        return self.engine.counters()


def _normalise_prompts(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("no prompts given")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return [p if isinstance(p, str) else list(p) for p in prompts]
    raise ValueError("prompts must be a string, a list of strings, or token-id lists")
