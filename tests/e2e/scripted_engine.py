"""ScriptedEngine: the FakeEngine contract over a real vocabulary, replying with a fixed token script (one
token per step) whatever the prompt, so a server test knows the exact reply a model would write."""

from __future__ import annotations

import random
from types import SimpleNamespace

from fake_engine import FakeEngine, _Req

from swaserve.request import SamplingParams


class ScriptedEngine(FakeEngine):
    """Every request gets `script` (token ids; -1 stands for the request's own prompt ids, an echo) token by
    token, then `filler` (if the script ran out without a stop). A token in `eos_ids` or the request's
    `stop_token_ids` ends it ("stop", the token reported as the real engine does); `max_tokens` ("length")."""

    def __init__(self, script: list[int], vocab_size: int, eos_ids: list[int] = (), filler: int = 13,  # type: ignore[assignment]
                 max_context: int = 4096, name: str = "scripted", **kwargs: object):
        super().__init__(max_context=max_context, **kwargs)  # type: ignore[arg-type]
        self.script, self.filler, self.eos = list(script), filler, set(eos_ids)
        self.model_config = SimpleNamespace(max_context=max_context, vocab_size=vocab_size, eos_token_ids=tuple(eos_ids))
        self.model_name = name

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self._check_thread()
        if isinstance(prompt, str) or not prompt:
            raise ValueError("ScriptedEngine takes non-empty token-id prompts")
        if max(prompt) >= self.model_config.vocab_size or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        if len(prompt) + params.max_tokens > self.model_config.max_context:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the context")
        self.waiting.append(_Req(request_id, list(prompt), params, None, random.Random(0),  # type: ignore[arg-type]
                                 logprobs=[] if params.logprobs is not None else None))

    def _advance(self, req: _Req) -> None:
        p, k = req.params, len(req.output_ids)
        reply = [t for s in self.script for t in (req.prompt_ids if s == -1 else [s])]
        token = reply[k] if k < len(reply) else self.filler
        req.output_ids.append(token)
        self.stats.generation_tokens_total += 1
        if req.logprobs is not None:
            req.logprobs.append({token: -0.25})
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_tokens:
            req.finish_reason = "length"
