"""`conveyor generate`: one prompt through the engine, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys

from conveyor.cli.engine_args import add_engine_args, engine_args_from
from conveyor.sampling_params import SamplingParams


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text for one prompt, streamed")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from conveyor.engine.llm_engine import LLMEngine

    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (a system message goes through the chat "
                         "template)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)
    engine = LLMEngine(engine_args_from(args))
    if engine.tokenizer is None:  # (a dummy-weights preset, a folder without one)
        raise ValueError("this model has no tokenizer to read the prompt with: give one with "
                         "--tokenizer")
    prompt: str | dict = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt = {"prompt_token_ids": engine.tokenizer.encode_chat(messages)}
    engine.add_request(prompt, params)
    printed = 0
    finish_reason = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            finish_reason = output.outputs[0].finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason={finish_reason}]", file=sys.stderr)
    return 0
