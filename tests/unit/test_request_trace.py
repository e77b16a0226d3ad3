"""RequestTrace: one line per request at its first token, nothing when off, forgotten requests never
written; and the benchmark's join of the traces with client timings."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from swaserve.core.request_trace import ENV, RequestTrace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import ttft_breakdown  # noqa: E402


def test_off_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    trace = RequestTrace("core1")
    trace.arrived("a", 1.0)
    trace.first_token("a", 2.0)
    assert not trace.enabled and not list(tmp_path.iterdir())


def test_first_token_once_and_forget(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path / "req"))
    trace = RequestTrace("frontend0")
    trace.arrived("a", 1.0, 1.25)
    trace.arrived("b", 1.5)
    trace.first_token("a", 2.0)
    trace.first_token("a", 3.0)  # later tokens are not first tokens
    trace.forget("b")  # aborted before its first token
    trace.first_token("b", 4.0)
    trace.close()
    lines = [json.loads(x) for x in (tmp_path / "req.frontend0").read_text().splitlines()]
    assert lines == [["a", 1.0, 1.25, 2.0]]


def test_served_breakdown_joins_processes(tmp_path):
    prefix = str(tmp_path / "req")
    (tmp_path / "req.frontend0").write_text(json.dumps(["cmpl-x-0", 10.001, 10.0015, 10.020]) + "\n")
    (tmp_path / "req.core77").write_text(json.dumps(["cmpl-x-0", 10.003, 10.019]) + "\n")
    client = SimpleNamespace(rid="cmpl-x", arrival=10.0, first=10.022)
    lost = SimpleNamespace(rid="cmpl-y", arrival=10.0, first=10.5)  # not in the traces: left out
    stages = ttft_breakdown.served([client, lost], prefix)
    got = [round(v[0] * 1000, 3) for v in stages.values()]
    assert got == [1.0, 0.5, 1.5, 16.0, 1.0, 2.0, 6.0]  # the stages, then TTFT (22) less the engine's 16
