"""Piecewise CUDA graphs (and, with --whole, whole extend graphs: attention inside) vs eager on extend steps of a random-weight Gemma 3 shape: prefill chunks of
64..4096 tokens (captured token counts and padded ones) and mixed steps (running decodes plus a
prefill chunk). Per step: time off/on (CUDA events around the whole step, host work included:
launch overhead is what the pieces remove) and whether the final hidden states of every token are
bit-identical between the two paths. With --profile, where a piecewise mixed step's time goes: host
time of the step's launch path (eager attention between the pieces, graph replays) against its wall
time and the GPU kernel time inside it; with --profile --whole, each step through whole extend graphs:
its wall time, GPU kernel time and largest kernels.

    python benchmarks/piecewise.py [--shape 1b] [--kv-mb 16384] [--deterministic] [--profile] [--whole]
    python benchmarks/piecewise.py --smoke     # tiny CPU run (CI): the pieces run eagerly (no CUDA graphs)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Span, bench_device, bench_dtype, hardware, parse_args, random_model, sync  # noqa: E402


class Steps:
    """Builds extend batches over table rows and pool slots taken straight from the runtime (no
    scheduler): every repetition of a step writes the same K/V to the same slots."""

    def __init__(self, engine):
        self.engine, self.rt, self.runner = engine, engine._runtime, engine.runner
        self.device = engine.device
        self.vocab = engine.model_config.vocab_size
        self.gen = torch.Generator().manual_seed(0)

    def request(self, n: int) -> tuple[int, torch.Tensor]:
        row = self.rt.req_to_token.alloc()
        slots = self.engine.allocator.alloc(n)
        assert row is not None and slots is not None, "raise --kv-mb"  # (nothing is evicted here)
        self.rt.req_to_token.write(row, 0, slots)
        return row, slots.cpu()

    def batch(self, parts: list[tuple[int, torch.Tensor, int, int]]):
        """`parts`: (row, slots, prefix, new tokens) per request."""
        from swaserve.runner.forward_batch import ForwardBatch, ForwardMode

        ids, pos, locs = [], [], []
        for _row, slots, prefix, n in parts:
            ids += torch.randint(1, self.vocab, (n,), generator=self.gen).tolist()
            pos += list(range(prefix, prefix + n))
            locs.append(slots[prefix: prefix + n])
        return ForwardBatch.build(ForwardMode.EXTEND, ids, pos, [p[0] for p in parts], [p[2] + p[3] for p in parts],
                                  torch.cat(locs), self.runner.device, [p[2] for p in parts], [p[3] for p in parts])

    def run(self, parts, pw, repeats: int) -> tuple[float, torch.Tensor]:
        """Median step ms and the final hidden states of every token (last repetition), through graph
        runner `pw` (None: eagerly)."""
        self.runner.piecewise = pw
        times = []
        for i in range(repeats + 2):
            torch.manual_seed(0)
            self.gen.manual_seed(0)
            batch = self.batch(parts)
            sync(self.device)
            span = Span(self.device)
            hidden = self.runner.forward_hidden(batch)
            self.runner.greedy_tokens(hidden)
            ms = span.stop()
            if i >= 2:
                times.append(ms)
        return sorted(times)[len(times) // 2], self.runner.step_states.clone()


def profile_step(steps: Steps, parts, pw, repeats: int) -> dict:
    """Per step (piecewise on, medians / means over `repeats`): wall ms (CUDA events), host ms until
    the step's last launch returns, host ms inside the eager attention between the pieces and inside
    graph replays, and GPU kernel ms (torch.profiler, kernels inside graphs included)."""
    import time

    spent = {"attend": 0.0, "replay": 0.0}
    attend, replay = pw._attend, torch.cuda.CUDAGraph.replay

    def timed(key, fn):
        def wrapper(*args):
            t = time.perf_counter()
            fn(*args)
            spent[key] += time.perf_counter() - t
        return wrapper

    pw._attend, torch.cuda.CUDAGraph.replay = timed("attend", attend), timed("replay", replay)
    steps.runner.piecewise = pw
    walls, hosts = [], []
    try:
        for i in range(repeats + 2):
            if i == 2:
                spent.update(attend=0.0, replay=0.0)
            batch = steps.batch(parts)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            steps.runner.greedy_tokens(steps.runner.forward_hidden(batch))
            t1 = time.perf_counter()
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                walls.append(start.elapsed_time(end))
                hosts.append(1000 * (t1 - t0))
    finally:
        del pw._attend
        torch.cuda.CUDAGraph.replay = replay
    kernels, top = kernel_table(steps, parts, repeats, 6, 60)
    return dict(wall_ms=sorted(walls)[len(walls) // 2], host_ms=sorted(hosts)[len(hosts) // 2],
                attend_host_ms=1000 * spent["attend"] / repeats, replay_host_ms=1000 * spent["replay"] / repeats,
                gpu_kernel_ms=kernels, top_kernels=top, attention_sites=len(pw.sites[next(s for s in pw.sizes
                                                                        if s >= sum(p[3] for p in parts))]))


def kernel_table(steps: Steps, parts, repeats: int, top: int, width: int) -> tuple[float, list]:
    """GPU kernel ms of a step through the runner's current graphs (torch.profiler, kernels inside graphs
    included; mean over `repeats`) and its `top` kernels as (name cut to `width`, ms, launches) per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(repeats):
            steps.runner.greedy_tokens(steps.runner.forward_hidden(steps.batch(parts)))
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels = sum(e.self_device_time_total for e in events) / 1000 / repeats
    ranked = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    return kernels, [(e.key[:width], e.self_device_time_total / 1000 / repeats, e.count // repeats) for e in ranked]


def profile_whole(steps: Steps, parts, whole, repeats: int, top: int = 14) -> dict:
    """A step through whole extend graphs (`--profile --whole`): wall ms (CUDA events, median), GPU kernel
    ms and its largest kernels."""
    wall, _ = steps.run(parts, whole, repeats)  # (leaves `whole` as the runner's graphs)
    kernels, ranked = kernel_table(steps, parts, repeats, top, 70)
    return dict(wall_ms=wall, gpu_kernel_ms=kernels, top_kernels=ranked)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--chunks", default="64,100,128,256,300,512,1000,1024,1500,2048")
    ap.add_argument("--mixed", default="8+56,32+32,64+64,100+156,128+384,200+300,256+768",
                    help="DECODES+CHUNK per mixed step")
    ap.add_argument("--decode-context", type=int, default=700,
                    help="tokens each running request holds when a mixed step decodes it")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--kv-mb", type=int, default=16384)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--json", help="append one JSON line per step here")
    ap.add_argument("--profile", action="store_true", help="only: where the time of each mixed step goes")
    ap.add_argument("--whole", action="store_true",
                    help="also whole extend graphs (ExtendGraphRunner, --extend-graph whole): a column of their own")
    a = parse_args(ap, argv, smoke=dict(shape="tiny", chunks="8,12,40", mixed="2+6,4+20", decode_context=40,
                                        repeats=1, kv_mb=64))
    from swaserve.engine import Engine

    dev = bench_device(a.smoke)
    dtype = bench_dtype(dev)
    if a.profile and dev.type != "cuda":
        ap.error("--profile times CUDA graph replays and kernels: it needs a GPU")
    loaded = random_model(a.shape, dev, dtype)
    engine = Engine(loaded, device=dev, dtype=dtype, max_running_requests=320, max_prefill_tokens=4096,
                    max_context=8192, disable_cuda_graph=True, kv_cache_bytes=a.kv_mb << 20,
                    swa_full_tokens_ratio=1.0, enable_piecewise_cuda_graph=dev.type == "cuda", extend_graph="pieces",
                    enable_deterministic_inference=a.deterministic,
                    attention_backend="triton" if a.whole else None)  # (the whole graphs' backend, also on CPU)
    if dev.type != "cuda":  # no CUDA graphs here: the same padded program in pieces, run eagerly
        from swaserve.runner.piecewise_graph import PIECEWISE_MAX_TOKENS, PiecewiseGraphRunner

        max_tokens = min(4096, PIECEWISE_MAX_TOKENS)  # as the engine's (its max_prefill_tokens)
        engine.runner.piecewise = PiecewiseGraphRunner(engine.runner, max_tokens, capture=False)
    steps = Steps(engine)
    pw = engine.runner.piecewise
    whole = None
    if a.whole:
        from swaserve.runner.extend_graph import ExtendGraphRunner

        whole = ExtendGraphRunner(engine.runner, pw.sizes[-1], capture=dev.type == "cuda")
    engine.runner.keep_states = True
    cases = []
    for n in (int(x) for x in a.chunks.split(",")):
        row, slots = steps.request(n)
        cases.append((f"prefill {n}", [(row, slots, 0, n)]))
    mixed = [tuple(int(x) for x in spec.split("+")) for spec in a.mixed.split(",")]
    decodes = [steps.request(a.decode_context + 1) for _ in range(max(d for d, _ in mixed))]
    steps.runner.piecewise = None
    for i in range(0, len(decodes), 4):  # their context, written once (eagerly, 4 requests a step)
        steps.runner.forward_hidden(steps.batch([(r, s, 0, a.decode_context) for r, s in decodes[i:i + 4]]))
    for d, c in mixed:
        row, slots = steps.request(c)
        parts = [(r, s, a.decode_context, 1) for r, s in decodes[:d]] + [(row, slots, 0, c)]
        cases.append((f"mixed {d}+{c}", parts))
    if a.profile and whole is not None:
        print(f"whole extend graphs, {a.shape} {str(dtype)[6:]}, {hardware()}: ms per step, largest kernels")
        for name, parts in cases:
            r = profile_whole(steps, parts, whole, a.repeats)
            print(f"{name:>18}  wall {r['wall_ms']:.3f}  GPU kernels {r['gpu_kernel_ms']:.3f}", flush=True)
            for key, ms, count in r["top_kernels"]:
                print(f"{'':>20}{ms:7.3f} ms  x{count:<4} {key}")
        return
    if a.profile:
        print(f"piecewise mixed steps, {a.shape} {str(dtype)[6:]}, {hardware()}: ms per step")
        print(f"{'step':>18} {'wall':>7} {'host':>7} {'attend host':>12} {'replays host':>13} {'GPU kernels':>12} sites")
        for name, parts in cases:
            if name.startswith("mixed"):
                r = profile_step(steps, parts, pw, a.repeats)
                print(f"{name:>18} {r['wall_ms']:>7.2f} {r['host_ms']:>7.2f} {r['attend_host_ms']:>12.2f} "
                      f"{r['replay_host_ms']:>13.2f} {r['gpu_kernel_ms']:>12.2f} {r['attention_sites']:>5}", flush=True)
                for key, ms, count in r["top_kernels"]:
                    print(f"{'':>20}{ms:7.3f} ms  x{count:<4} {key}")
        return
    rows = []
    for name, parts in cases:
        T = sum(p[3] for p in parts)
        N = next(s for s in pw.sizes if s >= T)
        off, h_off = steps.run(parts, None, a.repeats)
        on, h_on = steps.run(parts, pw, a.repeats)
        r = dict(shape=a.shape, step=name, tokens=T, padded_to=N, eager_ms=round(off, 3), piecewise_ms=round(on, 3),
                 speedup=round(off / on, 2), bit_identical=bool(torch.equal(h_off, h_on)),
                 max_abs_diff=float((h_off.float() - h_on.float()).abs().max()),
                 deterministic=a.deterministic, hardware=hardware())
        if whole is not None:
            w, h_w = steps.run(parts, whole, a.repeats)
            r.update(whole_ms=round(w, 3), whole_bit_identical=bool(torch.equal(h_off, h_w)),
                     whole_max_abs_diff=float((h_off.float() - h_w.float()).abs().max()))
        rows.append(r)
        print(json.dumps(r), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    mode = "deterministic" if a.deterministic else "default"
    graphs = "CUDA graphs" if pw.capture else "pieces run eagerly (no CUDA graphs)"
    print(f"\npiecewise {graphs}, {a.shape} {str(dtype)[6:]}, {mode} mode, {hardware()}")
    print(f"{'step':>18} {'tokens':>6} {'graph':>6} {'eager ms':>9} {'pieces ms':>9} {'x':>5}  bit-identical"
          + ("    whole ms     x  vs eager" if whole is not None else ""))
    for r in rows:
        line = (f"{r['step']:>18} {r['tokens']:>6} {r['padded_to']:>6} {r['eager_ms']:>9.3f} {r['piecewise_ms']:>9.3f} "
                f"{r['speedup']:>5.2f}  {r['bit_identical']} ({r['max_abs_diff']:.2g})")
        if whole is not None:
            line += (f"  {r['whole_ms']:>9.3f} {r['eager_ms'] / r['whole_ms']:>5.2f}  {r['whole_bit_identical']} "
                     f"({r['whole_max_abs_diff']:.2g})")
        print(line)


if __name__ == "__main__":
    main()
