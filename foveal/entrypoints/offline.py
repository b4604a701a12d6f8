"""`foveal generate` (one answer) and `foveal chat` (interactive, multi-turn)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="per-request seed (same seed, same output)")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params_from(args: argparse.Namespace):
    from foveal.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                          stop=args.stop)


def user_message(text: str, images: list[str]) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": str(Path(p).resolve())}}
             for p in images]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def run_generate(args: argparse.Namespace) -> int:
    from foveal import LLM

    llm = LLM(model=args.model, **engine_kwargs(args))
    params = sampling_params_from(args)
    if args.no_chat_template:
        images = [str(Path(p).resolve()) for p in args.image]
        prompt = {"prompt": args.prompt, "multi_modal_data": {"image": images}}
        output = llm.generate(prompt, params, use_tqdm=False)[0]
    else:
        output = llm.chat([user_message(args.prompt, args.image)], params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def _input_lines():
    if not sys.stdin.isatty():
        yield from sys.stdin
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def run_chat(args: argparse.Namespace) -> int:
    from foveal import LLM

    llm = LLM(model=args.model, **engine_kwargs(args))
    params = sampling_params_from(args)
    history: list[dict] = []
    pending_images: list[str] = []
    print("Type a message. /image PATH attaches an image to your next message; "
          "/reset clears the conversation; /exit quits.")
    for line in _input_lines():
        line = line.strip()
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history, pending_images = [], []
            continue
        if line.startswith("/image "):
            pending_images.append(line.split(maxsplit=1)[1])
            continue
        if not line:
            continue
        history.append(user_message(line, pending_images))
        pending_images = []
        answer = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
    return 0


def register(subparsers) -> None:
    generate = subparsers.add_parser("generate", help="answer one prompt (with images)",
                                     description="Answer one prompt, optionally about images.")
    generate.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    generate.add_argument("--image", action="append", default=[], metavar="PATH",
                          help="image file (repeatable)")
    generate.add_argument("--no-chat-template", action="store_true",
                          help="send the prompt as is (it must hold one <|image_pad|> per image)")
    generate.add_argument("prompt")
    _add_sampling_args(generate)
    add_engine_args(generate)
    generate.set_defaults(func=run_generate)

    chat = subparsers.add_parser("chat", help="interactive multi-turn chat",
                                 description="Chat with a model; attach images by path.")
    chat.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    _add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=run_chat)
