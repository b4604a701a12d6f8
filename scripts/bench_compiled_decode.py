"""Batch-1 decode with and without `--compile-decode`, as two engines in one process
taking turns (the order flips every round), so that both see the same machine
state: one 448x448 image request, greedy, EOS ignored; the median time per output
token of each, and their ratio.

    python scripts/bench_compiled_decode.py MODEL_DIR [--dtype bfloat16] [--quantization int8]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
from PIL import Image

from foveal import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=33)
    args = parser.parse_args()
    options = dict(max_model_len=2048, kv_cache_memory_bytes=1 << 29, max_num_seqs=1,
                   dtype=args.dtype, quantization=args.quantization)
    engines = {"eager": LLM(model=args.model, **options),
               "compiled": LLM(model=args.model, compile_decode=True, **options)}
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (448, 448, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "Describe the picture."}]}]
    greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)  # noqa: E731
    tokens = {}
    for llm in engines.values():
        tokens[llm] = llm.chat(messages, greedy(args.tokens), use_tqdm=False)[0].outputs[0].token_ids
    same = len({tuple(t) for t in tokens.values()}) == 1
    tpot: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        order = list(engines.items()) if round_ % 2 == 0 else list(engines.items())[::-1]
        for name, llm in order:
            metrics = llm.chat(messages, greedy(args.tokens), use_tqdm=False)[0].metrics
            tpot[name].append((metrics.last_token_time - metrics.first_token_time) * 1000
                              / (args.tokens - 1))
    label = args.dtype + (f" {args.quantization}" if args.quantization else "")
    for name, values in tpot.items():
        print(f"{label} {name}: TPOT median {statistics.median(values):.1f} ms "
              f"({', '.join(f'{v:.1f}' for v in values)})")
    ratio = statistics.median(tpot["compiled"]) / statistics.median(tpot["eager"])
    print(f"{label} compiled / eager: {ratio:.3f}; same greedy tokens: {same}")


if __name__ == "__main__":
    main()
