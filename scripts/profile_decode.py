"""Decode time of one request, then a torch profile of a few more decode steps,
grouped by op and input shape: where a decode step's time goes, per linear layer.

    FOVEAL_LINEAR_LAYOUT=packed|dense python scripts/profile_decode.py MODEL_DIR [--dtype bfloat16]

Prints the TPOT of a 12-token decode after a 40-token text prompt, then the ten
ops with the most self CPU time over 6 more decode steps (the prompt is then a
prefix-cache hit, so only its last partial block is recomputed).
"""
from __future__ import annotations

import argparse
import os

import torch

from foveal import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    prompt = {"prompt_token_ids": list(range(100, 140))}
    greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)  # noqa: E731
    llm.generate(prompt, greedy(4), use_tqdm=False)  # warm-up
    metrics = llm.generate(prompt, greedy(12), use_tqdm=False)[0].metrics
    tpot = (metrics.last_token_time - metrics.first_token_time) * 1000 / 11
    print(f"linear layout {os.environ.get('FOVEAL_LINEAR_LAYOUT', 'packed')}: "
          f"TPOT {tpot:.1f} ms", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as profile:
        llm.generate(prompt, greedy(6), use_tqdm=False)
    print(profile.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=30,
        max_shapes_column_width=60))


if __name__ == "__main__":
    main()
