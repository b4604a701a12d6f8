"""Batch-1 decode with and without `--compile-decode`, as two engines in one process
taking turns (the order flips every round), so that both see the same machine
state: one 448x448 image request, greedy, EOS ignored; the median time per output
token of each, and their ratio.

    python scripts/bench_compiled_decode.py MODEL_DIR [--dtype bfloat16] [--quantization int8]
        [--compare eager|native|native-eager|tile] [--rows N]

--compare native: both engines compiled, one built with FOVEAL_NATIVE_KERNELS=0
(library GEMV / Inductor reductions, torch's attention ops; the choice is made
per layer when the engine is built), one with the native decode kernels
(foveal/kernels); native-eager: the same pair without --compile-decode. tile: one eager
fp32 engine whose linear layers switch between the native tile kernel and oneDNN on the
same dense weights before each run (their `native_rows`: NATIVE_F32_ROWS or 0), the
attention native in both. --rows N: N requests decode together.
"""
from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.kernels import native
from foveal.layers.linear import NATIVE_F32_ROWS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--compare", choices=("eager", "native", "native-eager", "tile"),
                        default="eager")
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    options = dict(max_model_len=2048, kv_cache_memory_bytes=1 << 29, max_num_seqs=args.rows,
                   dtype=args.dtype, quantization=args.quantization)
    switch = {}  # name -> what to do before that name's run
    if args.compare == "eager":
        engines = {"eager": LLM(model=args.model, **options),
                   "compiled": LLM(model=args.model, compile_decode=True, **options)}
    elif args.compare == "tile":
        llm = _warm(LLM(model=args.model, **options))
        layers = [m for m in _modules(llm) if getattr(m, "native_rows", 0)]
        if not layers:
            raise SystemExit("no layer runs the native tile kernel here (fp32 weights, native "
                             "kernels built, FOVEAL_LINEAR_LAYOUT=packed)")
        engines = {"oneDNN": llm, "tile": llm}
        switch = {"oneDNN": lambda: _set_native_rows(layers, 0),
                  "tile": lambda: _set_native_rows(layers, NATIVE_F32_ROWS)}
    else:
        compiled = args.compare == "native"
        engines = {name: _with_native(name == "native", lambda: _warm(LLM(
            model=args.model, compile_decode=compiled, **options))) for name in ("torch", "native")}
    base, new = engines
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (448, 448, 3), dtype=np.uint8))
    messages = [[{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                              {"type": "text", "text": f"Describe the picture {i}."}]}]
                for i in range(args.rows)]
    greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)  # noqa: E731
    tokens = {}
    for name, llm in engines.items():
        switch.get(name, lambda: None)()
        tokens[name] = [out.outputs[0].token_ids
                        for out in llm.chat(messages, greedy(args.tokens), use_tqdm=False)]
    same = len({tuple(map(tuple, t)) for t in tokens.values()}) == 1
    tpot: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        order = list(engines.items()) if round_ % 2 == 0 else list(engines.items())[::-1]
        for name, llm in order:
            switch.get(name, lambda: None)()
            outputs = llm.chat(messages, greedy(args.tokens), use_tqdm=False)
            first = max(out.metrics.first_token_time for out in outputs)
            last = max(out.metrics.last_token_time for out in outputs)
            tpot[name].append((last - first) * 1000 / (args.tokens - 1))
    label = args.dtype + (f" {args.quantization}" if args.quantization else "") + f", {args.rows} row(s)"
    for name, values in tpot.items():
        print(f"{label} {name}: TPOT median {statistics.median(values):.1f} ms "
              f"({', '.join(f'{v:.1f}' for v in values)})")
    ratio = statistics.median(tpot[new]) / statistics.median(tpot[base])
    print(f"{label} {new} / {base}: {ratio:.3f}; same greedy tokens: {same}")


def _set_native_rows(layers, rows: int) -> None:
    for layer in layers:
        layer.native_rows = rows


def _modules(llm: LLM):
    """The modules of an in-process (uniproc) engine's model."""
    worker = getattr(llm.llm_engine.executor, "driver_worker", None)
    if worker is None:
        raise SystemExit("--compare tile needs the in-process executor (one rank)")
    return worker.model.modules()


def _warm(llm: LLM) -> LLM:
    """One short request while the choice holds: attention layers pick their backend on
    their first forward (an eager engine runs none at start)."""
    llm.generate({"prompt_token_ids": list(range(100, 140))},
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return llm


def _with_native(enabled: bool, build):
    """An engine built and traced with the native decode kernels on or off."""
    previous = os.environ.get("FOVEAL_NATIVE_KERNELS")
    os.environ["FOVEAL_NATIVE_KERNELS"] = "1" if enabled else "0"
    native.native_kernels.cache_clear()
    try:
        return build()
    finally:
        os.environ.pop("FOVEAL_NATIVE_KERNELS") if previous is None else \
            os.environ.__setitem__("FOVEAL_NATIVE_KERNELS", previous)
        native.native_kernels.cache_clear()  # the native engine's ops call it at run time


if __name__ == "__main__":
    main()
