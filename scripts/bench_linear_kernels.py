"""Per-call time of one linear layer on this CPU: fp32 `F.linear` (MKL) vs the
oneDNN-blocked weights Foveal uses (`foveal.layers.linear.prepack_weights`),
in fp32 and in bf16 (which Foveal packs only where the CPU has bf16 instructions),
and the two int8 W8A8 kernels of `--quantization int8` (`foveal.layers.quantization`):
the exact per-token GEMM (`torch._int_mm`, fast with VNNI / AMX) and FBGEMM's dynamic
linear (the choice on CPUs without them). With --compiled, for 1-4 rows, also the
reduction compiled decode steps run (`foveal.layers.linear.small_batch_linear` under
torch.compile) on the dense fp32 and bf16 weights.

With --int8-rows, instead: the exact int8 GEMM of a decode step by row count, the
native VNNI kernel (foveal/kernels) against `torch._int_mm`, summed over `small`'s
four projections (qkv, o, gate_up, down), which sets quantization.NATIVE_INT8_ROWS.
With --layouts: oneDNN's fp32 GEMM on the blocked weight against the same GEMM on the
plain (dense) weight, for `small`'s LM head and three projections.
With --model-pass: one decode step's fp32 weights in model order (`small`: 24 x qkv, o,
gate_up, down, then the LM head; 1.55 GB, read once per pass as a step reads them) by
row count, the native tile kernel (foveal/kernels) against oneDNN on the same dense
weights and on blocked copies, which sets linear.NATIVE_F32_ROWS.

Each kernel cycles through COPIES different weights, so (as in a decode step,
which reads every layer once) the weights come from memory, not from the cache.

    python scripts/bench_linear_kernels.py [--compiled | --int8-rows | --layouts | --model-pass]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

OUT_FEATURES, IN_FEATURES = 9728, 896  # `small`'s gate_up projection
COPIES = 24  # 24 x 35 MB of fp32 weights: more than the 300 MB L3 of some Xeons
REPEATS = 5


def streamed(make, total_mb: int) -> list:
    """Enough copies of the tensor make() builds to hold total_mb MB, so that cycling
    through them streams it from memory as a decode step does, not from the cache."""
    first = make()
    count = -(-total_mb * 2 ** 20 // (first.numel() * first.element_size()))
    return [first] + [make() for _ in range(count - 1)]


def onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T through oneDNN's GEMM, on a blocked or a dense weight (as prepack_weights uses it)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def median_ms(fn, weights) -> float:
    """Median over REPEATS passes of one call per weight, per call."""
    for weight in weights:
        fn(weight)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for weight in weights:
            fn(weight)
        times.append((time.perf_counter() - start) / len(weights))
    return 1000 * statistics.median(times)


SMALL_PROJECTIONS = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (N, K)


def int8_rows() -> None:
    from foveal.kernels.native import native_kernels

    kernels = native_kernels()
    if kernels is None or not kernels.has_int8:
        raise SystemExit("the native int8 kernel is not built on this CPU (it needs AVX-512 VNNI)")
    # 96 MB of each weight: 3x a 32 MB L3
    weights = {(n, k): streamed(lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8), 96)
               for n, k in SMALL_PROJECTIONS}
    print(f"{'rows':>5} {'native us':>10} {'torch._int_mm us':>17} {'ratio':>6}")
    for rows in (1, 2, 4, 6, 8, 10, 12, 16, 24, 32, 64):
        native_us = int_mm_us = 0.0
        for (n, k), stack in weights.items():
            x = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
            assert torch.equal(kernels.gemv_int8(x, stack[0]), torch._int_mm(x, stack[0].t()))
            native_us += 1000 * median_ms(lambda w: kernels.gemv_int8(x, w), stack)
            int_mm_us += 1000 * median_ms(lambda w: torch._int_mm(x, w.t()), stack)
        print(f"{rows:>5} {native_us:>10.0f} {int_mm_us:>17.0f} {native_us / int_mm_us:>6.2f}")


def layouts() -> None:
    shapes = [(32000, 896), (896, 4864), (1152, 896), (9728, 896)]  # LM head, down, qkv, gate_up
    print(f"{'weight':>11} {'rows':>5} {'blocked ms':>11} {'dense ms':>9} {'dense / blocked':>16}")
    for n, k in shapes:
        weights = streamed(lambda: torch.randn(n, k) * 0.02, 384)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        for rows in (1, 4, 16, 273, 2048):
            x = torch.randn(rows, k)
            blocked = median_ms(lambda p: onednn(x, p), packed)
            dense = median_ms(lambda w: onednn(x, w), weights)
            print(f"{n:>5}x{k:<5} {rows:>5} {blocked:>11.2f} {dense:>9.2f} {dense / blocked:>16.2f}")


def model_pass() -> None:
    from foveal.kernels.native import native_kernels

    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not built on this CPU")
    weights = [torch.randn(n, k) * 0.02 for n, k in SMALL_PROJECTIONS * 24 + [(32000, 896)]]
    blocked = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    gigabytes = sum(w.numel() * 4 for w in weights) / 1e9
    flops = 2 * sum(w.numel() for w in weights)
    print(f"{gigabytes:.2f} GB of fp32 weights per pass, median of {REPEATS} alternated passes")
    print(f"{'rows':>5} {'native ms':>10} {'oneDNN dense ms':>16} {'oneDNN blocked ms':>18} "
          f"{'native / dense':>15} {'native GFLOP/s':>15}")
    for rows in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        inputs = {k: torch.randn(rows, k) for _, k in SMALL_PROJECTIONS}
        for weight in weights[:4]:
            x = inputs[weight.shape[1]]
            torch.testing.assert_close(kernels.gemv(x, weight), onednn(x, weight), rtol=1e-4, atol=1e-4)
        passes = {"native": lambda: [kernels.gemv(inputs[w.shape[1]], w) for w in weights],
                  "dense": lambda: [onednn(inputs[w.shape[1]], w) for w in weights],
                  "blocked": lambda: [onednn(inputs[w.shape[1]], p) for w, p in zip(weights, blocked)]}
        times = {name: [] for name in passes}
        for repeat in range(REPEATS):
            for name in (list(passes) if repeat % 2 == 0 else list(passes)[::-1]):
                start = time.perf_counter()
                passes[name]()
                times[name].append(1000 * (time.perf_counter() - start))
        native, dense, packed = (statistics.median(times[name]) for name in passes)
        print(f"{rows:>5} {native:>10.1f} {dense:>16.1f} {packed:>18.1f} {native / dense:>15.2f} "
              f"{rows * flops / native / 1e6:>15.0f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compiled", action="store_true",
                        help="also time compiled decode steps' reduction (rows 1-4)")
    parser.add_argument("--int8-rows", action="store_true",
                        help="native int8 kernel vs torch._int_mm by row count")
    parser.add_argument("--layouts", action="store_true",
                        help="oneDNN fp32 on blocked vs dense weights")
    parser.add_argument("--model-pass", action="store_true",
                        help="a decode step's fp32 weights in model order: native vs oneDNN by rows")
    args = parser.parse_args()
    if args.model_pass:
        model_pass()
        return
    if args.int8_rows:
        int8_rows()
        return
    if args.layouts:
        layouts()
        return
    from foveal.cpu_features import cpu_features
    from foveal.layers.linear import packs_bf16, small_batch_linear
    from foveal.layers.quantization import int8_kernel, int8_linear, pack_fbgemm, quantize_int8
    from foveal.worker.compiled_decode import MAX_ROWS

    print(cpu_features().describe(), f"{torch.get_num_threads()} threads; "
          f"--quantization int8 runs the {int8_kernel()} kernel here")
    weights = [torch.randn(OUT_FEATURES, IN_FEATURES) * 0.02 for _ in range(COPIES)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    packed_bf16 = ([torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in weights]
                   if packs_bf16() else None)
    quantized = [quantize_int8(w) for w in weights]
    fbgemm = [(q, s, pack_fbgemm(q, s)) for q, s in quantized]
    compiled = torch.compile(small_batch_linear, dynamic=False) if args.compiled else None
    weights_bf16 = [w.bfloat16() for w in weights] if args.compiled else None
    print(f"{'M':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'bf16 oneDNN ms':>15} "
          f"{'int8 exact ms':>14} {'int8 FBGEMM ms':>15}"
          + (f" {'compiled ms':>12} {'bf16 compiled ms':>17}" if compiled else ""))
    for rows in (1, 2, 4, 8, 32, 256, 1024):
        x = torch.randn(rows, IN_FEATURES)
        x_bf16 = x.bfloat16()
        dense = median_ms(lambda w: F.linear(x, w), weights)
        blocked = median_ms(lambda p: onednn(x, p), packed)
        half = median_ms(lambda p: onednn(x_bf16, p), packed_bf16) if packed_bf16 else float("nan")
        exact = median_ms(lambda q: int8_linear(x, q[0], q[1], None), quantized)
        dynamic = median_ms(lambda q: int8_linear(x, q[0], q[1], None, q[2]), fbgemm)
        line = (f"{rows:>5} {dense:>12.2f} {blocked:>10.2f} {half:>15.2f} {exact:>14.2f} "
                f"{dynamic:>15.2f}")
        if compiled is not None and rows <= MAX_ROWS:
            if rows > 1:  # as compiled_decode.py: one graph for 2..MAX_ROWS rows
                torch._dynamo.mark_dynamic(x, 0, min=2, max=MAX_ROWS)
                torch._dynamo.mark_dynamic(x_bf16, 0, min=2, max=MAX_ROWS)
            line += (f" {median_ms(lambda w: compiled(x, w), weights):>12.2f}"
                     f" {median_ms(lambda w: compiled(x_bf16, w), weights_bf16):>17.2f}")
        print(line)


if __name__ == "__main__":
    main()
