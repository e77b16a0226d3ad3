"""GrammarCompiler: a `StructuredOutputs` constraint -> an xgrammar grammar compiled for one tokenizer's
vocabulary, kept in an LRU; `check_constraint` parses one without the vocabulary (the 400 check)."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from typing import Any

from swaserve.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: ": the user needs only the reason.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _reason(e: Exception) -> str:
    return _LOG_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__


def build_grammar(spec: StructuredOutputs) -> Any:
    """The xgrammar `Grammar` for `spec` (no vocabulary needed); ValueError naming the field when it does
    not parse (an invalid schema, regex or EBNF)."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind == "json":
            ws = {"any_whitespace": False, "separators": (",", ":")} if spec.disable_any_whitespace else {}
            return xgr.Grammar.from_json_schema(json.dumps(spec.json), strict_mode=True, **ws)
        if kind == "json_object":
            if spec.disable_any_whitespace:
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                    separators=(",", ":"), strict_mode=False)
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            # One EBNF alternative per choice; JSON string escaping is EBNF's too (quotes, backslashes).
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice or [])
            return xgr.Grammar.from_ebnf(f"root ::= {alts}")
        return xgr.Grammar.from_ebnf(spec.grammar or "")
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}[kind]
        raise ValueError(f"structured_outputs.{kind}: invalid {what}: {_reason(e)}") from None


# xgrammar's vocabulary tables, one per (tokenizer, vocabulary size, stop ids) in this process: engines
# over the same tokenizer (tests' twin engines, a draft model's) build it once. Keys hold the tokenizer.
_VOCAB_TABLES: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}
_VOCAB_LOCK = threading.Lock()


def vocab_table(hf: Any, vocab_size: int, stop_ids: list[int]) -> Any:
    """xgrammar's `TokenizerInfo` of an HF tokenizer for logits `vocab_size` wide (built once)."""
    key = (id(hf), vocab_size, tuple(stop_ids))
    with _VOCAB_LOCK:
        entry = _VOCAB_TABLES.get(key)
        if entry is None or entry[0] is not hf:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_ids or None)
            entry = _VOCAB_TABLES[key] = (hf, info)
        return entry[1]


def check_constraint(spec: StructuredOutputs | dict[str, Any]) -> StructuredOutputs:
    """`spec` as a StructuredOutputs whose grammar parses (cheap: no vocabulary); ValueError otherwise."""
    spec = StructuredOutputs.coerce(spec)
    build_grammar(spec)
    return spec


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary and keeps the last `cache_size` compiled grammars
    (least recently used go first; compiled grammars are immutable and shared by every sequence that
    uses them). xgrammar's vocabulary table (`TokenizerInfo`, ~3 s for Gemma's 262k tokens on a CPU) is
    built on the first compile, not at start (once per tokenizer in a process). Thread-safe.

    `vocab_size` is the model's (the logits' width, which may exceed the tokenizer's); `stop_ids` the
    tokens that end a sequence (the grammar allows them where it may end)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], cache_size: int = 128):
        if cache_size < 1:
            raise ValueError(f"grammar_cache_size must be >= 1, got {cache_size}")
        self._hf = getattr(tokenizer, "hf", tokenizer)
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self.hits = 0
        self.misses = 0
        self.compile_seconds = 0.0  # total time spent compiling (cache misses)
        self.last_compile_seconds = 0.0
        self.vocab_seconds = 0.0  # building xgrammar's vocabulary table, once

    def _xgr_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            t0 = time.perf_counter()
            info = vocab_table(self._hf, self.vocab_size, self.stop_ids)
            # Our own LRU is the cache (bounded by entries, with counters); xgrammar's is off.
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            self.vocab_seconds = time.perf_counter() - t0
        return self._compiler

    def warm(self) -> None:
        """Build the vocabulary table now. A failure is logged: the first compile raises it again where a
        request sees it."""
        try:
            with self._lock:
                self._xgr_compiler()
        except Exception:
            logger.warning("building the structured-outputs vocabulary table failed", exc_info=True)

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of `spec` (an xgrammar `CompiledGrammar`), from the cache when it is
        there; ValueError when `spec` does not parse."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            compiler = self._xgr_compiler()
            t0 = time.perf_counter()
            compiled = compiler.compile_grammar(build_grammar(spec))
            self.last_compile_seconds = time.perf_counter() - t0
            self.compile_seconds += self.last_compile_seconds
            self.misses += 1
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    @staticmethod
    def idle_counters() -> dict[str, int]:
        """`counters()` of an engine that has compiled nothing yet."""
        return {"grammar_cache_hits_total": 0, "grammar_cache_misses_total": 0, "grammar_cache_entries": 0,
                "grammar_compile_ms_total": 0, "grammar_vocab_build_ms": 0}

    def counters(self) -> dict[str, int]:
        """The names `Engine.counters()` (and /metrics) export."""
        return {"grammar_cache_hits_total": self.hits, "grammar_cache_misses_total": self.misses,
                "grammar_cache_entries": len(self._cache),
                "grammar_compile_ms_total": int(self.compile_seconds * 1000),
                "grammar_vocab_build_ms": int(self.vocab_seconds * 1000)}
