"""Host cost of structured outputs per step, no model (`structured_outputs.py --host-only`): `--rows`
sequences under the benchmark's JSON schema with the embedded tokenizer's 262k vocabulary, advanced to
realistic states (most inside the free `text` string, some between fields, some inside a `tags` string),
then `--steps` steps of what the engine does for them: accept each row's token (the step's rows in one
xgrammar call, `accept_tokens`, as the step loop does; one call a row reported beside it) and fill the next
step's masks. Tokens are drawn uniformly from what each row's grammar
allows (as a random-weight model writes). Prints microseconds per row for accepting and for filling, by
fill path: xgrammar's batch matcher with 1 thread and with "auto" threads, the engine's own inline
(`fill_token_masks`), and the engine's worker thread (`start_fill(background=True)`) beside a step
loop busy with Python for as long as an inline fill takes: there the figure is the loop's own time
(starting the fill, then waiting for what was not done beside it). Each figure is the best of
`--rounds` rounds (the host may be shared)."""

from __future__ import annotations

import json
import random
import time

import torch

PREFIXES = ('{"id": %d, "text": "%s',  # inside the free string: most rows
            '{"id": %d, "text": "%s", ',  # between fields
            '{"id": %d, "text": "%s", "tags": ["ab", "%s')  # inside a tags string
WORDS = ["the", "river", "town", "was", "old", "and", "quiet", "while", "a", "lamp", "burned", "over", "water"]


def _prefix(i: int, rng: random.Random) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40)))
    kind = 0 if i % 8 < 6 else i % 8 - 5  # 6 of 8 rows in the string, 1 between fields, 1 in tags
    return PREFIXES[kind] % ((i, text) if kind < 2 else (i, text, rng.choice(WORDS)))


def _states(compiled, stops, prefixes: list[list[int]]):
    from swaserve.grammar import SequenceGrammar

    rows = []
    for ids in prefixes:
        g = SequenceGrammar(compiled, stops)
        for t in ids:
            assert g.accept(t), "a prefix the schema does not allow"
        rows.append(g)
    return rows


def _streams(compiled, stops, prefixes, vocab: int, steps: int, seed: int) -> list[list[int]]:
    """Per step, each row's next token: uniform over what its grammar allows then (a stop token where the
    output may end; a row that ended is given token 0, which it refuses)."""
    import xgrammar as xgr

    from swaserve.runner.token_mask import allowed_tokens

    rows = _states(compiled, stops, prefixes)
    gen = torch.Generator().manual_seed(seed)
    masks = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    fill = xgr.BatchGrammarMatcher(max_threads=1)
    out = []
    for _ in range(steps):
        live = [i for i, g in enumerate(rows) if not g.terminated]
        fill.batch_fill_next_token_bitmask([rows[i].matcher for i in live], masks[: len(live)])
        picks = torch.multinomial(allowed_tokens(masks[: len(live)], vocab).float(), 1, generator=gen).flatten()
        step = [0] * len(rows)
        for i, t in zip(live, picks.tolist()):
            rows[i].accept(t)
            step[i] = t
        out.append(step)
    return out


def _busy(seconds: float) -> None:
    """Python for `seconds` without releasing the GIL (what the step loop does between fills)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def host_only(schema: dict, num_rows: int, steps: int, rounds: int, seed: int) -> dict:
    import xgrammar as xgr

    from swaserve import grammar
    from swaserve.grammar import GrammarCompiler, MaskRows, fill_token_masks
    from pathlib import Path

    from swaserve.grammar import accept_tokens
    from swaserve.structured_outputs import StructuredOutputs
    from swaserve.tokenizer import Tokenizer

    carried = Path(__file__).resolve().parents[1] / ".gpu_assets" / "gemma_tok"  # the GPU machines' copy
    tok = Tokenizer.from_hf_dir(carried) if carried.is_dir() else Tokenizer.load(None)
    vocab = 262144  # the Gemma 3 shapes' logits width (the tokenizer's 262k entries)
    stops = sorted(tok.eos_token_ids)
    compiled = GrammarCompiler(tok, vocab, stops).compile(StructuredOutputs(json=schema))
    rng = random.Random(seed)
    prefixes = [tok.hf.encode(_prefix(i, rng), add_special_tokens=False) for i in range(num_rows)]
    tokens = _streams(compiled, stops, prefixes, vocab, steps, seed)
    words = (vocab + 31) // 32
    batch = {"xgr_1_thread": xgr.BatchGrammarMatcher(max_threads=1),
             "xgr_auto": xgr.BatchGrammarMatcher(max_threads="auto")}
    buf = torch.empty(num_rows, words, dtype=torch.int32)
    engine_rows = MaskRows(words)

    background = getattr(grammar, "start_fill", None)  # (absent before the worker thread)
    inline_s = [0.0] * len(tokens)  # each step's inline fill time: the Python the loop does beside a background one

    def fill_with(name: str, rows, k: int) -> float:
        """Seconds of the step loop's own time the fill took."""
        t0 = time.perf_counter()
        if name == "engine_worker":
            job = background(rows, vocab, engine_rows, True)
            t1 = time.perf_counter()
            _busy(inline_s[k])
            t2 = time.perf_counter()
            job.result()
            return t1 - t0 + time.perf_counter() - t2
        if name == "engine_inline":
            fill_token_masks(rows, vocab, engine_rows)
        else:
            live = [i for i, g in enumerate(rows) if not g.terminated]
            batch[name].batch_fill_next_token_bitmask([rows[i].matcher for i in live], buf, indices=live)
        return time.perf_counter() - t0

    best: dict[str, float] = {}
    names = ("xgr_1_thread", "xgr_auto", "engine_inline") + (("engine_worker",) if background else ())
    for _ in range(rounds):
        for name in names:
            rows = _states(compiled, stops, prefixes)
            one_by_one = _states(compiled, stops, prefixes)
            accept = accept_each = fill = 0.0
            for k, step in enumerate(tokens):
                t0 = time.perf_counter()
                for g, t in zip(one_by_one, step):  # a call a row
                    g.accept(t)
                accept_each += time.perf_counter() - t0
                t0 = time.perf_counter()
                accept_tokens(rows, step)  # the step loop's: one call, then each append counts it down
                for g, t in zip(rows, step):
                    g.appended(t)
                accept += time.perf_counter() - t0
                took = fill_with(name, rows, k)
                fill += took
                if name == "engine_inline":
                    inline_s[k] = took
            per = num_rows * len(tokens)
            best[f"fill_us_per_row_{name}"] = min(best.get(f"fill_us_per_row_{name}", 1e9), fill / per * 1e6)
            best["accept_us_per_row"] = min(best.get("accept_us_per_row", 1e9), accept / per * 1e6)
            best["accept_us_per_row_one_call_each"] = min(best.get("accept_us_per_row_one_call_each", 1e9),
                                                          accept_each / per * 1e6)
    return dict(kind="host_only", rows=num_rows, steps=steps, rounds=rounds, vocab=vocab,
                mask_bytes_per_step=num_rows * words * 4, **{k: round(v, 2) for k, v in best.items()})


def report(row: dict) -> None:
    print(json.dumps(row), flush=True)
    print(f"\nstructured outputs, host only: {row['rows']} rows x {row['steps']} steps, vocabulary {row['vocab']}, "
          f"best of {row['rounds']} rounds")
    print(f"  accept, a step's rows at once   {row['accept_us_per_row']:8.2f} us/row")
    print(f"  accept, a call a row            {row['accept_us_per_row_one_call_each']:8.2f} us/row")
    for k in sorted(k for k in row if k.startswith("fill_us_per_row_")):
        print(f"  fill {k[16:]:<26} {row[k]:8.2f} us/row")
    print(f"  mask bytes per step (host -> device) {row['mask_bytes_per_step'] / 2**20:.1f} MiB")
