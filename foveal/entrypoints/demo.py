"""`foveal demo`: the shipped demo model answers a question about the shipped
image, offline, on any machine. `--preset` runs a random-weight tiny
checkpoint instead (built into the cache folder once)."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

DEMO_IMAGE = Path(__file__).resolve().parent.parent / "assets" / "demo.png"
DEMO_QUESTION = "How many shapes are there?"


def default_cache_dir() -> Path:
    root = os.environ.get("FOVEAL_CACHE") or Path.home() / ".cache" / "foveal"
    return Path(root)


def _model(args: argparse.Namespace) -> tuple[Path, str]:
    if args.preset:
        from foveal.loader.tiny_model import ensure_tiny_checkpoint

        path = ensure_tiny_checkpoint(default_cache_dir() / args.preset, args.preset)
        return path, f"{args.preset}, random weights built offline: the answer is noise"
    if args.model:
        return Path(args.model), "your checkpoint"
    from foveal.demo_model import default_model_dir

    return default_model_dir(), ("the shipped demo model, trained on synthetic shapes, colours, "
                                 "counts, positions and motion")


def run_demo(args: argparse.Namespace) -> int:
    from foveal import LLM, SamplingParams

    model_dir, about = _model(args)
    print(f"model: {model_dir} ({about})")
    llm = LLM(model=str(model_dir), max_model_len=2048)
    image = Path(args.image)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(image)}},
        {"type": "text", "text": args.question}]}]
    start = time.perf_counter()
    output = llm.chat(messages, SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                      use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    metrics = llm.get_metrics()
    print(f"image: {image}")
    print(f"question: {args.question}")
    print(f"answer: {output.outputs[0].text!r}")
    print(f"prompt tokens: {len(output.prompt_token_ids)} "
          f"(visual: {int(metrics.get('foveal:visual_tokens_total', 0))}), "
          f"generated: {len(output.outputs[0].token_ids)}, "
          f"finish: {output.outputs[0].finish_reason}, {elapsed:.2f} s")
    return 0


def register(subparsers) -> None:
    demo = subparsers.add_parser(
        "demo", help="the shipped demo model answers a question about the shipped image (offline)",
        description="Runs the demo model that ships with the package (a small Qwen2-VL trained "
                    "on synthetic shapes, colours, counting, positions and motion) "
                    "on foveal/assets/demo.png. Other questions it was trained on: 'What color "
                    "is the square?', 'What shape is red?' (right about 60% of the time on "
                    "held-out images; counting 1-9 shapes 60%; docs/benchmarks.md).")
    demo.add_argument("--question", default=DEMO_QUESTION)
    demo.add_argument("--image", default=str(DEMO_IMAGE), help="image file")
    demo.add_argument("--model", help="a checkpoint folder instead of the shipped demo model")
    demo.add_argument("--preset", choices=["tiny-qwen2-vl", "tiny-qwen2.5-vl"],
                      help="a random-weight tiny checkpoint instead (built into $FOVEAL_CACHE "
                           "or ~/.cache/foveal once)")
    demo.add_argument("--max-tokens", type=int, default=16)
    demo.set_defaults(func=run_demo)
