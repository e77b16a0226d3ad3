"""Sampler on CPU: greedy, truncation, temperature distributions, penalties, seeds and logprobs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from swaserve.request import SamplingParams
from swaserve.runner.sampler import Sampler
from swaserve.runner.sampling_batch import SamplingBatch

V = 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sample(logits: torch.Tensor, params: list[SamplingParams], outputs=None, prompts=None):
    bs = len(params)
    outputs = outputs or [[] for _ in range(bs)]
    prompts = prompts or [[] for _ in range(bs)]
    batch = SamplingBatch.build(params, outputs, prompts, logits.shape[1], logits.device)
    return Sampler()(logits, batch)


def test_greedy_is_argmax_and_leaves_rng_and_logits_alone() -> None:
    logits = torch.randn(8, V)
    logits[3, [5, 9]] = 100.0  # tie: lowest index wins
    before = logits.clone()
    rng = torch.get_rng_state()
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(out.next_token_ids, logits.argmax(-1)) and out.next_token_ids[3] == 5
    assert torch.equal(torch.get_rng_state(), rng)  # all-greedy batches draw no noise
    assert torch.equal(logits, before)
    assert out.top_logprob_ids is None


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_sampled_rows(device: str) -> None:
    logits = torch.randn(6, V, device=device)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, seed=i) for i in range(6)]
    out = _sample(logits, params)
    assert torch.equal(out.next_token_ids[::2], logits[::2].argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=1e-7),
        SamplingParams(temperature=3.0, top_k=1, top_p=0.5, min_p=0.2),
    ],
    ids=["top_k=1", "top_p_tiny", "min_p=1", "tiny_temperature", "combined"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_settings_equal_greedy(params: SamplingParams, device: str) -> None:
    logits = torch.randn(32, V, device=device) * 3
    out = _sample(logits, [params] * 32)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


PROBS = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])


def _freqs(params: SamplingParams, device: str, n: int = 20000) -> torch.Tensor:
    logits = PROBS.log().expand(n, -1).contiguous().to(device)
    out = _sample(logits, [params] * n)
    return torch.bincount(out.next_token_ids.cpu(), minlength=PROBS.numel()).float() / n


def _renorm(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), PROBS),
        (SamplingParams(temperature=2.0), _renorm(PROBS**0.5)),
        (SamplingParams(temperature=0.5), _renorm(PROBS**2)),
        (SamplingParams(top_k=2), _renorm(PROBS * torch.tensor([1, 1, 0, 0, 0]))),
        # mass above 0.25 is 0.5 < 0.7 (kept); mass above 0.15 is 0.75 (dropped)
        (SamplingParams(top_p=0.7), _renorm(PROBS * torch.tensor([1, 1, 0, 0, 0]))),
        (SamplingParams(top_p=0.8), _renorm(PROBS * torch.tensor([1, 1, 1, 0, 0]))),
        # p >= 0.3 * 0.5 keeps 0.5, 0.25, 0.15
        (SamplingParams(min_p=0.3), _renorm(PROBS * torch.tensor([1, 1, 1, 0, 0]))),
        # top-p runs on the top-k renormalised distribution (0.67, 0.33): only token 0 survives 0.6;
        # on the full distribution token 1 would survive too (mass above it 0.5 < 0.6)
        (SamplingParams(top_k=2, top_p=0.6), torch.tensor([1.0, 0, 0, 0, 0])),
    ],
    ids=["plain", "t=2", "t=0.5", "top_k=2", "top_p=0.7", "top_p=0.8", "min_p=0.3", "top_k+top_p"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_empirical_distribution(params: SamplingParams, expected: torch.Tensor, device: str) -> None:
    freqs = _freqs(params, device)
    # std of a frequency is <= sqrt(0.25 / 20000) = 0.0035; 0.015 is over 4 sigma
    assert torch.allclose(freqs, expected.float(), atol=0.015), (freqs, expected)


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
PROMPT, OUTPUT = [[0]], [[1, 1, 3]]


@pytest.mark.parametrize(
    ("penalties", "expected"),
    [
        # seen = {0 (prompt), 1, 3 (output)}: positive logits divided, negative multiplied
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.5, 1.5, -2.0]),
        ({"repetition_penalty": 0.5}, [4.0, -0.5, 0.5, 6.0, -2.0]),
        # output counts: token 1 twice, token 3 once; prompt tokens do not count
        ({"frequency_penalty": 0.5}, [2.0, -2.0, 0.5, 2.5, -2.0]),
        ({"presence_penalty": 0.25}, [2.0, -1.25, 0.5, 2.75, -2.0]),
        ({"presence_penalty": -1.0}, [2.0, 0.0, 0.5, 4.0, -2.0]),
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
            [1.0, -3.25, 0.5, 0.75, -2.0],
        ),
    ],
    ids=["rep=2", "rep=0.5", "freq", "presence", "presence<0", "all"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_penalties(penalties: dict[str, float], expected: list[float], device: str) -> None:
    # Row 0 is penalised; row 1 has the same history but no penalty and must be untouched.
    penalised = SamplingParams(temperature=0.0, logprobs=5, **penalties)
    plain = SamplingParams(temperature=0.0, logprobs=5)
    out = _sample(LOGITS.repeat(2, 1).to(device), [penalised, plain], OUTPUT * 2, PROMPT * 2)
    out = type(out)(*(t.cpu() for t in out))
    want = torch.tensor([expected, LOGITS[0].tolist()])
    assert torch.equal(out.next_token_ids, want.argmax(-1))
    ref = torch.log_softmax(want, -1)
    got = torch.full_like(ref, float("nan")).scatter(1, out.top_logprob_ids, out.top_logprob_vals)
    assert torch.allclose(got, ref, atol=1e-6)


def _run_steps(rows: list[tuple[SamplingParams, torch.Tensor]], steps: int, device: str) -> list[list[int]]:
    """Decode `steps` tokens for every row; row i's logits at step s are rows[i][1][s]."""
    outputs: list[list[int]] = [[] for _ in rows]
    prompts = [[1, 2, 3] for _ in rows]
    for s in range(steps):
        logits = torch.stack([lg[s] for _, lg in rows]).to(device)
        batch = SamplingBatch.build([p for p, _ in rows], outputs, prompts, V, device)
        for out, tok in zip(outputs, Sampler()(logits, batch).next_token_ids.tolist()):
            out.append(tok)
    return outputs


@pytest.mark.parametrize("device", DEVICES)
def test_seed_is_independent_of_batch_position_and_neighbours(device: str) -> None:
    steps = 8
    gen = torch.Generator().manual_seed(1)
    target_params = SamplingParams(temperature=1.2, top_k=40, top_p=0.95, seed=1234)
    target = (target_params, torch.randn(steps, V, generator=gen))
    alone = _run_steps([target], steps, device)[0]

    def neighbour(i: int) -> tuple[SamplingParams, torch.Tensor]:
        kinds = [
            SamplingParams(temperature=0.7, seed=99 + i),
            SamplingParams(temperature=1.0),  # unseeded: default generator
            SamplingParams(temperature=0.0),
            SamplingParams(min_p=0.1, top_k=5, repetition_penalty=1.3, logprobs=3),
        ]
        return kinds[i % len(kinds)], torch.randn(steps, V, generator=gen)

    for position, others in [(0, 3), (2, 5), (6, 6)]:
        rows = [neighbour(i) for i in range(others)]
        rows.insert(position, target)
        assert _run_steps(rows, steps, device)[position] == alone

    # A seeded request is also reproducible when recomputed from a later step (retract/recompute):
    # its randomness depends only on (seed, tokens generated so far).
    batch = SamplingBatch.build([target[0]], [alone[:5]], [[1, 2, 3]], V, device)
    assert Sampler()(target[1][5:6].to(device), batch).next_token_ids.item() == alone[5]


def test_tokens_still_in_flight_count_like_seen_ones() -> None:
    """Overlap scheduling: the host may not have a row's previous token yet. Passing it on the
    device (`unseen_tokens`) and the step index explicitly gives what the full host history gives."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 64, generator=gen)
    params = [SamplingParams(temperature=0.8, seed=4, frequency_penalty=1.5, presence_penalty=0.5,
                             repetition_penalty=1.4),
              SamplingParams(temperature=0.8, seed=9, frequency_penalty=1.0)]
    outs, prompts = [[3, 7, 7], [1, 2]], [[5, 6], [8]]
    full = SamplingBatch.build(params, outs, prompts, 64, "cpu")
    partial = SamplingBatch.build(params, [[3, 7], [1, 2]], prompts, 64, "cpu", step_indices=[3, 2],
                                  unseen_tokens=torch.tensor([7, -1]))
    assert torch.equal(full.output_counts, partial.output_counts)
    assert full.seeded_rows == partial.seeded_rows
    assert torch.equal(Sampler()(logits, full).next_token_ids, Sampler()(logits, partial).next_token_ids)


def test_different_seeds_and_sample_indices_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any dependence on the seed shows
    tokens = set()
    for seed, index in [(1, 0), (2, 0), (1, 1), (3, 0)]:
        params = [SamplingParams(seed=seed)]
        batch = SamplingBatch.build(params, [[]], [[]], 1000, "cpu", sample_indices=[index])
        tokens.add(Sampler()(logits, batch).next_token_ids.item())
    assert len(tokens) == 4
    # Same seed, same step: same token
    a = _sample(logits, [SamplingParams(seed=1)]).next_token_ids
    b = _sample(logits.repeat(3, 1), [SamplingParams(seed=7), SamplingParams(), SamplingParams(seed=1)])
    assert a.item() == b.next_token_ids[2].item()


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_match_log_softmax_and_include_sampled_token(device: str) -> None:
    logits = torch.randn(4, V, device=device) * 2
    params = [
        SamplingParams(logprobs=3, temperature=0.8, seed=0),
        SamplingParams(logprobs=0, seed=1),
        SamplingParams(),  # did not ask
        SamplingParams(logprobs=5, temperature=0.0),
    ]
    out = _sample(logits, params)
    ref = torch.log_softmax(logits, -1)
    assert out.top_logprob_ids.shape == (4, 5)
    assert torch.allclose(out.top_logprob_vals, ref.topk(5, -1).values, atol=1e-6)
    assert torch.allclose(out.logprobs, ref.gather(1, out.next_token_ids[:, None]).squeeze(1), atol=1e-6)

    dicts = out.logprob_dicts([p.logprobs for p in params])
    assert dicts[2] is None
    for i in (0, 1, 3):
        d, k, tok = dicts[i], params[i].logprobs, out.next_token_ids[i].item()
        assert tok in d and len(d) in (k, k + 1)
        for t, lp in d.items():
            assert math.isclose(lp, ref[i, t].item(), abs_tol=1e-6)
    assert len(dicts[1]) == 1  # logprobs=0: only the sampled token


def test_logprobs_are_taken_after_penalties_before_temperature() -> None:
    p = SamplingParams(temperature=0.3, frequency_penalty=1.0, logprobs=1, seed=3)
    out = _sample(LOGITS, [p], OUTPUT, PROMPT)
    ref = torch.log_softmax(torch.tensor([[2.0, -3.0, 0.5, 2.0, -2.0]]), -1)
    assert math.isclose(out.logprobs.item(), ref[0, out.next_token_ids.item()].item(), abs_tol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_by_selection_equals_top_k_by_sort(device: str) -> None:
    """When every drawing row has a top-k, the Sampler truncates among the k best (torch.topk)
    instead of sorting the vocabulary: the same seeded tokens as the sort, ties at the cut kept."""
    vocab = 3000
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, vocab, generator=gen).to(device)
    logits[1, :40] = 2.5  # 40 tied values straddling row 1's k = 20
    params = [SamplingParams(temperature=1.1, top_k=50, seed=1), SamplingParams(temperature=0.9, top_k=20, seed=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=7, top_p=0.8, seed=3),
              SamplingParams(temperature=1.0, top_k=1000, top_p=0.5, min_p=0.05, seed=4)]
    for step in range(10):  # seeded rows draw anew each step, the same draw both ways
        batch = SamplingBatch.build(params, [[]] * 5, [[]] * 5, vocab, device, step_indices=[step] * 5)
        assert batch.top_k_width == 1000
        by_sort = replace(batch, top_k_width=None)
        assert torch.equal(Sampler()(logits, batch).next_token_ids, Sampler()(logits, by_sort).next_token_ids)
    # A drawing row without a top-k needs the whole order.
    no_k = SamplingBatch.build([*params, SamplingParams(temperature=1.0, top_p=0.9)], [[]] * 6, [[]] * 6, vocab, device)
    assert no_k.top_k_width is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_top_p_search_on_cuda_truncates_like_the_sort() -> None:
    """Without a top-k, CUDA finds each row's nucleus threshold by search (kernels/top_p.py); the
    CPU sorts. Same tokens survive (fixed seed: no row lands within rounding of its edge)."""
    vocab = 262144
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0, 1.0])[:, None]
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.5, 0.9, 0.95, 0.8, 0.99)]
    params.append(SamplingParams(temperature=0.7))  # no truncation
    kept = []
    for device in ("cpu", "cuda"):
        batch = SamplingBatch.build(params, [[]] * 6, [[]] * 6, vocab, device)
        kept.append(torch.isfinite(Sampler._truncate(logits.to(device), batch)).cpu())
    assert torch.equal(kept[0], kept[1]), (kept[0].sum(-1), kept[1].sum(-1))
    assert kept[1][5].all() and kept[1].sum(-1)[0] < kept[1].sum(-1)[1]
