"""ModelRunner.warmup (run at start on a GPU, so the first requests do not pay the kernels' JIT
compiles): its dummy forwards touch only the dummy KV slot and table row 0, so requests already
in flight decode exactly as they would have without it."""

from __future__ import annotations

import pytest
import torch
from families import make_hf_model

pytest.importorskip("triton")

from scheduled import Params  # noqa: E402
from scheduled import small_hybrid_runtime  # noqa: E402

from swaserve.scheduler.req import Req  # noqa: E402


def _state(rt) -> list[torch.Tensor]:
    """Everything a request's KV lives in, minus the dummy slot and table row 0."""
    pools = [rt.kv.full] + ([rt.kv.swa] if rt.kv.swa is not None else [])
    bufs = [b[1:].clone() for p in pools for layer in range(p.num_layers) for b in (p.k_buffer(layer), p.v_buffer(layer))]
    return bufs + [rt.req_to_token.req_to_token[1:].clone(), rt.runner.last_tokens[1:].clone()]


def _step(rt, tokens_from=None) -> tuple[torch.Tensor, list[int]]:
    b = rt.scheduler.schedule()
    logits = rt.runner.forward(b.to_forward_batch("cpu", host_decode_inputs=True))
    idx = b.sample_indices()
    tokens = tokens_from if tokens_from is not None else (logits[idx].argmax(-1).tolist() if idx else [])
    rt.scheduler.process_output(b, tokens)
    rt.scheduler.check_integrity()
    return logits, tokens


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_warmup_mid_run_changes_no_request_state(tmp_path, backend):
    make_hf_model("gemma3", tmp_path, seed=3)
    warmed, plain = small_hybrid_runtime(tmp_path, backend), small_hybrid_runtime(tmp_path, backend)
    assert warmed.kv.swa is not None, "hybrid pools: both index spaces exercised"
    prompts = [list(range(3, 23)), list(range(40, 45))]
    for rt in (warmed, plain):
        for i, p in enumerate(prompts):
            rt.scheduler.add(Req(f"r{i}", f"r{i}", 0, len(p), list(p), Params(10), 0, frozenset()))
    for _ in range(5):  # through chunked prefill into decode
        _, tokens = _step(plain)
        _step(warmed, tokens)
    before = _state(warmed)
    warmed.runner.warmup()
    for a, b in zip(before, _state(warmed)):
        assert torch.equal(a, b)
    warmed.scheduler.check_integrity()
    while plain.scheduler.has_unfinished():
        ref, tokens = _step(plain)
        got, _ = _step(warmed, tokens)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
