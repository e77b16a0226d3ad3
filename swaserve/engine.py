"""Engine: add_request / step / abort over the scheduler, runner and sampler (offline `LLM`: llm.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import secrets
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self

from swaserve.admission import check_options, prompt_ids
from swaserve.config import split_engine_options
from swaserve.detokenizer import IncrementalDetokenizer
from swaserve.engine_setup import default_overlap, load_engine_model, release_engine, resolve_device_dtype
from swaserve.engine_stats import EngineStats, engine_counters, kv_cache_dtypes, memory_stats
from swaserve.grammar import GrammarCompiler, SequenceGrammar, accept_later, accept_tokens
from swaserve.launched_step import LaunchedStep
from swaserve.launcher import StepLauncher
from swaserve.loader import LoadedModel
from swaserve.model_config import ModelConfig
from swaserve.request import RequestOutput, SamplingParams
from swaserve.request_group import RequestGroup, SeqDelta, group_outputs, seq_deltas
from swaserve.scheduler.req import Req, ReqStatus

if TYPE_CHECKING:
    from swaserve.distributed.lead import TensorParallel


class Engine:
    """Continuous-batching engine over one model. Not thread-safe: one thread drives it.

    `step()` launches one scheduler step (a chunked-prefill batch or a decode batch) and returns
    the cumulative outputs of every request that got a new token in the step it completed. With
    overlap (the default on a GPU) that is the step launched by the previous call: the host
    schedules step N+1 while the device runs step N, and no step waits on the host in between.
    """

    def __init__(self, model: str | LoadedModel | None = None, device: Any = None, dtype: Any = None,
                 chat_template: str | None = None, detokenize: bool = True, **engine_options: Any):
        """`model`: None (embedded Gemma 3 270M), a GGUF file or HF directory path, or an already
        built `LoadedModel` (benchmarks with random weights; its tokenizer may be None, and then
        prompts must be token ids). `chat_template`: Jinja text replacing the model's (its turn-end
        tokens stop generation). `detokenize=False`: outputs carry token ids only and stop strings
        are the caller's business (the server's engine core: its frontend detokenizes).
        `engine_options`: fields of the cache, scheduler and runner configs (`swaserve.config`),
        e.g. `max_running_requests=128, overlap_schedule=False`."""
        from swaserve.runtime import build_runtime

        cache_cfg, sched_cfg, runner_cfg, par_cfg, spec_cfg = split_engine_options(engine_options)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches on the current device (a replica on cuda:1)
        if spec_cfg.speculative_method is not None:
            from swaserve.speculative.setup import check_speculation

            check_speculation(spec_cfg, runner_cfg, par_cfg.tensor_parallel_size)
        self.tp: TensorParallel | None = None
        if par_cfg.tensor_parallel_size > 1:
            from swaserve.distributed.lead import TensorParallel

            if isinstance(model, LoadedModel):
                raise ValueError("tensor parallelism loads each rank's shard itself: give a model path (or None), "
                                 "not a LoadedModel")
            self.tp = TensorParallel.start(par_cfg, model, self.device, self.dtype, engine_options)
            self.device = self.tp.device
        try:
            loaded, config = load_engine_model(model, self.device, self.dtype, sched_cfg, runner_cfg)
            self.model_config: ModelConfig = config
            self.tokenizer = loaded.tokenizer
            if chat_template is not None and self.tokenizer is not None:
                self.tokenizer = self.tokenizer.with_chat_template(chat_template)
            self.detokenize = detokenize
            self.model_name = loaded.name
            tok_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
            self.eos_ids = frozenset(tok_eos) | frozenset(config.eos_token_ids)
            drafter = None
            sizing = None
            if spec_cfg.speculative_method is not None:
                from swaserve.runtime import size_runtime
                from swaserve.speculative.setup import build_drafter_for

                # The drafter sizes its own cache for the target's running limit: choose it first.
                _, sizing = size_runtime(config, self.device, self.dtype, cache_cfg, sched_cfg)
                sched_cfg = sizing.sched
                drafter = build_drafter_for(spec_cfg, config, self.device, self.dtype, sched_cfg,
                                            runner_cfg.load_format, self.tp is not None)
            rt = build_runtime(config, loaded.model, self.device, self.dtype, cache_cfg, sched_cfg, runner_cfg,
                               start=drafter is None)
            self.plan, self.allocator, self.runner, self.scheduler = rt.plan, rt.allocator, rt.runner, rt.scheduler
            # What was chosen for the options left unset, and why (the startup line of `swaserve serve`).
            self.sizing = sizing or rt.sizing
            self._runtime = rt
            self.launcher = StepLauncher(self.runner, self.tp.lead(rt) if self.tp is not None else None)
            self.launcher.grammar_threads = runner_cfg.grammar_threads
            overlap = runner_cfg.overlap_schedule
            self.overlap = default_overlap(self.device) if overlap is None else bool(overlap)
            if drafter is not None:
                from swaserve.speculative.setup import start_speculation

                self.overlap = False
                self.scheduler.speculation = start_speculation(rt, self.launcher, drafter, spec_cfg, runner_cfg,
                                                               self.tp is not None)
        except BaseException:
            if self.tp is not None:  # the ranks started: stop them now, not at garbage collection
                self.tp.close()
            raise
        self.stats = EngineStats()
        self.grammars: GrammarCompiler | None = None  # structured outputs: made on the first constrained request
        self._grammar_cache_size = runner_cfg.grammar_cache_size
        self.closed = False
        # Holds the attribute dict, not the engine: dropping the engine runs it (`release_engine`).
        self._release = weakref.finalize(self, release_engine, self.__dict__, self.device)
        self._groups: dict[str, RequestGroup] = {}
        self._inflight: LaunchedStep | None = None  # launched, results not yet processed (overlap)
        # Overlap: xgrammar accepts constrained rows' tokens on the mask worker (`accept_later`); False: A/B runs
        self.accept_on_worker = True
        self.last_step: tuple[str, int, int] | None = None  # (mode, requests, new tokens) of the last launch

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; raises ValueError (and queues nothing) if it is invalid or can never fit."""
        self._check_open()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = prompt_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        check_options(params, self.model_config.vocab_size, self.tp is not None)
        if self.runner.deterministic and params.seed is None and not params.is_greedy:
            # Deterministic mode: every draw is reproducible; the seed is reported for a resend.
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        compiled = self._compile_constraint(params) if params.structured_outputs is not None else None
        group = RequestGroup(text, ids, seed=params.seed)
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None and self.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop)
            req = Req(f"{request_id}#{i}", request_id, i, len(ids), list(ids), params, 0, self.eos_ids, detok)
            if compiled is not None:
                req.grammar = SequenceGrammar(compiled, sorted(self.eos_ids | set(params.stop_token_ids or ())))
            group.reqs.append(req)
        for r in group.reqs:
            self.scheduler.add(r)
        self._groups[request_id] = group
        self.stats.prompt_tokens_total += len(ids)

    def _compile_constraint(self, params: SamplingParams) -> Any:
        """The compiled grammar of `params.structured_outputs` (cached); ValueError when it does not parse.
        Compiling runs here, in the engine's thread: a new schema holds the step loop for its compile time
        (tens of ms; `grammar_compile_ms_total`), a cached one costs a lookup."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        assert params.structured_outputs is not None
        return self._grammar_compiler().compile(params.structured_outputs)  # type: ignore[arg-type]

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_ids),
                                            self._grammar_cache_size)
        return self.grammars

    def warm_grammars(self) -> None:
        """Build xgrammar's vocabulary table now (2-3 s for a 262k vocabulary on a CPU), so that the first
        constrained request compiles only its schema instead of holding the step loop, and every stream in
        it, for the table too. The server's engine core calls this before it reports ready (built in a
        thread beside the serving loop instead, it held the GIL in stretches of up to 0.4 s while the first
        requests ran). Nothing without a tokenizer or without xgrammar."""
        if self.tokenizer is not None and not self.closed and importlib.util.find_spec("xgrammar") is not None:
            self._grammar_compiler().warm()

    def abort(self, request_id: str) -> None:
        if self.closed:
            return
        if self._groups.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    def check_integrity(self) -> None:
        """The scheduler's invariants (request table, both pools, prefix cache) and, under tensor
        parallelism, that every rank's device tables equal rank 0's."""
        self.scheduler.check_integrity()
        if self.tp is not None:
            self.tp.check_tables(self._runtime)

    def close(self) -> None:
        """Release what the engine holds, idempotently: the other tensor-parallel ranks stop (and free
        their devices) and the process groups go; this process's pools, graphs and model weights are
        dropped and their device memory handed back. The engine takes no more requests. Garbage
        collection of the engine does the same."""
        self._release()
        self.closed, self.tp = True, None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed")

    def has_unfinished(self) -> bool:
        if self.closed:
            return False
        return self.scheduler.has_unfinished() or self._inflight is not None

    # -- stepping ----------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step; outputs of the requests it advanced. `finished_only`: only of those it finished
        (offline: ~0.55 of a ~1.5 ms host step at 256 requests, CPU, benchmarks/host_step.py; streams need all)."""
        done = self._advance()
        return self._process(done, finished_only) if done is not None else []

    def _advance(self) -> LaunchedStep | None:
        """Schedule and launch the next step; the launched step whose results are due now (with
        overlap the previous one, so the host schedules step N+1 while the device runs step N)."""
        deferred = self._inflight if self._inflight is not None and self._inflight.deferred is not None else None
        if deferred is not None and not self.accept_on_worker:
            self.launcher.sample_deferred(deferred)
        batch = self.scheduler.schedule()
        if deferred is not None and self.accept_on_worker:
            # Overlap with constrained rows: the step in flight samples once the next step is scheduled (its
            # masks fill on the worker meanwhile, `_commit`), before the next model launch reads its tokens.
            self.launcher.sample_deferred(deferred)
        launched = self.launcher.launch(batch) if batch is not None else None
        self.last_step = (batch.kind, len(batch.reqs), batch.num_tokens) if batch is not None else None
        if self.overlap:
            done, self._inflight = self._inflight, launched
            return done
        return launched

    def step_deltas(self) -> list[SeqDelta]:
        """`step()` reporting only what the step added: per advanced sequence its new token (and
        logprobs), O(1) each, no RequestOutput built. The engine core's loop (one message a step)."""
        done = self._advance()
        if done is None:
            return []
        return seq_deltas(self._commit(done), self._groups)

    def _commit(self, step: LaunchedStep) -> list[Req]:
        """Wait for a launched step and commit its tokens; the sequences it advanced."""
        start = time.perf_counter()
        tokens, logprobs = step.wait()
        self.stats.step_wait_seconds += time.perf_counter() - start
        nxt = self._inflight if self._inflight is not None and self._inflight.deferred is not None else None
        pending = None
        if step.constrained:  # the grammars first: the next step's masks depend on nothing else
            done = ReqStatus.FINISHED  # (`r.finished` inlined: a property call a row)
            grammars = [None if r.status is done else r.grammar for r in step.reqs]  # (None: skipped)
            if nxt is not None and self.accept_on_worker:
                pending = accept_later(grammars, tokens)
            else:
                self.stats.grammar_rejected += accept_tokens(grammars, tokens)
        if nxt is not None:
            # Overlap with constrained rows: the next step's model is running; a worker thread accepts the tokens
            # (`pending`) and fills its masks until it samples (`_advance`), while this step commits. (Requests
            # compare by identity: `nxt.reqs == step.reqs` is one C loop.)
            self.launcher.start_masks(nxt, pending, same_rows=pending is not None and nxt.reqs == step.reqs)
        if step.prompt is not None:  # before the tokens: a request's first delta carries its prompt logprobs
            step.prompt.record()
        progressed = self.scheduler.process_output(step.batch, tokens, logprobs)
        self.stats.retractions_total = self.scheduler.retractions_total
        if nxt is not None:
            self.launcher.prepare_deferred(nxt)
        for r in progressed:
            if r.finish_reason is not None and r.detok is not None and not r.detok.stopped:
                r.detok.flush()
        return progressed

    def _process(self, step: LaunchedStep, finished_only: bool = False) -> list[RequestOutput]:
        progressed = self._commit(step)
        if finished_only:
            return group_outputs({r.group_id for r in progressed if r.finish_reason is not None}, self._groups, True)
        return group_outputs({r.group_id for r in progressed}, self._groups)

    def counters(self) -> dict[str, int]:
        """`memory_stats()` plus the token, retraction, prefix-cache, speculation and structured-output
        totals: the names /metrics exports (`engine_stats.engine_counters`)."""
        return engine_counters(self)

    def kv_cache_dtypes(self) -> dict[str, str]:
        """Each pool's K/V storage dtype by name: e.g. {"full": "fp8_e4m3", "swa": "bfloat16"} (`engine_stats`)."""
        return kv_cache_dtypes(self.plan)

    def startup_line(self) -> str:
        """The values chosen for the options left unset and why, and the KV pools: one line."""
        return f"{self.sizing.line()}; KV cache {self.plan.describe()}"

    def memory_stats(self) -> dict[str, int]:
        """Per pool: used, cached and total KV slots, each pool's storage width, running / waiting
        requests and retractions (`engine_stats.memory_stats`)."""
        return memory_stats(self)
