"""FakeEngine: the Engine contract (add_request / step / step_deltas / abort / memory_stats) over a byte-level toy
tokenizer and a deterministic toy "model", so server tests run in milliseconds per request.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

from swaserve.detokenizer import IncrementalDetokenizer
from swaserve.engine import SeqDelta
from swaserve.request import CompletionOutput, RequestOutput, SamplingParams

BOS, EOS = 256, 257
VOCAB = 300
ALPHABET = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz .,"] + [EOS]  # tokens the toy model emits


class FakeTokenizer:
    """Bytes are tokens 0..255; 256 is BOS, 257 EOS; the chat template is a plain tagged format."""

    eos_token_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if any(m["role"] == "system" for m in messages[1:]):
            raise RuntimeError("System role is only supported as the first message")  # like jinja raise_exception
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    rng: random.Random
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class FakeEngine:
    """Toy continuous-batching engine. Invariant: called from one thread only (checked).

    The next token depends only on the request's own tokens (and its seed), never on the batch, so
    any greedy result equals the same prompt run alone. KV accounting: a running request holds
    `length` full-pool slots and min(length, window + 8) SWA slots; admission reserves prompt +
    max_tokens full slots so the pools never overflow.
    """

    def __init__(self, max_context: int = 512, full_tokens: int = 8192, swa_tokens: int = 4096,
                 window: int = 32, max_running: int = 64, step_delay: float = 0.002):
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(max_context=max_context, vocab_size=VOCAB, eos_token_ids=(EOS,))
        self.model_name = "fake-model"
        self.stats = SimpleNamespace(prompt_tokens_total=0, generation_tokens_total=0, retractions_total=0)
        self.full_total, self.swa_total, self.window = full_tokens, swa_tokens, window
        self.max_running, self.step_delay = max_running, step_delay
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._owner: int | None = None
        self.steps = 0

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        if self._owner != me:
            raise RuntimeError("FakeEngine called from two threads")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self._check_thread()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")  # noqa: TRY004  (the contract says ValueError)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < VOCAB]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {VOCAB}), got {bad[:5]}")
        if len(ids) + params.max_tokens > self.model_config.max_context:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the context")
        if params.n != 1:
            raise ValueError("FakeEngine supports n=1 only")
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop)
        req = _Req(request_id, ids, params, detok, random.Random(seed),
                   logprobs=[] if params.logprobs is not None else None)
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        self._check_thread()
        self.waiting = [r for r in self.waiting if r.rid != request_id]
        self.running = [r for r in self.running if r.rid != request_id]

    def has_unfinished(self) -> bool:
        self._check_thread()
        return bool(self.waiting or self.running)

    def memory_stats(self) -> dict[str, int]:
        self._check_thread()
        return {
            "full_tokens_used": sum(r.length for r in self.running),
            "full_tokens_total": self.full_total,
            "swa_tokens_used": sum(min(r.length, self.window + 8) for r in self.running),
            "swa_tokens_total": self.swa_total,
            "running": len(self.running),
            "waiting": len(self.waiting),
        }

    def step(self) -> list[RequestOutput]:
        outputs = []
        for req in self._step():
            comp = CompletionOutput(0, req.detok.text, list(req.output_ids),
                                    None if req.logprobs is None else list(req.logprobs), req.finish_reason)
            outputs.append(RequestOutput(req.rid, None, req.prompt_ids, [comp], req.finish_reason is not None))
        return outputs

    def step_deltas(self) -> list[SeqDelta]:
        return [SeqDelta(req.rid, 0, req.output_ids[-1:], None if req.logprobs is None else req.logprobs[-1:],
                         req.finish_reason) for req in self._step()]

    def _step(self) -> list[_Req]:
        """Admit what fits, sleep `step_delay`, give every running request one token; those requests."""
        self._check_thread()
        self.steps += 1
        reserved = sum(len(r.prompt_ids) + r.params.max_tokens for r in self.running)
        prefill = 0
        while self.waiting and len(self.running) < self.max_running:
            need = len(self.waiting[0].prompt_ids) + self.waiting[0].params.max_tokens
            if reserved + need > self.full_total:
                break
            req = self.waiting.pop(0)
            reserved += need
            prefill += len(req.prompt_ids)
            self.stats.prompt_tokens_total += len(req.prompt_ids)
            self.running.append(req)
        if self.step_delay:
            time.sleep(self.step_delay * (1 + prefill / 256))
        advanced = list(self.running)
        for req in advanced:
            self._advance(req)
            if req.finish_reason is not None:
                self.running.remove(req)
        return advanced

    def _advance(self, req: _Req) -> None:
        p = req.params
        history = req.prompt_ids + req.output_ids
        h = zlib.crc32(bytes(t % 256 for t in history[-6:]) + len(history).to_bytes(4, "little"))
        greedy = h % len(ALPHABET)
        if greedy == len(ALPHABET) - 1 and len(req.output_ids) < 3:
            greedy = 0  # the toy model never stops in its first three tokens
        logits = [-float((i - greedy) % len(ALPHABET)) for i in range(len(ALPHABET))]
        if p.is_greedy:
            pick = greedy
        else:
            weights = [math.exp(v / p.temperature) for v in logits]
            pick = req.rng.choices(range(len(ALPHABET)), weights)[0]
        if p.ignore_eos and ALPHABET[pick] == EOS:
            pick = 0
        token = ALPHABET[pick]
        req.output_ids.append(token)
        self.stats.generation_tokens_total += 1
        if req.logprobs is not None:
            norm = math.log(sum(math.exp(v) for v in logits))
            ranked = sorted(range(len(ALPHABET)), key=lambda i: -logits[i])[: p.logprobs]
            req.logprobs.append({ALPHABET[i]: logits[i] - norm for i in {*ranked, pick}})
        req.detok.step(token)
        if req.detok.stopped or (token == EOS and not p.ignore_eos) or token in p.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None and not req.detok.stopped:
            req.detok.flush()


class FailingEngine(FakeEngine):
    """Raises from a step while a request whose prompt contains BOOM is running."""

    def _step(self) -> list[_Req]:
        if any(b"BOOM" in bytes(t % 256 for t in r.prompt_ids) for r in self.running):
            raise RuntimeError("simulated engine failure")
        return super()._step()


def one_replica_fails(marker: str, **kwargs: object) -> FakeEngine:
    """A FakeEngine for the first engine core that claims `marker` (a file path); every other core fails
    to start (ValueError), half a second later, when the first one is ready: a replica failing while
    another already runs."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        time.sleep(0.5)
        raise ValueError("this replica refuses to start") from None
    return FakeEngine(**kwargs)  # type: ignore[arg-type]
