"""Every script in benchmarks/ runs its `--smoke` mode here: a tiny CPU run of the script's whole code path
(load, run, measure, print its table and JSON lines), so a script that no longer runs (a renamed key, an
engine API change) fails CI instead of rotting until someone needs it on a GPU. The numbers are not
checked (benchmarks print numbers; they are never timed assertions), only that each run finished with
exit status 0 and printed well-formed JSON lines. A new script without a smoke mode fails here.

The scripts run in this process (runpy, argv patched), so torch and transformers are imported once for
all of them; the serving scripts start their own server processes on a tiny random model. One intra-op
thread everywhere: the models are tiny, and on a busy 2-core machine a second spinning thread per
process (this one, a server's frontend and engine core, the load generator's) only slows every run.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

# Modules that are not scripts: what the scripts import (their code runs in the scripts' smoke runs).
HELPERS = {"common.py", "grammar_host.py", "load_client.py", "probes.py", "profiling.py", "step_phases.py", "ttft_breakdown.py"}

# More smoke runs for scripts with more than one mode (each list: arguments after --smoke).
MORE_RUNS = {
    "decode.py": [["--quantization", "none,fp8", "--shapes", "gemma4-tiny"]],  # online FP8 weights: dense and experts
    "deterministic.py": [["--probes", "--control"]],
    "host_step.py": [["--schema", "--phases"]],  # constrained vs not, the step loop by phase (step_phases.py)
    "moe_kernel.py": [["--model", "gpt-oss-20b"]],
    "piecewise.py": [["--whole", "--chunks", "8", "--mixed", "2+6"]],  # whole extend graphs (interpreted Triton), beside the pieces  # GPT-OSS's form: MXFP4 and bf16 experts, biases
    "structured_outputs.py": [["--host-only"], ["--phases"]],  # no model: accept and fill per row; loop phases
    "unified_attention_sweep.py": [["--extend"]],
}


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def runs() -> list[tuple[str, list[str]]]:
    out = []
    for path in scripts():
        out.append((path.name, []))
        out += [(path.name, extra) for extra in MORE_RUNS.get(path.name, [])]
    return out


pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="smoke runs execute Triton kernels on CPU tensors (TRITON_INTERPRET=1): the CPU CI runs them")


def test_every_module_is_a_script_with_a_smoke_mode_or_a_helper() -> None:
    for path in BENCH.glob("*.py"):
        if path.name in HELPERS:
            continue
        text = path.read_text()
        assert 'if __name__ == "__main__":' in text, (
            f"benchmarks/{path.name} is neither a script (no __main__ block) nor a helper listed in HELPERS")
        assert "smoke=" in text or '"--smoke"' in text, (
            f"benchmarks/{path.name} has no --smoke mode: parse its flags with common.parse_args(ap, argv, "
            "smoke={...}) and give the smoke run tiny sizes (benchmarks/NOTES.md, issue 34)")


@pytest.mark.parametrize("name,extra", runs(), ids=[" ".join([n, *e]) for n, e in runs()])
def test_smoke_run(name: str, extra: list[str], capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = BENCH / name
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the processes the run starts
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(sys, "argv", [str(path), "--smoke", *extra])
    monkeypatch.setattr(sys, "path", list(sys.path))  # scripts put benchmarks/ on it
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    finally:
        torch.set_num_threads(threads)
        gc.collect()  # the run's engines and pools, before the next script builds its own
    out = capsys.readouterr().out
    assert code == 0, f"{name} {' '.join(extra)} --smoke exited with {code}:\n{out[-3000:]}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"{name} --smoke printed no JSON line:\n{out[-3000:]}"
    for line in lines:
        assert isinstance(json.loads(line), dict), line
