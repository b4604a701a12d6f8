"""`foveal demo`: build the embedded tiny checkpoint if missing, then answer a
question about the image the package ships. Runs offline on any machine."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

DEMO_IMAGE = Path(__file__).resolve().parent.parent / "assets" / "demo.png"


def default_cache_dir() -> Path:
    root = os.environ.get("FOVEAL_CACHE") or Path.home() / ".cache" / "foveal"
    return Path(root)


def run_demo(args: argparse.Namespace) -> int:
    from foveal import LLM, SamplingParams
    from foveal.loader.tiny_model import ensure_tiny_checkpoint

    model_dir = ensure_tiny_checkpoint(default_cache_dir() / args.preset, args.preset)
    print(f"model: {model_dir} ({args.preset}, random weights built offline)")
    llm = LLM(model=str(model_dir), max_model_len=2048)
    question = args.question
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(DEMO_IMAGE)}},
        {"type": "text", "text": question}]}]
    start = time.perf_counter()
    output = llm.chat(messages, SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                      use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    metrics = llm.get_metrics()
    print(f"image: {DEMO_IMAGE}")
    print(f"question: {question}")
    print(f"answer: {output.outputs[0].text!r}")
    print("(the weights are random, so the answer is noise; the pipeline is real)")
    print(f"prompt tokens: {len(output.prompt_token_ids)} "
          f"(visual: {int(metrics.get('foveal:visual_tokens_total', 0))}), "
          f"generated: {len(output.outputs[0].token_ids)}, "
          f"finish: {output.outputs[0].finish_reason}, {elapsed:.2f} s")
    return 0


def register(subparsers) -> None:
    demo = subparsers.add_parser(
        "demo", help="run the embedded tiny model on the shipped image (offline)",
        description="Builds a tiny random-weight Qwen2-VL checkpoint into the cache folder "
                    "($FOVEAL_CACHE or ~/.cache/foveal) if missing, then answers a question "
                    "about foveal/assets/demo.png.")
    demo.add_argument("--preset", default="tiny-qwen2-vl",
                      choices=["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
    demo.add_argument("--question", default="What is in this image?")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=run_demo)
