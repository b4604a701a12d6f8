"""Per-call time of one linear layer on this CPU: fp32 `F.linear` (MKL) vs the
oneDNN-blocked weights Foveal uses (`foveal.layers.linear.prepack_weights`),
in fp32 and in bf16 (which Foveal packs only where the CPU has bf16 instructions).

    python scripts/bench_linear_kernels.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

OUT_FEATURES, IN_FEATURES = 9728, 896  # `small`'s gate_up projection
REPEATS = 7


def median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    from foveal.cpu_features import cpu_features

    print(cpu_features().describe())
    weight = torch.randn(OUT_FEATURES, IN_FEATURES)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), 1)
    print(f"{'M':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'speed-up':>9} {'bf16 oneDNN ms':>15}")
    for rows in (1, 2, 4, 8, 32, 256, 1024):
        x = torch.randn(rows, IN_FEATURES)
        x_bf16 = x.bfloat16()
        dense = median_ms(lambda: F.linear(x, weight))
        blocked = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        half = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x_bf16, packed_bf16, None, "none",
                                                                    [], ""))
        print(f"{rows:>5} {dense:>12.2f} {blocked:>10.2f} {dense / blocked:>8.2f}x {half:>15.2f}")


if __name__ == "__main__":
    main()
