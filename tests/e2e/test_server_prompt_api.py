"""logit_bias, echo with prompt logprobs, prompt_logprobs and /tokenize on the real engine (embedded Gemma 3
270M, CPU) through the official `openai` client, prefilling in chunks of 32 tokens; prompt logprobs checked
against one direct forward of the same weights (torch reference attention, no chunks, no cache)."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from live_server import fake_spec, start_server

CHUNK = 16  # max_prefill_tokens: the 39-token prompt prefills in 3 steps
LOGPROB_TOL = 2e-3  # fp32 both sides; chunked vs one-shot attention sums differ in rounding only
PROMPT = ("The river town grew slowly through the centuries. Merchants arrived with salt and cloth, monks copied "
          "manuscripts by candle light, and in winter the bridge froze so hard that children skated beneath it.")


@pytest.fixture(scope="module")
def server():
    from swaserve.tokenizer import Tokenizer

    spec = fake_spec("swaserve.engine:Engine", model=None, device="cpu", max_context=512, max_running_requests=16,
                     max_prefill_tokens=CHUNK, detokenize=False)
    live = start_server(spec, Tokenizer.load(None))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def reference():
    """Per-position logprobs `[T, vocab]` of the embedded model over `ids` in one forward pass."""
    from swaserve.loader import load_model
    from swaserve.memory import ReqToTokenPool, SWAKVPool, TokenToKVPoolAllocator
    from swaserve.runner.forward_batch import ForwardBatch, ForwardMode
    from swaserve.runner.model_runner import ModelRunner

    loaded = load_model(None, torch.device("cpu"), torch.float32, max_context=512)
    cfg = loaded.config

    def run(ids: list[int]) -> torch.Tensor:
        n = len(ids)
        table = ReqToTokenPool(2, 512, device="cpu")
        kv = SWAKVPool.build(cfg, n + 1, n + 1, hybrid=False, dtype=torch.float32, device="cpu")
        alloc = TokenToKVPoolAllocator(n + 1)
        runner = ModelRunner(cfg, loaded.model, kv, table, None, "cpu", torch.float32, "torch_native")
        row, slots = table.alloc(), alloc.alloc(n)
        table.write(row, 0, slots)
        batch = ForwardBatch.build(ForwardMode.EXTEND, ids, list(range(n)), [row], [n], slots, "cpu",
                                   extend_prefix_lens=[0], extend_seq_lens=[n])
        hidden = runner.forward_hidden(batch, torch.arange(n))
        return torch.log_softmax(runner.logits(hidden).float(), dim=-1)

    return run


def test_logit_bias_forces_and_bans_a_token(server):
    c = server.client()
    kw = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = c.completions.create(logprobs=0, **kw)
    first = server.client_state.tokenizer.encode(plain.choices[0].logprobs.tokens[0], add_special_tokens=False)[0]
    banned = c.completions.create(logit_bias={str(first): -100}, logprobs=0, **kw)
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]
    forced = c.completions.create(logit_bias={"9641": 100}, **kw)  # a token the text never has
    tok = server.client_state.tokenizer
    assert tok.encode(forced.choices[0].text, add_special_tokens=False) == [9641] * 4
    chat_like = c.completions.create(**{**kw, "prompt": [2, 818, 5279]}, logit_bias={"9641": 100}, n=2)
    assert all(tok.encode(ch.text, add_special_tokens=False) == [9641] * 4 for ch in chat_like.choices)


@pytest.mark.slow  # the reference loads the weights a second time (~15 s on 2 free cores)
def test_echo_with_prompt_logprobs_matches_a_direct_forward(server, reference):
    c = server.client()
    tok = server.client_state.tokenizer
    ids = tok.encode(PROMPT)
    assert len(ids) > 2 * CHUNK
    out = c.completions.create(model=server.model, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ch = out.choices[0]
    assert ch.finish_reason == "length" and out.usage.completion_tokens == 0
    assert ch.text == tok.decode(ids)
    lps = ch.logprobs
    assert len(lps.tokens) == len(ids) and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    ref = reference(ids)
    got = torch.tensor(lps.token_logprobs[1:])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max().item() < LOGPROB_TOL
    # each top_logprobs entry: the most likely token's string and logprob (plus the prompt token's)
    best = ref[:-1].argmax(-1)
    for j in (1, CHUNK, CHUNK + 1, len(ids) - 1):
        top = lps.top_logprobs[j]
        assert tok.decode([best[j - 1].item()]) in top
        assert abs(max(top.values()) - ref[j - 1].max().item()) < LOGPROB_TOL


@pytest.mark.slow
def test_prompt_logprobs_across_chunks_and_echo_with_completion(server, reference):
    tok = server.client_state.tokenizer
    ids = tok.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "echo": True, "logprobs": 0}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    ch = r["choices"][0]
    field = ch["prompt_logprobs"]
    assert len(field) == len(ids) and field[0] is None
    ref = reference(ids)
    for j in range(1, len(ids)):
        own = field[j][str(ids[j])]
        assert abs(own["logprob"] - ref[j - 1, ids[j]].item()) < LOGPROB_TOL
        assert own["rank"] == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
        assert len(field[j]) in (2, 3)  # the top 2, and the prompt's own token when not among them
    assert ch["text"].startswith(PROMPT) and len(ch["text"]) > len(PROMPT)
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
    assert r["usage"]["completion_tokens"] == 3
    # echo while streaming: the prompt first, then the completion; same tokens as not streaming
    c = server.client()
    chunks = list(c.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                       echo=True, logprobs=0, stream=True))
    assert "".join(x.choices[0].text for x in chunks) == ch["text"]
    assert sum(len(x.choices[0].logprobs.tokens) for x in chunks if x.choices[0].logprobs) == len(ids) + 3
    assert server.metrics()["swaserve_prompt_logprob_tokens_total"] >= 2 * (len(ids) - 1)


def test_tokenize_round_trip(server):
    tok = server.client_state.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert len(r["token_strs"]) == r["count"]
    bare = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == r["tokens"][1:]
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    for bad, path in (({"tokens": [1, 10**9]}, "/detokenize"), ({"prompt": "x", "messages": []}, "/tokenize"),
                      ({"messages": [{"role": "user", "content": "hi"}]}, "/tokenize")):  # base model: no template
        resp = httpx.post(server.url + path, json=bad)
        assert resp.status_code == 400, (path, bad, resp.text)


def test_bad_input_is_a_400_while_a_stream_continues(server):
    c = server.client()
    result: dict[str, object] = {}

    def stream() -> None:
        s = c.completions.create(model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True}, stream=True)
        result["text"] = "".join(x.choices[0].text for x in s if x.choices)

    t = threading.Thread(target=stream)
    t.start()
    bad = [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"logit_bias": {str(10**7): 1}}, "logit_bias token ids"),  # past the vocabulary: the engine's refusal
        ({"max_tokens": 0}, "echo"),
        ({"prompt_logprobs": 1, "stream": True}, "streaming"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ]
    for extra, words in bad:
        r = httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2, **extra}, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (extra, r.text)
    t.join(300)  # CPU shared with other work: a decode step can take a second
    assert not t.is_alive() and len(server.client_state.tokenizer.encode(result["text"], add_special_tokens=False)) > 16
