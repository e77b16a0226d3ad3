"""The frozen-KV MTP drafter on CUDA (target decode in CUDA graphs, the assistant on the Triton backend
over the target's pools): greedy tokens identical to plain decoding, pools empty after, and the
proposals against HF's assistant on the CPU (fp32; Triton's dot products round differently, so a
near-tie may flip a rare proposal)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny HF families

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
