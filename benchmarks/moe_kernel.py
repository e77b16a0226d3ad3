"""Fused MoE kernel at a real expert shape vs the bytes of the experts it hits.

Gemma-4-26B-A4B (default; hidden 2816, 128 experts, top-8, intermediate 704, bf16) or GPT-OSS (`--model
gpt-oss-20b|gpt-oss-120b`: hidden 2880, 32 / 128 experts, top-4, intermediate 2880, biases and the clamped
SwiGLU; MXFP4 experts as released and the same shape in bf16, side by side): microseconds per call in a
CUDA graph (CUDA-event timed replays), the bytes it must read (the stored weights of the distinct experts
the routing hits, counted from the ids: MXFP4 codes + scales + bf16 biases, or bf16 weights (+ biases);
plus x and the output) and the fraction of the measured copy bandwidth; for Gemma 4 also the pair sort and
the combine alone, so the two GEMMs' share is the rest. JSON lines, then a table. Then the pair sort alone
(`align_pairs`, the one-program kernel up to 2048 pairs) at decode sizes over 128 and 256 experts, and
the router's selection from its logits (top k, weights, Gemma 4's per-expert scale): the torch ops the
routers ran before `kernels.router_topk`, against its one launch.

    python benchmarks/moe_kernel.py [--model gpt-oss-20b] [--tokens 1,16,64,256] [--calls 10] [--block-k 128]
    python benchmarks/moe_kernel.py --model gpt-oss-20b --variants bits:64:4:3,float:64:4:3,group:64:8:3
        # MXFP4 dequantisation modes x tiles (mode:block_n:warps:stages), one row each, to pick the default
    python benchmarks/moe_kernel.py --align-only --align-tokens 1,16,64,128,256 --align-experts 128,256
        # the pair sort alone: us per call by tokens (x the model's top-k) and experts
    python benchmarks/moe_kernel.py --router-only   # the router's selection: torch ops vs route_topk
    python benchmarks/moe_kernel.py --smoke     # a tiny expert shape, Triton's interpreter on the CPU (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, copy_bandwidth, graph_us, hardware, parse_args  # noqa: E402

# hidden, experts, top-k, expert intermediate per model.
SHAPES = {"gemma4-26b-a4b": "2816,128,8,704", "gpt-oss-20b": "2880,32,4,2880", "gpt-oss-120b": "2880,128,4,2880"}


def expected_experts_hit(n: int, E: int, K: int) -> float:
    """Distinct experts among n tokens' top-k picks under uniform routing."""
    return E * (1 - (1 - K / E) ** n)


def experts(model: str, H: int, E: int, I: int, dev: torch.device, g: torch.Generator) -> dict[str, dict]:
    """Per format: `fused_moe`'s weights, activation and keyword arguments (scales, biases, SwiGLU)."""
    w1 = (0.02 * torch.randn(E, 2 * I, H, generator=g, device=dev)).bfloat16()
    w2 = (0.02 * torch.randn(E, H, I, generator=g, device=dev)).bfloat16()
    if not model.startswith("gpt-oss"):
        return {"bf16": {"w_gate_up": w1, "w_down": w2, "activation": "gelu_tanh"}}
    bias = {"gate_up_bias": (0.05 * torch.randn(E, 2 * I, generator=g, device=dev)).bfloat16(),
            "down_bias": (0.05 * torch.randn(E, H, generator=g, device=dev)).bfloat16()}
    act = {"activation": "swiglu_oai", "alpha": 1.702, "limit": 7.0}

    def mx(rows: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:  # MXFP4 codes, scales 2^-8 / 2^-7
        codes = torch.randint(0, 256, (E, rows, n_in // 32, 16), generator=g, device=dev, dtype=torch.uint8)
        return codes, torch.randint(119, 121, (E, rows, n_in // 32), generator=g, device=dev, dtype=torch.uint8)

    (b1, s1), (b2, s2) = mx(2 * I, H), mx(H, I)
    return {"mxfp4": {"w_gate_up": b1, "w_down": b2, "gate_up_scales": s1, "down_scales": s2, **bias, **act},
            "bf16": {"w_gate_up": w1, "w_down": w2, **bias, **act}}


def with_variants(formats: dict, variants: str | None) -> list[tuple[str, dict]]:
    """The formats to time: each as built, then the MXFP4 one again per `--variants` entry (its tuning)."""
    from swaserve.kernels.moe_gemm import MX_MODES as modes

    out = list(formats.items())
    for v in (variants.split(",") if variants and "mxfp4" in formats else []):
        mode, bn, warps, stages, *split = v.split(":")
        tuning = {"mx_mode": modes[mode], "num_warps": int(warps)}
        if split and int(split[0]):
            tuning["split_k"] = int(split[0])
        if int(bn):
            tuning["block_n"] = int(bn)
        if int(stages):
            tuning["num_stages"] = int(stages)
        out.append((f"mxfp4[{v}]", {**formats["mxfp4"], "tuning": tuning}))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma4-26b-a4b", choices=sorted(SHAPES), help="expert form and shape")
    ap.add_argument("--tokens", default="1,16,64,256", help="comma-separated token counts n")
    ap.add_argument("--calls", type=int, default=10, help="calls captured in one graph (distinct routings)")
    ap.add_argument("--shape", default=None, help="HIDDEN,EXPERTS,TOP_K,INTERMEDIATE (default: the model's)")
    ap.add_argument("--block-k", type=int, default=None, help="MXFP4: inputs per GEMM step (default 128)")
    ap.add_argument("--variants", default=None,
                    help="MXFP4: comma-separated MODE:BLOCK_N:WARPS:STAGES[:SPLIT_K] (MODE bits, float, group, "
                         "scaled or lut; 0 keeps the default; SPLIT_K 1 turns the decode split off), each timed "
                         "as its own row")
    ap.add_argument("--align-tokens", default="1,16,64,128,256", help="the pair sort alone: token counts")
    ap.add_argument("--align-experts", default="128,256", help="the pair sort alone: expert counts")
    ap.add_argument("--align-only", action="store_true", help="time the pair sort alone, not the experts")
    ap.add_argument("--router-only", action="store_true", help="time the router's selection alone")
    a = parse_args(ap, argv, smoke=dict(tokens="1,5", calls=1, shape="64,8,2,32", variants="group:16:4:2",
                                        align_tokens="1,5", align_experts="8,6"))
    H, E, K, I = (int(x) for x in (a.shape or SHAPES[a.model]).split(","))
    from swaserve.kernels.pdl import pdl_supported

    dev = bench_device(a.smoke)
    bw = copy_bandwidth(dev)
    print(f"# {hardware()}; copy bandwidth {bw / 1e12:.2f} TB/s; PDL {'on' if pdl_supported() else 'off'}; "
          f"{a.model} experts: hidden {H}, {E} experts top-{K}, intermediate {I}", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    if not (a.align_only or a.router_only):
        expert_rows(a, H, E, K, I, dev, bw, g)
    if not a.router_only:
        align_rows(a, K, dev, g)
    router_rows(a, E, K, dev, g)


def expert_rows(a: argparse.Namespace, H: int, E: int, K: int, I: int, dev: torch.device, bw: float,
                g: torch.Generator) -> None:
    """`fused_moe` per format and token count: us per call, bytes, fraction of the copy roofline."""
    from swaserve.kernels.fused_moe import _block_m, combine, fused_moe
    from swaserve.kernels.moe_align import align_pairs

    formats = experts(a.model, H, E, I, dev, g)
    rows = []
    for n in [int(t) for t in a.tokens.split(",")]:
        # One routing per captured call, so consecutive calls hit different experts as layers do.
        xs = [torch.randn(n, H, generator=g, device=dev).bfloat16() for _ in range(a.calls)]
        logits = [torch.randn(n, E, generator=g, device=dev) for _ in range(a.calls)]
        routes = [torch.softmax(z, -1).topk(K, -1) for z in logits]
        ws = [(w / w.sum(-1, keepdim=True)).float() for w, _ in routes]
        ids = [i for _, i in routes]
        hit = sum(int(torch.unique(i).numel()) for i in ids) / a.calls
        bm = _block_m(n * K, E)
        for fmt, kw in with_variants(formats, a.variants):
            kw = dict(kw)
            w1, w2, act = kw.pop("w_gate_up"), kw.pop("w_down"), kw.pop("activation")
            if fmt.startswith("mxfp4") and a.block_k:
                kw["block_k"] = a.block_k
            stored = [w1, w2, *(v for v in kw.values() if isinstance(v, torch.Tensor))]  # + scales, biases
            per_expert = sum(t[0].numel() * t.element_size() for t in stored)
            us = graph_us(lambda i: fused_moe(xs[i], w1, w2, ws[i], ids[i], act, **kw), calls=a.calls)  # noqa: B023
            nbytes = hit * per_expert + 2 * n * H * xs[0].element_size()  # hit experts as stored, x in, out
            r = dict(model=a.model, format=fmt, tokens=n, experts_hit=round(hit, 1),
                     experts_expected=round(expected_experts_hit(n, E, K), 1), block_m=bm, us=round(us, 1),
                     mb=round(nbytes / 1e6, 1), gb_per_s=round(nbytes / us / 1e3, 1),
                     roofline_us=round(nbytes / bw * 1e6, 1), roofline_frac=round(nbytes / bw / (us * 1e-6), 3))
            if not a.model.startswith("gpt-oss"):
                r["align_us"] = round(graph_us(lambda i: align_pairs(ids[i], E, bm), calls=a.calls), 1)  # noqa: B023
                ys = torch.randn(n * K, H, generator=g, device=dev).bfloat16()
                comb = graph_us(lambda i: combine(ys, ws[i], None, torch.bfloat16), calls=a.calls)  # noqa: B023
                r["combine_us"] = round(comb, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'format':>6} {'tokens':>6} {'experts':>7} {'us':>8} {'MB':>7} {'GB/s':>7} {'roof us':>8} "
          f"{'of roof':>8}")
    for r in rows:
        print(f"{r['format']:>6} {r['tokens']:>6} {r['experts_hit']:>7} {r['us']:>8} {r['mb']:>7} "
              f"{r['gb_per_s']:>7} {r['roofline_us']:>8} {r['roofline_frac'] * 100:>7.1f}%")
    us = {(r["format"], r["tokens"]): r["us"] for r in rows}
    for n in sorted({r["tokens"] for r in rows}):
        if ("mxfp4", n) in us and ("bf16", n) in us:
            print(f"# {n} tokens: MXFP4 {us['mxfp4', n]} us, bf16 {us['bf16', n]} us "
                  f"({us['bf16', n] / us['mxfp4', n]:.2f}x)")


def align_rows(a: argparse.Namespace, K: int, dev: torch.device, g: torch.Generator) -> None:
    """`align_pairs` alone (its block_m as `fused_moe` picks it), one routing per captured call."""
    from swaserve.kernels.fused_moe import _block_m
    from swaserve.kernels.moe_align import align_pairs

    rows = []
    for E in [int(e) for e in a.align_experts.split(",")]:
        for n in [int(t) for t in a.align_tokens.split(",")]:
            ids = [torch.randn(n, E, generator=g, device=dev).topk(min(K, E), -1).indices for _ in range(a.calls)]
            bm = _block_m(n * K, E)
            us = graph_us(lambda i: align_pairs(ids[i], E, bm), calls=a.calls)  # noqa: B023
            r = {"kernel": "align_pairs", "experts": E, "tokens": n, "pairs": n * K, "block_m": bm, "us": round(us, 1)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'experts':>7} {'tokens':>6} {'pairs':>6} {'block_m':>7} {'align us':>9}")
    for r in rows:
        print(f"{r['experts']:>7} {r['tokens']:>6} {r['pairs']:>6} {r['block_m']:>7} {r['us']:>9}")


def router_rows(a: argparse.Namespace, E: int, K: int, dev: torch.device, g: torch.Generator) -> None:
    """The router's selection from its logits, us per call: Gemma 4's torch ops (softmax over all, top k,
    renormalised, times the per-expert scale; bf16 logits), GPT-OSS's (top k of float32 logits, softmax
    over them) and MiMo-V2-Flash's (sigmoid, correction bias, top k, the unbiased scores renormalised;
    one group), each against its one launch (`route_topk`, `route_grouped`)."""
    from swaserve.kernels.router_topk import route_grouped, route_topk

    def gemma4(z: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(torch.softmax(z, dim=-1, dtype=torch.float32), K, dim=-1)
        return top / top.sum(dim=-1, keepdim=True) * scale[ids], ids

    def gpt_oss(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(z, K, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def mimo(z: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = z.sigmoid()
        ids = (scores + bias).topk(K, dim=-1).indices
        w = scores.gather(1, ids)
        return w / (w.sum(-1, keepdim=True) + 1e-20), ids

    scale = torch.rand(E, generator=g, device=dev).bfloat16() + 0.5
    bias = 0.1 * torch.randn(E, generator=g, device=dev)
    grouped = E & (E - 1) == 0 and E >= 2
    rows = []
    for n in [int(t) for t in a.tokens.split(",")]:
        zs = [torch.randn(n, E, generator=g, device=dev) for _ in range(a.calls)]
        zb = [z.bfloat16() for z in zs]
        r = {"kernel": "router", "experts": E, "top_k": K, "tokens": n,
             "gemma4_torch_us": round(graph_us(lambda i: gemma4(zb[i], scale), calls=a.calls), 1),  # noqa: B023
             "gemma4_fused_us": round(graph_us(lambda i: route_topk(zb[i], K, scale), calls=a.calls), 1),  # noqa: B023
             "gpt_oss_torch_us": round(graph_us(lambda i: gpt_oss(zs[i]), calls=a.calls), 1),  # noqa: B023
             "gpt_oss_fused_us": round(graph_us(lambda i: route_topk(zs[i], K), calls=a.calls), 1)}  # noqa: B023
        if grouped:
            r["mimo_torch_us"] = round(graph_us(lambda i: mimo(zs[i], bias), calls=a.calls), 1)  # noqa: B023
            r["mimo_fused_us"] = round(graph_us(lambda i: route_grouped(zs[i], bias, K, 1, 1, True, 1.0),  # noqa: B023
                                                calls=a.calls), 1)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'experts':>7} {'top_k':>5} {'tokens':>6} {'Gemma 4 torch us':>17} {'fused':>6} "
          f"{'GPT-OSS torch us':>17} {'fused':>6} {'MiMo-V2 torch us':>17} {'fused':>6}")
    for r in rows:
        print(f"{r['experts']:>7} {r['top_k']:>5} {r['tokens']:>6} {r['gemma4_torch_us']:>17} {r['gemma4_fused_us']:>6} "
              f"{r['gpt_oss_torch_us']:>17} {r['gpt_oss_fused_us']:>6} {r.get('mimo_torch_us', '-'):>17} "
              f"{r.get('mimo_fused_us', '-'):>6}")


if __name__ == "__main__":
    main()
