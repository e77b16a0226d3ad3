"""Side by side with HF transformers on the same GPU in one call: fixed-batch generation on a
random-weight Gemma 3 shape (default 1B, batch 64, 512-token prompts, 256 new tokens), timed over
the whole generation (prefill + decode) as the HF peer script times `generate`.

    python benchmarks/vs_hf.py [--peer-dir ../shared/peers] [--caches static]
    python benchmarks/vs_hf.py --smoke     # tiny CPU run (CI; HF's static cache is not compiled on a CPU)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_device, bench_dtype, copy_bandwidth, decode_step_bytes, empty_cache, gemma3_hf_config, hardware,
    now, parse_args, random_model,
)


def ours(shape: str, bs: int, inp: int, out: int, bw: float, dev: torch.device) -> dict:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    dtype = bench_dtype(dev)
    loaded = random_model(shape, dev, dtype)
    engine = Engine(loaded, device=dev, dtype=dtype, max_running_requests=bs, max_context=inp + out + 8,
                    max_prefill_tokens=16384)
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = min(200000, loaded.config.vocab_size)
    prompts = [torch.randint(10, vocab, (inp,), generator=g).tolist() for _ in range(bs)]
    for rep in range(2):  # the first pass warms up; the second is timed
        for i, p in enumerate(prompts):
            warm = SamplingParams(temperature=0, max_tokens=min(16, out))
            engine.add_request(f"{rep}-{i}", p, params if rep else warm)
        t = now(dev)
        t_decode, decode_steps = None, 0
        while engine.has_unfinished():
            # No per-step sync (with overlap the host runs a step ahead); only finished outputs, as
            # generate() (ours and HF's) returns.
            engine.step(finished_only=True)
            if engine.last_step and engine.last_step[0] == "decode" and engine.last_step[1] == bs:
                if t_decode is None:
                    t_decode = time.perf_counter()  # the first full decode step was just launched
                decode_steps += 1
        dt = now(dev) - t
    # Decode steps from the first full-batch launch to the end (prefill excluded; the last step's
    # host processing included).
    step = (t + dt - t_decode) / max(decode_steps, 1)
    roof = decode_step_bytes(loaded, bs, inp + out // 2, dtype) / bw
    return dict(engine="swaserve", shape=shape, bs=bs, inp=inp, out=out, seconds=round(dt, 3),
                out_tok_per_s=round(bs * out / dt, 1), decode_step_ms=round(step * 1e3, 3),
                decode_roofline_frac=round(roof / step, 3))


def hf_static_warm(shape: str, bs: int, inp: int, out: int, dev: torch.device) -> dict:
    """HF `generate` with a static cache (compiled by generate), warmed up on the very shapes it is
    timed on: the shared peer script warms up with 16 new tokens, so its timed run of `out` tokens
    starts with a new cache size and compiles again inside the timing."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    cfg = gemma3_hf_config(shape)
    with dev:
        model = Gemma3ForCausalLM(cfg).to(bench_dtype(dev)).eval()
    ids = torch.randint(10, min(200000, cfg.vocab_size), (bs, inp), device=dev)
    kw = dict(max_new_tokens=out, min_new_tokens=out, do_sample=False, cache_implementation="static")
    with torch.inference_mode():
        t0 = now(dev)
        model.generate(ids, **kw)  # compiles
        warm = now(dev) - t0
        model.generate(ids, **kw)
        t = now(dev)
        res = model.generate(ids, **kw)
        dt = now(dev) - t
    n = (res.shape[1] - inp) * bs
    del model
    empty_cache(dev)
    return dict(peer="hf-static-warm", cache="static", shape=shape, bs=bs, inp=inp, out=out, seconds=round(dt, 3),
                out_tok_per_s=round(n / dt, 1), first_call_s=round(warm, 1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--inp", type=int, default=512)
    ap.add_argument("--out", type=int, default=256)
    ap.add_argument("--peer-dir", default=str(Path(__file__).resolve().parents[1] / ".peers"))
    ap.add_argument("--caches", default="static")
    ap.add_argument("--skip-peer-script", action="store_true", help="only the warmed in-process HF run")
    a = parse_args(ap, argv, smoke=dict(shape="tiny", bs=2, inp=16, out=6, skip_peer_script=True))
    dev = bench_device(a.smoke)
    bw = copy_bandwidth(dev)
    print(f"# {hardware()}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = [ours(a.shape, a.bs, a.inp, a.out, bw, dev)]
    print(json.dumps(rows[0]), flush=True)
    empty_cache(dev)
    rows.append(hf_static_warm(a.shape, a.bs, a.inp, a.out, dev))
    print(json.dumps(rows[-1]), flush=True)
    peer = Path(a.peer_dir) / "hf_decode_peer.py"
    if a.skip_peer_script:
        pass
    elif peer.exists():
        cmd = [sys.executable, str(peer), "--shape", a.shape, "--bs", str(a.bs), "--inp", str(a.inp),
               "--out", str(a.out), "--caches", a.caches]
        res = subprocess.run(cmd, capture_output=True, text=True)
        for line in res.stdout.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(line, flush=True)
        if res.returncode:
            print(res.stderr[-2000:], flush=True)
    else:
        print(f"# no HF peer script at {peer}", flush=True)
    print(f"\n{'engine':<16} {'cache':<8} {'bs':>4} {'seconds':>8} {'out tok/s':>10} {'vs HF':>6}")
    hf = [r for r in rows if r.get("peer") == "hf-static-warm"]
    for r in rows:
        ratio = r["out_tok_per_s"] / hf[0]["out_tok_per_s"] if hf and "out_tok_per_s" in r else float("nan")
        print(f"{r.get('engine', r.get('peer')):<16} {r.get('cache', '-'):<8} {r['bs']:>4} {r.get('seconds', '-'):>8} "
              f"{r.get('out_tok_per_s', r.get('error', '-')):>10} {ratio:>5.2f}x")
    if "decode_roofline_frac" in rows[0]:
        print(f"swaserve decode step {rows[0]['decode_step_ms']} ms = {rows[0]['decode_roofline_frac'] * 100:.1f}% of roofline")


if __name__ == "__main__":
    main()
