"""The import graph of `swaserve/`: no import circles, and no import from a lower plane to a higher one
(DESIGN.md §1; the planes are pictured in docs/architecture.md). Every import statement counts, at any
depth: function-local imports and `if TYPE_CHECKING:` blocks too.

`PLANES` below is the one table of planes. A module that no entry matches fails the test: give it a
plane when you add it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "swaserve"

# Lowest first: a module may import its own plane and the planes above it in this list, never one below.
# Entries are paths under swaserve/: "pkg/" is every module of a package, "pkg/mod.py" one module; the
# longest entry that matches a module decides its plane (so a module can sit below the rest of its package).
PLANES: list[tuple[str, tuple[str, ...]]] = [
    # plain data and helpers everything may use
    ("base", ("config.py", "model_config.py", "request.py", "h2d.py", "detokenizer.py",
              "structured_outputs.py", "step_rows.py")),
    # Triton kernels; the tensor-parallel group and the collectives layers call; structured outputs'
    # token bitmasks applied to logits (the LM head's greedy path applies them too)
    ("primitives", ("kernels/", "distributed/state.py", "runner/token_mask.py")),
    # request table, allocators, KV pools, SWA mapping, planner
    ("memory", ("memory/",)),
    # the device-side step description handed down to attention, layers and models
    ("batch", ("runner/forward_batch.py",)),
    ("attention", ("attention/",)),
    ("layers", ("layers/",)),
    ("models", ("models/",)),
    # checkpoints to config, weights and tokenizer; chat formats (prompt rendering, reply parsing)
    ("loader", ("loader/", "tokenizer.py", "chat/")),
    # ModelRunner, graph runners, Sampler
    ("runner", ("runner/",)),
    ("prefix_cache", ("prefix_cache/",)),
    ("scheduler", ("scheduler/",)),
    # one step on every rank: assembling (and sizing) a runtime, launching a scheduled step, other TP ranks
    # (grammar/: structured outputs' compiled grammars and per-sequence matchers, which the launcher masks with)
    ("step", ("runtime.py", "sizing.py", "engine_setup.py", "launcher.py", "launched_step.py", "prompt_scores.py",
              "distributed/", "grammar/")),
    # drafters and the verify step: they plug into the scheduler and the launcher
    ("speculative", ("speculative/",)),
    ("engine", ("engine.py", "engine_stats.py", "admission.py", "request_group.py")),
    # the ways in: offline LLM, engine-core process, HTTP frontends
    ("io", ("llm.py", "options.py", "core/", "server/")),
    ("entry", ("__init__.py", "__main__.py", "cli.py")),
]


@functools.cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of swaserve/ (a package by its __init__)."""
    mods = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _resolve(name: str) -> str | None:
    mods = modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The swaserve modules one statement imports. `from pkg import name` is pkg/name.py when that file
    exists, else pkg/__init__.py; `import a.b.c` the longest existing module of a.b.c."""
    if isinstance(node, ast.Import):
        return [t for a in node.names if (t := _resolve(a.name))]
    base = node.module or ""
    if node.level:
        up = package.split(".")
        up = up[: len(up) - (node.level - 1)]
        base = ".".join(up + ([base] if base else []))
    out = []
    for a in node.names:
        full = f"{base}.{a.name}"
        t = full if full in modules() else _resolve(base)
        if t:
            out.append(t)
    return out


@functools.cache
def edges() -> dict[str, list[tuple[str, int]]]:
    """Module -> (imported module, line) for every import statement at any depth."""
    out: dict[str, list[tuple[str, int]]] = {}
    for mod, path in modules().items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [(t, node.lineno) for t in _targets(node, package) if t != mod]
        out[mod] = found
    return out


def rel(mod: str) -> str:
    """`swaserve.runner.sampler` -> `runner/sampler.py`: the path under swaserve/, as PLANES spells it."""
    return str(modules()[mod].relative_to(ROOT))


def plane_of(path: str) -> int | None:
    """Index in PLANES of the longest entry matching `path` (a path under swaserve/)."""
    best: tuple[int, int] | None = None
    for i, (_, entries) in enumerate(PLANES):
        for e in entries:
            if path == e or (e.endswith("/") and path.startswith(e)):
                if best is None or len(e) > best[0]:
                    best = (len(e), i)
    return best[1] if best is not None else None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_every_module_has_a_plane():
    missing = [rel(m) for m in modules() if plane_of(rel(m)) is None]
    assert not missing, (
        f"no plane for {', '.join(missing)}: add it to PLANES in {Path(__file__).name} "
        "(and to the table in docs/architecture.md)")


def test_every_plane_entry_matches_a_module():
    paths = [rel(m) for m in modules()]
    stale = [e for _, entries in PLANES for e in entries
             if not any(p == e or (e.endswith("/") and p.startswith(e)) for p in paths)]
    assert not stale, f"PLANES entries that match no module: {stale}"


def test_no_import_circles():
    graph = {m: {t for t, _ in es} for m, es in edges().items()}
    # A package's __init__ importing its own children is how a package exports; a child importing the
    # __init__ of its own package would close a circle of no design meaning, so that edge is dropped
    # (as ../shared/tools/import_cycles.py does).
    mods = modules()
    for m in graph:
        graph[m] = {t for t in graph[m] if not (m.startswith(t + ".") and mods[t].name == "__init__.py")}
    found = circles(graph)
    lines = []
    for n, comp in enumerate(found, 1):
        lines.append(f"circle {n}: {', '.join(comp)}")
        for a in comp:
            for t, line in sorted(set(edges()[a])):
                if t in comp and t in graph[a]:
                    lines.append(f"  {rel(a)}:{line} imports {t}")
    assert not found, f"{len(found)} import circle(s) in swaserve/:\n" + "\n".join(lines)


def test_imports_follow_the_planes():
    bad = []
    for mod, es in edges().items():
        src = plane_of(rel(mod))
        for t, line in sorted(set(es)):
            dst = plane_of(rel(t))
            if src is not None and dst is not None and dst > src:
                bad.append(f"  {rel(mod)}:{line} ({PLANES[src][0]}) imports {t} ({PLANES[dst][0]})")
    assert not bad, "imports from a lower plane to a higher one:\n" + "\n".join(bad)
