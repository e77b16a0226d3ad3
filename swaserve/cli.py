"""Command line: `swaserve generate | serve`. Builds configs from flags; no engine logic here."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF model directory (default: embedded Gemma 3 270M)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--max-context", type=int, default=None, help="max prompt + output tokens (default: model's; 4096 on CPU)")
    g.add_argument("--max-running-requests", type=int, default=None, help="requests decoded at once (default 64)")
    g.add_argument("--max-prefill-tokens", type=int, default=None, help="prefill chunk size in tokens (default 2048)")
    g.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache budget in MiB (default: 512 on CPU, 85%% of free GPU memory)")
    g.add_argument("--swa-full-tokens-ratio", type=float, default=None, help="override the SWA:full pool token ratio")
    g.add_argument("--disable-hybrid-swa", action="store_true", help="cache sliding-window layers in the full pool")
    g.add_argument("--attention-backend", choices=["triton", "torch_native"], default=None, help="default: triton on CUDA")
    g.add_argument("--disable-cuda-graph", action="store_true", help="run decode eagerly on the GPU")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="wait for each step before scheduling the next (default on a GPU: overlap them)")
    g.add_argument("--enable-cpu-graph", action="store_true",
                   help="torch.compile the CPU decode step (~1.2x faster steps, ~100 s longer start)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for name in ("max_context", "max_running_requests", "max_prefill_tokens", "swa_full_tokens_ratio", "attention_backend"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.kv_cache_mb is not None:
        kw["kv_cache_bytes"] = args.kv_cache_mb << 20
    if args.disable_hybrid_swa:
        kw["disable_hybrid_swa"] = True
    if args.disable_cuda_graph:
        kw["disable_cuda_graph"] = True
    if args.enable_cpu_graph:
        kw["enable_cpu_graph"] = True
    if args.disable_overlap_schedule:
        kw["overlap_schedule"] = False
    return kw


def _generate(args: argparse.Namespace) -> int:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, top_p=args.top_p)
    engine = Engine(args.model, device=args.device, dtype=args.dtype, **engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request("cli", prompt, params)
    printed = 0
    while engine.has_unfinished():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from swaserve.server.app import serve_main

    return serve_main(args, engine_kwargs(args)) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swaserve",
        description="Inference engine and OpenAI-compatible server for hybrid sliding-window-attention LLMs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve}")

    gen = sub.add_parser("generate", help="complete a prompt and stream it to the terminal",
                         description="Complete PROMPT with the model and stream the text as it is generated.")
    gen.add_argument("prompt", help="the text to complete")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed for reproducible output")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_engine_flags(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                         description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--served-model-name", default=None, help="model name reported by /v1/models")
    srv.add_argument("--max-body-mb", type=int, default=8, help="largest request body accepted, MiB (default 8)")
    _add_engine_flags(srv)
    srv.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"swaserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
