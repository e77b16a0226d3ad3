"""Deterministic mode's decode attention on the GPU: `unified_attention` decode steps (chunk or key-block
programs + merge) over a few (rows, warps, stages) settings, and with programs per chunk and per key block
forced (sliding layers read their window's slots from `window_slots` as in the engine, and also per
key through the table and `full_to_swa`, and without that map), against the default mode's
`decode_attention` (split by batch size), per Gemma 3 head shape, batch size and layer kind (full: 1024
keys; sliding: window 512 through `full_to_swa`). Prints achieved K/V bandwidth (bytes of keys and
values read once ÷ time).

    python benchmarks/unified_attention_sweep.py [--shapes 1b,4b,12b] [--batch-sizes 1,8,64,256]
    python benchmarks/unified_attention_sweep.py --extend   # prefill programs vs extend_attention
    python benchmarks/unified_attention_sweep.py --smoke [--extend]   # tiny, Triton's interpreter (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, empty_cache, graph_us, hardware, parse_args  # noqa: E402

# isort: split
# after common: --smoke picks Triton's interpreter before triton is imported
import triton  # noqa: E402

from swaserve.kernels import decode_attention, extend_attention, num_kv_splits_for  # noqa: E402
from swaserve.kernels.common import num_sms  # noqa: E402
from swaserve.kernels.index_builders import window_slots  # noqa: E402
from swaserve.kernels.unified_attention import (  # noqa: E402
    BLOCK_M, PROGRAMS, decode_chunks, decode_config, decode_programs, key_chunk, unified_attention,
    unified_config,
)

# heads, kv heads, head dim (tiny: --smoke)
SHAPES = {"1b": (4, 1, 256), "4b": (8, 4, 256), "12b": (16, 8, 256), "tiny": (2, 1, 32)}
SETTINGS = [(16, 4, 2), (16, 4, 3), (16, 8, 2), (64, 4, 2)]
# (rows, warps, stages) of an extend program; 16- and 32-row tiles: more programs where a short prefill's
# 64-row tiles leave most SMs idle (1B, 512 tokens: 32 tiles of 16 tokens x 4 heads on 132 SMs)
# (64, 8, 5) and (32, 8, 5): the one-loop form's stages (every setting runs in that form where the device holds it,
# `unified_launch.flat_extend`; SWASERVE_UNIFIED_FLAT=0 / 1 forces the chunk loop / the one loop)
EXTEND_SETTINGS = [(64, 4, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3), (32, 8, 3),
                   (16, 4, 2), (16, 4, 3), (16, 8, 3), (64, 8, 5), (32, 8, 5)]


@dataclass(frozen=True)
class Sizes:
    """The case sizes: keys per request, the table's width and the window (decode); prefill requests x
    new tokens (--extend); calls per captured graph, each over its own keys so the data does not sit in L2."""

    ctx: int = 1024
    max_context: int = 4096
    window: int = 512
    prefill_reqs: int = 4
    prefill_len: int = 2048
    calls: int = 4


def case(shape: str, bs: int, window: int | None, dev: torch.device, z: Sizes) -> dict:
    H, HKV, D = SHAPES[shape]
    REPS, CTX, MAX_CONTEXT = z.calls, z.ctx, z.max_context
    g = torch.Generator(device=dev).manual_seed(0)
    slots = REPS * bs * CTX + 1
    k_buf = torch.randn(slots, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    v_buf = torch.randn(slots, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    q = torch.randn(bs, H, D, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty(bs, H, D, device=dev, dtype=torch.bfloat16)
    perm = (torch.randperm(slots - 1, device=dev, generator=g) + 1).to(torch.int32).view(REPS, bs, CTX)
    tables = torch.zeros(REPS, bs + 1, MAX_CONTEXT, dtype=torch.int32, device=dev)
    tables[:, 1:, :CTX] = perm
    rows = torch.arange(1, bs + 1, device=dev)
    seq = torch.full((bs,), CTX, dtype=torch.int32, device=dev)
    qo = torch.arange(bs + 1, dtype=torch.int32, device=dev)
    # Sliding layers read through full_to_swa (here a permutation of the same slots: the extra gather).
    f2s = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), perm.flatten()]) if window else None
    keys = min(CTX, window or CTX)
    nbytes = 2 * bs * keys * HKV * D * 2

    # What the engine passes a sliding layer's decode step: its window's SWA slots, once a step.
    slots = [window_slots(tables[i], rows, seq, f2s, window) for i in range(REPS)] if window else None

    def unified(launch, programs=None, f2s=f2s, table=True):
        return graph_us(lambda i: unified_attention(q, out, k_buf, v_buf, tables[i], rows, seq, qo, D**-0.5,
                                                    max_extend_len=1, window=window, full_to_swa=f2s,
                                                    launch=launch, programs=programs,
                                                    slots=slots[i] if slots and table else None), REPS)

    # The default mode's kernel, on the same keys as lists (its SWA layers read SWA slots directly).
    lists = perm[:, :, CTX - keys:].reshape(REPS, -1)
    indptr = torch.arange(0, bs * keys + 1, keys, device=dev, dtype=torch.int32)
    splits = num_kv_splits_for(bs, H, HKV, keys, num_sms(q.device))
    default = graph_us(lambda i: decode_attention(q, k_buf, v_buf, indptr, lists[i], out, D**-0.5,
                                                  num_kv_splits=splits), REPS)
    timed = {}
    for s in SETTINGS:
        try:
            timed["x".join(map(str, s))] = round(unified(s), 1)
        except Exception as e:  # out of shared memory etc.: not a candidate
            timed["x".join(map(str, s))] = type(e).__name__
    # The rule's launch with each program layout forced (the default picks by batch), and request
    # programs on two stages.
    group_p, chunk = triton.next_power_of_2(H // HKV), key_chunk(MAX_CONTEXT)
    rule_programs = decode_programs(bs * HKV, decode_chunks(MAX_CONTEXT, chunk, window),
                                    chunk // unified_config(D, 2)[0], num_sms(q.device))
    programs = {p: round(unified(decode_config(group_p, window is not None, p), p), 1) for p in PROGRAMS}
    programs["request_2_stages"] = round(unified((decode_config(group_p, False)[0], 4, 2), "request"), 1)
    programs["rule"] = rule_programs
    if window:  # per key through the table and full_to_swa, and without that map (the keys' traffic alone)
        programs["two_gathers"] = round(unified(None, table=False), 1)
        programs["no_map"] = round(unified(None, f2s=None, table=False), 1)
    rule = "x".join(map(str, decode_config(group_p, window is not None, rule_programs)))
    best = min((k for k, v in timed.items() if isinstance(v, float)), key=timed.get)
    return dict(shape=shape, bs=bs, layer="sliding" if window else "full", keys=keys,
                default_us=round(default, 1),
                rule=rule, rule_us=timed.get(rule), best=best, best_us=timed[best],
                rule_tbps=(round(nbytes / timed[rule] / 1e6, 2) if isinstance(timed.get(rule), float)
                           else None),
                programs=programs, settings=timed)


def extend_case(shape: str, window: int | None, dev: torch.device, z: Sizes) -> dict:
    """A prefill of `prefill_reqs` requests x `prefill_len` new tokens (no prefix): `unified_attention`'s
    extend programs over EXTEND_SETTINGS against the default mode's `extend_attention`."""
    H, HKV, D = SHAPES[shape]
    g = torch.Generator(device=dev).manual_seed(0)
    R, N = z.prefill_reqs, z.prefill_len
    T = R * N
    k_buf = torch.randn(T + 1, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    v_buf = torch.randn(T + 1, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    q = torch.randn(T, H, D, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty(T, H, D, device=dev, dtype=torch.bfloat16)
    perm = (torch.randperm(T, device=dev, generator=g) + 1).to(torch.int32).view(R, N)
    table = torch.zeros(R + 1, z.max_context, dtype=torch.int32, device=dev)
    table[1:, :N] = perm
    rows = torch.arange(1, R + 1, device=dev)
    seq = torch.full((R,), N, dtype=torch.int32, device=dev)
    qo = torch.arange(0, T + 1, N, dtype=torch.int32, device=dev)
    f2s = torch.arange(T + 1, dtype=torch.int32, device=dev) if window else None
    flat = perm.flatten().long()
    k_new, v_new = k_buf[flat].contiguous(), v_buf[flat].contiguous()
    zeros = torch.zeros(R + 1, dtype=torch.int32, device=dev)
    default = graph_us(lambda i: extend_attention(q, k_new, v_new, out, k_buf, v_buf, qo, zeros, zeros[:1],
                                                  zeros[:R], D**-0.5, max_extend_len=N, window=window), 1)
    timed = {}
    for s in EXTEND_SETTINGS:
        try:
            us = graph_us(lambda i: unified_attention(q, out, k_buf, v_buf, table, rows, seq, qo, D**-0.5,
                                                      max_extend_len=N, window=window, full_to_swa=f2s,
                                                      launch=s), 1)
            timed["x".join(map(str, s))] = round(us, 1)
        except Exception as e:  # out of shared memory or registers: not a candidate
            timed["x".join(map(str, s))] = type(e).__name__
    _, warps, stages = unified_config(D, 2)
    rule = f"{BLOCK_M}x{warps}x{stages}"
    best = min((k for k, v in timed.items() if isinstance(v, float)), key=timed.get)
    return dict(shape=shape, layer="sliding" if window else "full", prefill=f"{R}x{N}",
                default_us=round(default, 1), rule=rule, rule_us=timed.get(rule), best=best,
                best_us=timed[best], settings=timed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,4b,12b", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--extend", action="store_true", help="time extend (prefill) programs instead")
    d = Sizes()
    ap.add_argument("--context", type=int, default=d.ctx, help="keys per request (decode)")
    ap.add_argument("--max-context", type=int, default=d.max_context, help="the request table's width")
    ap.add_argument("--window", type=int, default=d.window, help="sliding layers' window")
    ap.add_argument("--prefill", default=f"{d.prefill_reqs}x{d.prefill_len}",
                    help="--extend: REQSxTOKENS, or a comma list of them")
    ap.add_argument("--calls", type=int, default=d.calls, help="calls per graph, each over its own keys")
    args = parse_args(ap, argv, smoke=dict(shapes="tiny", batch_sizes="2", context=48, max_context=128,
                                           window=16, prefill="2x40", calls=1))
    dev = bench_device(args.smoke)
    prefills = [tuple(int(x) for x in spec.split("x")) for spec in args.prefill.split(",")]
    z = Sizes(args.context, args.max_context, args.window, *prefills[0], args.calls)
    print(f"# {hardware()}, bf16, context {z.ctx}, max_context {z.max_context}")
    if args.extend:
        for reqs, tokens in prefills:
            zp = Sizes(args.context, args.max_context, args.window, reqs, tokens, args.calls)
            for shape in args.shapes.split(","):
                for window in (None, z.window):
                    print(json.dumps(extend_case(shape, window, dev, zp)), flush=True)
        return
    rows = []
    for shape in args.shapes.split(","):
        for bs in map(int, args.batch_sizes.split(",")):
            for window in (None, z.window):
                r = case(shape, bs, window, dev, z)
                print(json.dumps(r), flush=True)
                rows.append(r)
                empty_cache(dev)
    print(f"\n{'shape':<5} {'bs':>4} {'layer':<8} {'default':>8} {'rule':>8} {'rule/def':>8} {'TB/s':>5}  "
          f"{'block':>7} {'chunk':>7} {'request':>7} {'req s2':>7} {'2gather':>7} {'no_map':>7}  "
          f"{'programs':<8} {'launch':<8} best")
    for r in rows:
        p = r["programs"]
        print(f"{r['shape']:<5} {r['bs']:>4} {r['layer']:<8} {r['default_us']:>8} {r['rule_us']:>8} "
              f"{r['rule_us'] / r['default_us']:>7.2f}x {r['rule_tbps']:>5}  {p['block']:>7} {p['chunk']:>7} "
              f"{p['request']:>7} {p['request_2_stages']:>7} {p.get('two_gathers', '-'):>7} "
              f"{p.get('no_map', '-'):>7}  {p['rule']:<8} {r['rule']:<8} {r['best']} {r['best_us']}")

if __name__ == "__main__":
    main()
