"""GPU tests: refuse to run Triton kernels in the CPU interpreter on a CUDA machine (tests/kernels'
conftest sets TRITON_INTERPRET=1 unless SWASERVE_KERNEL_TESTS_ON_GPU=1), which would be slow and
would not test the compiled kernels."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _native_triton() -> None:
    if not torch.cuda.is_available():
        return
    from swaserve.kernels.decode_attention import _decode_stage1

    if type(_decode_stage1).__name__ == "InterpretedFunction":
        pytest.fail("Triton kernels were loaded in interpreter mode (TRITON_INTERPRET=1); run the GPU tests "
                    "with SWASERVE_KERNEL_TESTS_ON_GPU=1 or without tests/kernels in the same session")
