"""FastLaunch on CUDA: repeat launches through the compiled kernel's launcher give the same bits as
Triton's own launch, a signature Triton specialises differently (a tensor off 16-byte alignment,
another window) gets its own compiled kernel, and the fast path is really taken."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import swaserve.kernels.launch as launch  # noqa: E402
from swaserve.kernels import decode_attention, extend_attention  # noqa: E402
from swaserve.kernels.decode_attention import _stage1_launch  # noqa: E402
from swaserve.kernels.extend_attention import _extend_launch  # noqa: E402

pytestmark = pytest.mark.gpu

H, HKV, D, SLOTS = 4, 1, 256, 4096


def _inputs(misaligned: bool):
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    ext, prefix = [1, 1, 1, 37], [300, 500, 90, 0]
    T = sum(ext)

    def rand(*shape, offset=0):
        flat = torch.randn(offset + torch.Size(shape).numel(), generator=g, device=dev).to(torch.bfloat16)
        return flat[offset:].view(*shape)

    q = rand(T, H, D, offset=1 if misaligned else 0)  # 2-byte offset: not 16-byte aligned
    k_new, v_new = rand(T, HKV, D), rand(T, HKV, D)
    k_buf, v_buf = rand(SLOTS, HKV, D), rand(SLOTS, HKV, D)
    qo = torch.tensor([0, *torch.tensor(ext).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    kv_ptr = torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    idx = torch.randint(1, SLOTS, (sum(prefix),), generator=g, device=dev, dtype=torch.int32)
    plen = torch.tensor(prefix, dtype=torch.int32, device=dev)
    return q, k_new, v_new, k_buf, v_buf, qo, kv_ptr, idx, plen, max(ext)


def _extend(inp, window):
    q, k_new, v_new, k_buf, v_buf, qo, kv_ptr, idx, plen, max_ext = inp
    out = torch.empty_like(q)
    return extend_attention(q, k_new, v_new, out, k_buf, v_buf, qo, kv_ptr, idx, plen, 0.0625,
                            max_extend_len=max_ext, window=window)


def _decode(inp, splits):
    q, _, _, k_buf, v_buf, _, kv_ptr, idx, _, _ = inp
    out = torch.empty(3, H, D, device=q.device, dtype=q.dtype)
    return decode_attention(q[:3], k_buf, v_buf, kv_ptr[:4], idx, out, 0.0625, num_kv_splits=splits)


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("window", [None, 1, 16, 100])
def test_fast_launch_matches_triton_launch(monkeypatch, misaligned, window):
    inp = _inputs(misaligned)
    monkeypatch.setattr(launch, "ENABLED", False)
    ref_ext, ref_dec = _extend(inp, window), _decode(inp, 4)
    monkeypatch.setattr(launch, "ENABLED", True)
    for _ in range(3):  # the first launch of a new signature goes through Triton, the rest do not
        got_ext, got_dec = _extend(inp, window), _decode(inp, 4)
        assert torch.equal(got_ext, ref_ext) and torch.equal(got_dec, ref_dec)
    torch.cuda.synchronize()
    signatures = {k[3][0] for k in _extend_launch._compiled}  # q's (dtype, aligned)
    assert (torch.bfloat16, not misaligned) in signatures


def test_fast_path_is_taken_and_keys_split_on_alignment(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    _extend_launch._compiled.clear()
    aligned, misaligned = _inputs(False), _inputs(True)
    _extend(aligned, None)
    assert len(_extend_launch._compiled) == 1
    (compiled,) = _extend_launch._compiled.values()
    assert compiled, "Triton's compiled kernel exposes the launcher interface"
    seen = []
    run = compiled.run
    monkeypatch.setattr(compiled, "run", lambda *a: (seen.append(1), run(*a)))
    first = _extend(aligned, None).clone()
    assert seen == [1], "a repeat launch takes the fast path"
    _extend(misaligned, None)
    assert len(_extend_launch._compiled) == 2 and seen == [1], "another alignment: Triton's path, a new entry"
    assert torch.equal(_extend(aligned, None), first)
