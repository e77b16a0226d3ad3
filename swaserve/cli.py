"""Command line: `swaserve generate | serve`. Builds configs from flags (declared once, `swaserve.options`);
no engine logic here."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from swaserve.options import (
    add_engine_flags,
    add_model_flags,
    add_serve_flags,
    add_server_flags,
    engine_options,
)


def _generate(args: argparse.Namespace) -> int:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams
    from swaserve.tokenizer import Tokenizer, load_chat_template

    template = load_chat_template(args.chat_template)
    prompt, stop_ids, parser = args.prompt, [], None
    if args.chat:
        from swaserve.chat import chat_for

        # Checked before the weights load: chat on a base model is an error, not a silent default format.
        chat = chat_for(Tokenizer.load(args.model).with_chat_template(template))
        prompt, stop_ids = chat.prompt_ids([{"role": "user", "content": prompt}]), chat.stop_token_ids
        parser = chat.reply_parser()  # GPT-OSS: the reasoning goes to stderr, the answer to stdout
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, top_p=args.top_p,
                            stop_token_ids=stop_ids)
    engine = Engine(args.model, device=args.device, dtype=args.dtype, chat_template=template, **engine_options(args))
    engine.add_request("cli", prompt, params)
    printed = 0
    while engine.has_unfinished():
        for out in engine.step():
            if parser is not None:
                ids = out.outputs[0].token_ids
                _write(parser.feed(ids[printed:]))
                printed = len(ids)
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    if parser is not None:
        _write(parser.finish())
    sys.stdout.write("\n")
    return 0


def _write(delta: Any) -> None:
    if delta.reasoning:
        sys.stderr.write(delta.reasoning)
        sys.stderr.flush()
    if delta.content:
        sys.stdout.write(delta.content)
        sys.stdout.flush()


def _serve(args: argparse.Namespace) -> int:
    from swaserve.server.launch import serve_main

    return serve_main(args)


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
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template (an error if it has none: see --chat-template); "
                          "GPT-OSS: its harmony format, the reasoning printed to stderr and the answer to stdout")
    add_model_flags(gen)
    add_engine_flags(gen)
    add_server_flags(gen, only=("chat_template",))
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                         description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
                                     "(an HTTP frontend process and one engine-core process per "
                                     "--data-parallel-size replica).")
    add_serve_flags(srv)
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
