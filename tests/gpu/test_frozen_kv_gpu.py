"""The frozen-KV MTP drafter on CUDA (target decode in CUDA graphs, the assistant on the Triton backend
over the target's pools): greedy tokens identical to plain decoding, pools empty after, and the
proposals against HF's assistant on the CPU (fp32; Triton's dot products round differently, so a
near-tie may flip a rare proposal). The drafting chain replays the drafter's own CUDA graphs
(`FrozenKVGraphRunner`): their drafts equal the eager chain's while the batch shrinks and grows, and
they leave the target's pools untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny HF families

from test_frozen_kv_graph import K, decoding_engine, graph_vs_eager
from test_frozen_kv_tiny import mtp_run

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,copying,ordered", [("gemma4_ple", False, False), ("gemma4", True, True)])
def test_frozen_kv_on_cuda(family, copying, ordered, tmp_path):
    agree, total, c = mtp_run(family, copying, ordered, tmp_path, "cuda")
    print(f"{family}: {agree}/{total} proposals equal HF's; accepted {c['spec_accepted_tokens_total']}"
          f"/{c['spec_draft_tokens_total']}")
    assert agree >= 0.95 * total, f"{agree}/{total} proposals equal HF's"
    assert c["spec_draft_tokens_total"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_frozen_kv_graphs_equal_eager_chain(tmp_path):
    """fp32: the graphs' drafts equal the eager chain's exactly (4 -> 3 -> 1 -> 2 -> 3 -> 4 requests);
    free slots poisoned with NaN stay NaN, live K/V, the table and full_to_swa unchanged."""
    engine, reqs, _, _ = decoding_engine(tmp_path, "cuda")
    assert engine.runner.graph_runner is not None  # the target decodes in CUDA graphs
    runner = engine.scheduler.speculation.drafter.graphs
    assert runner is not None and runner.capture and runner.steps == K
    assert runner.sizes == [1, 2, 4] and sorted(runner.graphs) == runner.sizes  # max_running_requests 4
    graph_vs_eager(engine, reqs, runner)
