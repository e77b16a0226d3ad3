"""MiMo-V2-Flash MTP on CUDA: the target's decode and verify steps and the MTP layer's chained decode and
catch-up extend steps all replay CUDA graphs; greedy tokens identical to plain decoding, every pool empty
after, and the layer's proposals against the plain-torch reference (fp32; Triton's dot products round
differently from torch's, so a near-tie may flip a rare proposal)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny HF families

from test_mimo_mtp_tiny import mtp_run

pytestmark = pytest.mark.gpu


def test_mimo_mtp_on_cuda(tmp_path):
    agree, total = mtp_run(tmp_path, "cuda")
    print(f"{agree}/{total} proposals equal the reference")
    assert agree >= 0.95 * total, f"{agree}/{total} proposals equal the reference"
