"""Load: 200 mixed requests (completions and chat, streaming and not) at concurrency 128; every greedy
result equals the same request run alone, and afterwards both KV pools are empty."""

from __future__ import annotations

import asyncio
import random
import time

NUM_REQUESTS = 200
CONCURRENCY = 128


def make_workload(num_unique: int, max_out: int, seed: int = 0, chat: bool = True) -> list[dict]:
    """`chat=False`: completions only (a base model without a chat template)."""
    rng = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "sliding", "windows", "keep", "memory", "small"]
    specs = []
    for i in range(num_unique):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 24)))
        spec = {"max_tokens": rng.randint(1, max_out), "temperature": 0.0}
        if chat and i % 3 == 2:
            specs.append({"kind": "chat", "messages": [{"role": "user", "content": text}], **spec})
        else:
            specs.append({"kind": "completion", "prompt": text, **spec})
    return specs


async def run_one(client, model: str, spec: dict, stream: bool) -> tuple[str, str | None, int | None]:
    kw = {k: v for k, v in spec.items() if k != "kind"}
    if spec["kind"] == "chat":
        if not stream:
            r = await client.chat.completions.create(model=model, **kw)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        parts, finish, usage = [], None, None
        async for ch in await client.chat.completions.create(
            model=model, stream=True, stream_options={"include_usage": True}, **kw
        ):
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
            else:
                usage = ch.usage.completion_tokens
        return "".join(parts), finish, usage
    if not stream:
        r = await client.completions.create(model=model, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    parts, finish, usage = [], None, None
    async for ch in await client.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if ch.choices:
            parts.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
        else:
            usage = ch.usage.completion_tokens
    return "".join(parts), finish, usage


def run_load(live, specs: list[dict], num_requests: int, concurrency: int, timeout: float) -> None:
    """References first (one at a time), then the mixed load; compares every result and the pools."""

    async def main() -> None:
        client = live.async_client(timeout=timeout)
        refs = [await run_one(client, live.model, s, stream=False) for s in specs]
        sem = asyncio.Semaphore(concurrency)
        order = [(i, i % len(specs), i % 2 == 1) for i in range(num_requests)]
        random.Random(1).shuffle(order)

        async def bounded(i: int, k: int, stream: bool):
            async with sem:
                return i, k, stream, await run_one(client, live.model, specs[k], stream)

        results = await asyncio.wait_for(asyncio.gather(*(bounded(*o) for o in order)), timeout)
        await client.close()
        mismatches = [
            f"request {i} (spec {k}, stream={stream}): {got!r} != {refs[k]!r}"
            for i, k, stream, got in results
            if got != refs[k]
        ]
        assert len(results) == num_requests
        assert not mismatches, "\n".join(mismatches[:10])

    asyncio.run(main())
    m = live.wait_idle(timeout=30)
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0
    assert m['swaserve_kv_used_tokens{pool="swa"}'] == 0
    assert m["swaserve_requests_running"] == 0 and m["swaserve_requests_waiting"] == 0


def test_load_200_at_concurrency_128(fake_server):
    before = fake_server.metrics()
    t0 = time.monotonic()
    run_load(fake_server, make_workload(40, 48), NUM_REQUESTS, CONCURRENCY, timeout=120)
    after = fake_server.metrics()
    finished = sum(v for k, v in after.items() if k.startswith("swaserve_requests_finished_total"))
    finished -= sum(v for k, v in before.items() if k.startswith("swaserve_requests_finished_total"))
    assert finished == 40 + NUM_REQUESTS
    assert after["swaserve_requests_aborted_total"] == before["swaserve_requests_aborted_total"]
    assert time.monotonic() - t0 < 120
