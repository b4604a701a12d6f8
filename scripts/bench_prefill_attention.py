"""Prefill attention on this CPU: torch SDPA called on (heads, rows, D) tensors
against the same call with a batch dimension, which is how Foveal's SDPA backend
calls it (`foveal.layers.attention.sdpa._sdpa_3d`). Torch's CPU dispatch runs 3-D
inputs on its unfused math kernel and 4-D ones on the flash kernel.

    python scripts/bench_prefill_attention.py [--heads 32] [--kv-heads 8] [--head-dim 128]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", default="608,1208,3105")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gqa = args.heads != args.kv_heads
    print(f"threads {torch.get_num_threads()}, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, causal")
    print("dtype     rows   3-D ms   4-D ms   ratio")
    for dtype in (torch.bfloat16, torch.float32):
        for length in (int(n) for n in args.lengths.split(",")):
            q = torch.randn(args.heads, length, args.head_dim, dtype=dtype)
            k = torch.randn(args.kv_heads, length, args.head_dim, dtype=dtype)
            v = torch.randn_like(k)
            three = median_ms(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=gqa), args.repeats)
            four = median_ms(lambda: F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, enable_gqa=gqa), args.repeats)
            print(f"{str(dtype).removeprefix('torch.'):9} {length:5} {three:8.1f} {four:8.1f} "
                  f"{three / four:6.1f}x")


if __name__ == "__main__":
    main()
