"""Where does GPT-OSS in bf16 part from fp32 on CUDA? The 4-layer gpt-oss-20b cut of
tests/gpu/test_gpt_oss_vs_hf.py, one prefill per prompt: ours (fp32/bf16, triton/torch_native attention)
vs HF fp32 at the last-token logits, and ours bf16 vs ours fp32 per module (attention, router, experts)
with each module also re-run on the fp32 run's inputs (its own error, not inherited)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from common import gpt_oss_hf_config
from harness import Harness
from test_gpt_oss_vs_hf import build

from swaserve.model_config import ModelConfig
from swaserve.models.registry import build_model

DEV = "cpu" if "--cpu-smoke" in sys.argv else "cuda"  # --cpu-smoke: a narrow cut, to check this script runs
BACKENDS = ("torch_native",) if DEV == "cpu" else ("triton", "torch_native")


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / (b - b.mean()).norm()).item()


def first(t):
    return t[0] if isinstance(t, tuple) else t


@torch.no_grad()
def run(cfg, ckpt, dtype, backend, prompt, capture: dict | None = None):
    config = ModelConfig.from_hf(cfg, max_context=1024)
    model = build_model(config, dtype, DEV)
    model.load_weights(ckpt.items())
    hooks = []
    if capture is not None:
        for i, layer in enumerate(model.model.layers):
            for name in ("self_attn", "mlp"):
                mod = getattr(layer, name)
                def hook(m, args, out, key=f"{i}.{name}"):
                    capture[key] = (args[0].detach().clone(), first(out).detach().float().clone())
                hooks.append(mod.register_forward_hook(hook))
    h = Harness(config, model, hybrid=True, full_tokens=2048, swa_tokens=2048, max_context=1024, dtype=dtype,
                device=DEV, backend=backend)
    row = h.add_request()
    logits = h.extend([row], [prompt])[0].float()
    h.release(row)
    for hk in hooks:
        hk.remove()
    return logits, model


@torch.inference_mode()
def main() -> None:
    cfg = gpt_oss_hf_config("20b", num_layers=4)
    if DEV == "cpu":
        cfg.update(dict(hidden_size=128, intermediate_size=128, vocab_size=512, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, pad_token_id=0))
    hf, ckpt = build(cfg, DEV)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, cfg.vocab_size, (n,), generator=g).tolist() for n in (50, 300)]
    from hf_parity import bf16_copy

    hf16 = bf16_copy(hf)
    for p in prompts:
        ref = hf(torch.tensor([p], device=DEV)).logits[0, -1].float()
        print(f"== prompt {len(p)}: logit std {ref.std().item():.3f}")
        lg = hf16(torch.tensor([p], device=DEV)).logits[0, -1].float()
        print(f"HF   bfloat16              rel rms vs HF fp32 {rel(lg, ref):.4f} max {(lg - ref).abs().max().item():.4f}")
        for dtype in (torch.float32, torch.bfloat16):
            for backend in BACKENDS:
                lg, _ = run(cfg, ckpt, dtype, backend, p)
                print(f"ours {str(dtype)[6:]:8s} {backend:12s} rel rms vs HF fp32 {rel(lg, ref):.4f} "
                      f"max {(lg - ref).abs().max().item():.4f}")
    del hf16
    p = prompts[1]
    c32, c16 = {}, {}
    _, m32 = run(cfg, ckpt, torch.float32, BACKENDS[0], p, c32)
    _, m16 = run(cfg, ckpt, torch.bfloat16, BACKENDS[0], p, c16)
    print("== per module, prompt 300, triton: rel rms of bf16 output vs fp32 (inherited) | mlp re-run on fp32 input")
    for key in c32:
        x32, y32 = c32[key]
        _, y16 = c16[key]
        line = f"{key:12s} inherited {rel(y16, y32):.4f}"
        if key.endswith("mlp"):
            i = int(key.split(".")[0])
            mlp16 = m16.model.layers[i].mlp
            mlp32 = m32.model.layers[i].mlp
            x = x32.to(torch.bfloat16)
            w16, ids16 = mlp16.router(x)
            w32, ids32 = mlp32.router(x32)
            same = (ids16.sort(-1).values == ids32.sort(-1).values).all(-1).float().mean().item()
            own = mlp16.experts(x, w16, ids16, None)
            own_ids32 = mlp16.experts(x, w32.to(torch.bfloat16), ids32, None)
            line += (f" | own {rel(own, y32):.4f}, with fp32 routing {rel(own_ids32, y32):.4f}, "
                     f"same expert sets {same:.3f}, router w rel {rel(w16, w32):.4f}")
        print(line)


if __name__ == "__main__":
    main()
