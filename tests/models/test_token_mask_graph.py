"""Structured-output masks on decode steps replayed from captured graphs (CPU: torch.compile, eager
backend): a live batch of 3 rows runs padded to 4; masks exist for the 2 constrained live rows only
(applied to their logits after the replay), constrained rows only ever take allowed tokens, the
unconstrained row in the same batch is untouched, every token equals the eager engine's, and the padded
row stays inert (row 0 of the last-token table is never written)."""

from __future__ import annotations

import torch
from families import make_hf_model
from test_decode_graph_padding import make_runtime, poison_pools

import swaserve.launcher as launcher_mod
from swaserve.grammar import SequenceGrammar
from swaserve.launcher import StepLauncher
from swaserve.request import SamplingParams
from swaserve.runner import token_mask
from swaserve.runner.cpu_graph import CpuGraphRunner
from swaserve.scheduler.req import Req

LETTERS = {10 + i: chr(ord("a") + i) for i in range(10)}  # ids 10..19 spell a..j; the rest are long tokens
STOP = 1


def compiled_regex(vocab_size: int, pattern: str):
    import xgrammar as xgr

    vocab = [LETTERS.get(i, f"<t{i}>") for i in range(vocab_size)]
    vocab[STOP] = "</s>"
    info = xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=[STOP])
    return xgr.GrammarCompiler(info, max_threads=1).compile_grammar(xgr.Grammar.from_regex(pattern))


def run(rt, compiled, masked_rows: list[int]) -> dict[str, list[int]]:
    launcher = StepLauncher(rt.runner)
    prompts = {"c1": [5, 6, 7], "free": [8, 9, 30, 31], "c2": [40, 41]}
    for rid, ids in prompts.items():
        req = Req(rid, rid, 0, len(ids), list(ids), SamplingParams(temperature=0, max_tokens=12), 0, frozenset())
        if rid != "free":
            req.grammar = SequenceGrammar(compiled, [STOP])
        rt.scheduler.add(req)
    reqs = list(rt.scheduler.waiting)
    while rt.scheduler.has_unfinished():
        batch = rt.scheduler.schedule()
        step = launcher.launch(batch)
        tokens, lps = step.wait()
        rt.scheduler.process_output(batch, tokens, lps)
        rt.scheduler.check_integrity()
        assert rt.runner.last_tokens[0] == 0, "the padded row's token row is never written"
    return {r.rid: r.output_ids for r in reqs}


def test_masks_on_padded_graph_decode(tmp_path, monkeypatch):
    make_hf_model("gemma3", tmp_path, seed=3)
    eager, graph = make_runtime(tmp_path, False, "eager"), make_runtime(tmp_path, False, "eager")
    graph.runner.graph_runner = CpuGraphRunner(graph.runner, 4, compile_backend="eager")  # sizes 1, 2, 4
    poison_pools(graph)
    vocab = graph.runner.model_config.vocab_size
    compiled = compiled_regex(vocab, "[a-e]{2,6}")
    shapes: list[tuple[int, int]] = []
    real = launcher_mod.apply_token_bitmask

    def spy(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        shapes.append((logits.shape[0], masks.shape[0], rows.tolist() if rows is not None else None))
        return real(logits, masks, rows)

    monkeypatch.setattr(launcher_mod, "apply_token_bitmask", spy)  # the logits path (sampled rows)
    monkeypatch.setattr(token_mask, "apply_token_bitmask", spy)  # greedy rows: the LM head's (`LMHead.greedy`)
    replays: list[int] = []
    graphs = graph.runner.graph_runner
    real_replay = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda fb: replays.append(fb.batch_size) or real_replay(fb))
    got_eager, got_graph = run(eager, compiled, []), run(graph, compiled, [])
    assert 3 in replays, replays  # decode steps of 3 live rows ran as graph replays
    assert got_graph == got_eager
    allowed = {10, 11, 12, 13, 14}
    for rid in ("c1", "c2"):
        out = got_graph[rid]
        assert out[-1] == STOP and 2 <= len(out) - 1 <= 6 and set(out[:-1]) <= allowed, (rid, out)
    assert not set(got_graph["free"]) <= allowed | {STOP}  # the unconstrained row samples from the whole vocab
    # c1, free, c2 decode together: the masks of rows 0 and 2 only; alone, c1 and c2 mask every row.
    assert (3, 2, [0, 2]) in shapes
    assert all(n_logits <= 3 and (rows is None) == (n_masks == n_logits) for n_logits, n_masks, rows in shapes)
    assert graph.runner.graph_runner is not None and 4 in graph.runner.graph_runner.sizes
