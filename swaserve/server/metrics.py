"""Server metrics: latency histograms and request counters, written as Prometheus text (format 0.0.4).

The frontend's event loop observes and renders. Engine gauges and totals come from the counters each
engine core sends with every step (`Engine.counters()` names: the keys of `LLM.stats()`), so
rendering never waits on the engine. With data parallelism the unlabelled engine samples are sums
over the replicas, and each engine family adds one sample per replica (`replica="i"`).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping, Sequence

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

# (snapshot key, metric name, type, help); `pool` keys become one metric with a label per pool.
_ENGINE_GAUGES = (
    ("running", "swaserve_requests_running", "gauge", "Requests the scheduler is running."),
    ("waiting", "swaserve_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    ("prompt_tokens_total", "swaserve_prompt_tokens_total", "counter", "Prompt tokens prefilled."),
    ("generation_tokens_total", "swaserve_generation_tokens_total", "counter", "Tokens generated."),
    ("retractions_total", "swaserve_retractions_total", "counter",
     "Requests retracted (freed and re-queued) when KV memory ran out."),
    ("prefix_cache_hit_tokens_total", "swaserve_prefix_cache_hit_tokens_total", "counter",
     "Prompt tokens whose K/V came from the prefix cache."),
    ("prefix_cache_miss_tokens_total", "swaserve_prefix_cache_miss_tokens_total", "counter",
     "Prompt tokens prefilled because the prefix cache had no usable K/V for them."),
    ("spec_draft_tokens_total", "swaserve_spec_draft_tokens_total", "counter",
     "Tokens proposed by the speculative drafter."),
    ("spec_accepted_tokens_total", "swaserve_spec_accepted_tokens_total", "counter",
     "Drafted tokens the target model accepted."),
    ("prompt_logprob_tokens_total", "swaserve_prompt_logprob_tokens_total", "counter",
     "Prompt positions scored for prompt logprobs / echo (extra LM-head rows; their prompts skip the prefix cache)."),
    ("grammar_cache_hits_total", "swaserve_grammar_cache_hits_total", "counter",
     "Structured-output constraints served from the compiled-grammar cache."),
    ("grammar_cache_misses_total", "swaserve_grammar_cache_misses_total", "counter",
     "Structured-output constraints compiled (not in the cache)."),
    ("grammar_compile_ms_total", "swaserve_grammar_compile_ms_total", "counter",
     "Milliseconds spent compiling grammars."),
    ("grammar_vocab_build_ms", "swaserve_grammar_vocab_build_ms", "gauge",
     "Milliseconds the structured-outputs vocabulary table took to build (0 until built; once per core)."),
    ("grammar_mask_fill_ms_total", "swaserve_grammar_mask_fill_ms_total", "counter",
     "Milliseconds the host spent filling structured outputs' allowed-token masks (mostly beside the step loop)."),
    ("grammar_mask_wait_ms_total", "swaserve_grammar_mask_wait_ms_total", "counter",
     "Milliseconds the step loop waited for structured outputs' masks to be filled."),
    ("grammar_masked_rows_total", "swaserve_grammar_masked_rows_total", "counter",
     "Rows sampled under a structured-output mask."),
    ("grammar_rejected_tokens_total", "swaserve_grammar_rejected_tokens_total", "counter",
     "Sampled tokens a structured-output grammar refused (0 unless a token escaped its mask: a bug)."),
    ("step_wait_ms_total", "swaserve_step_wait_ms_total", "counter",
     "Milliseconds the step loop waited for the device to return a step's tokens (near 0: the host is the limit)."),
)
_POOL_GAUGES = (
    ("used", "swaserve_kv_used_tokens", "KV slots in use, per pool."),
    ("cached", "swaserve_kv_cached_tokens", "KV slots held by the prefix cache and no running request, per pool."),
    ("total", "swaserve_kv_total_tokens", "KV slots in the pool, per pool."),
)


class Histogram:
    """A cumulative-bucket histogram. Invariant: `counts[i]` = observations <= `bounds[i]` (+Inf last)."""

    def __init__(self, name: str, help: str, bounds: Sequence[float]):
        self.name = name
        self.help = help
        self.bounds = tuple(bounds)
        assert list(self.bounds) == sorted(self.bounds), "histogram bounds must ascend"
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()  # observers and renderers may sit on different threads

    def observe(self, value: float, times: int = 1) -> None:
        if not math.isfinite(value):
            return
        i = bisect.bisect_left(self.bounds, value)  # the first bucket with value <= bound (a step's ITLs: ~40 a step)
        with self._lock:
            self._counts[i] += times
            self._sum += value * times

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.bounds, math.inf), counts):
            cumulative += count
            le = "+Inf" if bound == math.inf else _num(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{self.name}_sum {_num(total)}", f"{self.name}_count {cumulative}"]
        return lines


class ServerMetrics:
    """Everything /metrics shows that the engine itself does not count."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            "swaserve_time_to_first_token_seconds", "Time from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "swaserve_inter_token_latency_seconds", "Time between consecutive generated tokens.", ITL_BUCKETS
        )
        self.e2e = Histogram(
            "swaserve_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS
        )
        self._lock = threading.Lock()
        self._finished: dict[str, int] = {}  # finish reason -> count
        self._aborted = 0
        self._rejected = 0

    def count_finished(self, reason: str) -> None:
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1

    def count_aborted(self) -> None:
        with self._lock:
            self._aborted += 1

    def count_rejected(self) -> None:
        with self._lock:
            self._rejected += 1

    def render(self, snapshots: Sequence[Mapping[str, int | float]], model_name: str,
               in_flight: Sequence[int] = ()) -> str:
        """Prometheus text. `snapshots`: each replica's latest engine counters; `in_flight`: each
        replica's sub-requests in flight from this frontend. With one replica the engine families
        have only their unlabelled sample; with more, also one `replica="i"` sample each, and the
        unlabelled one is their sum (aggregate one or the other, not both)."""
        lines: list[str] = [
            "# HELP swaserve_model_info The model being served.",
            "# TYPE swaserve_model_info gauge",
            f'swaserve_model_info{{model="{_label(model_name)}"}} 1',
        ]
        total: dict[str, int | float] = {}
        for snap in snapshots:
            for key, value in snap.items():
                total[key] = total.get(key, 0) + value
        replicas = list(enumerate(snapshots)) if len(snapshots) > 1 else []
        for suffix, name, help in _POOL_GAUGES:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge"]
            for pool in ("full", "swa"):
                key = f"{pool}_tokens_{suffix}"
                lines.append(f'{name}{{pool="{pool}"}} {_num(total.get(key, 0))}')
                lines += [f'{name}{{pool="{pool}",replica="{i}"}} {_num(snap.get(key, 0))}'
                          for i, snap in replicas]
        for key, name, kind, help in _ENGINE_GAUGES:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {_num(total.get(key, 0))}"]
            lines += [f'{name}{{replica="{i}"}} {_num(snap.get(key, 0))}' for i, snap in replicas]
        name = "swaserve_replica_requests_in_flight"
        lines += [(f"# HELP {name} Engine requests (one per choice) sent to the replica and not yet ended; "
                   "a new request goes to the replica with the fewest."), f"# TYPE {name} gauge"]
        lines += [f'{name}{{replica="{i}"}} {count}' for i, count in enumerate(in_flight)]
        with self._lock:
            finished, aborted, rejected = dict(self._finished), self._aborted, self._rejected
        name = "swaserve_requests_finished_total"
        lines += [f"# HELP {name} Requests finished, by finish reason.", f"# TYPE {name} counter"]
        for reason in sorted({"stop", "length", *finished}):
            lines.append(f'{name}{{finish_reason="{_label(reason)}"}} {finished.get(reason, 0)}')
        lines += [
            "# HELP swaserve_requests_aborted_total Requests aborted (client gone, or shutdown).",
            "# TYPE swaserve_requests_aborted_total counter",
            f"swaserve_requests_aborted_total {aborted}",
            "# HELP swaserve_requests_rejected_total Requests the engine refused (bad input).",
            "# TYPE swaserve_requests_rejected_total counter",
            f"swaserve_requests_rejected_total {rejected}",
        ]
        for hist in (self.ttft, self.itl, self.e2e):
            lines += hist.render()
        return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
