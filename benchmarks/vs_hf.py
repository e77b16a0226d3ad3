"""Side by side with HF transformers on the same GPU in one call: fixed-batch generation on a
random-weight Gemma 3 shape (default 1B, batch 64, 512-token prompts, 256 new tokens), timed over
the whole generation (prefill + decode) as the HF peer script times `generate`.

    python benchmarks/vs_hf.py [--peer-dir ../shared/peers] [--caches static]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, decode_step_bytes, hardware, now, random_model  # noqa: E402


def ours(shape: str, bs: int, inp: int, out: int, bw: float) -> dict:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    dev = torch.device("cuda")
    loaded = random_model(shape, dev, torch.bfloat16)
    engine = Engine(loaded, device=dev, dtype=torch.bfloat16, max_running_requests=bs, max_context=inp + out + 8,
                    max_prefill_tokens=16384)
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 200000, (inp,), generator=g).tolist() for _ in range(bs)]
    for rep in range(2):  # the first pass warms up; the second is timed
        for i, p in enumerate(prompts):
            engine.add_request(f"{rep}-{i}", p, params if rep else SamplingParams(temperature=0, max_tokens=16))
        t = now(dev)
        decode_s, decode_steps = 0.0, 0
        while engine.has_unfinished():
            t1 = now(dev)
            engine.step()
            if engine.last_step and engine.last_step[0] == "decode" and engine.last_step[1] == bs:
                decode_s += now(dev) - t1
                decode_steps += 1
        dt = now(dev) - t
    step = decode_s / max(decode_steps, 1)
    roof = decode_step_bytes(loaded, bs, inp + out // 2, torch.bfloat16) / bw
    return dict(engine="swaserve", shape=shape, bs=bs, inp=inp, out=out, seconds=round(dt, 3),
                out_tok_per_s=round(bs * out / dt, 1), decode_step_ms=round(step * 1e3, 3),
                decode_roofline_frac=round(roof / step, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--inp", type=int, default=512)
    ap.add_argument("--out", type=int, default=256)
    ap.add_argument("--peer-dir", default=str(Path(__file__).resolve().parents[1] / ".peers"))
    ap.add_argument("--caches", default="static")
    a = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"# {hardware()}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = [ours(a.shape, a.bs, a.inp, a.out, bw)]
    print(json.dumps(rows[0]), flush=True)
    torch.cuda.empty_cache()
    peer = Path(a.peer_dir) / "hf_decode_peer.py"
    if peer.exists():
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
    hf = [r for r in rows if r.get("peer") and "out_tok_per_s" in r]
    for r in rows:
        ratio = r["out_tok_per_s"] / hf[0]["out_tok_per_s"] if hf and "out_tok_per_s" in r else float("nan")
        print(f"{r.get('engine', r.get('peer')):<16} {r.get('cache', '-'):<8} {r['bs']:>4} {r.get('seconds', '-'):>8} "
              f"{r.get('out_tok_per_s', r.get('error', '-')):>10} {ratio:>5.2f}x")
    if "decode_roofline_frac" in rows[0]:
        print(f"swaserve decode step {rows[0]['decode_step_ms']} ms = {rows[0]['decode_roofline_frac'] * 100:.1f}% of roofline")


if __name__ == "__main__":
    main()
