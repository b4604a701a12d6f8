"""One decode step's attention for one layer of the `small` preset (14 query heads, 2 KV
heads of 64, 280 context positions in 16-token blocks), warm and right after a 64 MB
read (as in a step, where the layer's weights have just streamed through the caches):
torch's gather + SDPA (the SDPA backend's decode path) against the native decode
attention (foveal/kernels). Medians of 300 calls.

    python scripts/bench_cold_attention.py [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from foveal.kernels.native import native_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK, CONTEXT = 14, 2, 64, 16, 280


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = native_kernels()
    cache = torch.randn(2, 1365, BLOCK, KV_HEADS, HEAD_DIM)
    slots = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    tables = torch.arange(40, 40 + CONTEXT // BLOCK + 1, dtype=torch.int32)[None]
    positions = torch.arange(CONTEXT)
    flat = tables[0][positions // BLOCK].long() * BLOCK + positions % BLOCK
    lens = torch.tensor([CONTEXT], dtype=torch.int32)
    slot_mapping = flat[-1:].clone()
    q = torch.randn(1, HEADS, HEAD_DIM)
    k, v = torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    stream = torch.randn(16 << 20)  # 64 MB

    def torch_ops():
        slots[0][slot_mapping], slots[1][slot_mapping] = k, v
        keys = slots[0].index_select(0, flat).view(1, CONTEXT, KV_HEADS, HEAD_DIM)
        values = slots[1].index_select(0, flat).view(1, CONTEXT, KV_HEADS, HEAD_DIM)
        return F.scaled_dot_product_attention(
            q.view(1, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), keys.transpose(1, 2),
            values.transpose(1, 2), scale=HEAD_DIM ** -0.5)

    def native():
        return kernels.decode_attention(q, k, v, slots, slot_mapping, tables, BLOCK, lens,
                                        HEAD_DIM ** -0.5, None)

    def median_us(call, before) -> float:
        times = []
        for _ in range(300):
            before()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e6

    torch.testing.assert_close(native().view(1, KV_HEADS, -1, HEAD_DIM), torch_ops(),
                               rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        for name, call in (("torch gather + SDPA", torch_ops), ("native", native)):
            warm = median_us(call, lambda: None)
            cold = median_us(call, lambda: stream.sum())
            print(f"{name:20s} warm {warm:6.0f} us   after a 64 MB read {cold:6.0f} us")


if __name__ == "__main__":
    main()
