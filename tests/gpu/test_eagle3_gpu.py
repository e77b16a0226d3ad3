"""EAGLE-3 on CUDA (decode graphs of the target capture its auxiliary states; the head runs on the
Triton backend): greedy tokens identical to plain decoding with accepted and rejected drafts, pools
empty after, and the head's proposals against the CPU reference (fp32; Triton's dot products round
differently, so a near-tie may flip a rare proposal)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny HF families

from test_eagle3_tiny import eagle3_run  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eagle3_on_cuda(family, tmp_path):
    agree, total = eagle3_run(family, tmp_path, "cuda")
    print(f"{family}: {agree}/{total} proposals equal the CPU reference")
    assert agree >= 0.95 * total, f"{agree}/{total} proposals equal the reference"
