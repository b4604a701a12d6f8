"""GPU benchmark: decode against the HBM roofline, prefill against the bf16 GEMM
peak, decode steps from CUDA graphs against eager ones, all in one process.

    python scripts/bench_gpu.py --presets small,qwen2.5-vl-7b --json gpu.json

Ceilings are measured first on this GPU: copy bandwidth (a 4 GiB device-to-
device copy, bytes read + written) and bf16 GEMM rate (8192^3). Per preset
(random bf16 weights drawn on the GPU, no checkpoint file):
  decode    batch 1 and 32: ms per output token with CUDA graphs and eagerly
            (the same engine, its graphs switched off), median of --repeats;
            batch 1 split into the graph's GPU time (replayed alone), the LM
            head's, and the rest (host: scheduling, batch arrays, sampling);
            batch 1 against the roofline: the bytes one step reads (decoder
            weights, the LM head, the KV context) / measured bandwidth
  prefill   one text prompt of --prefill-len tokens, one step: model FLOPs
            (2 x decoder weights x tokens + causal attention) / time, against
            the GEMM rate
  image     time to first token of one request with one image (vision tower +
            prefill), and 32 such requests' output tokens/s with graphs
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from foveal import LLM, SamplingParams


def _cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() over repeats, CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings() -> dict:
    size = 4 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _cuda_time(lambda: dst.copy_(src), 10)
    src = dst = None  # free the 8 GiB before the GEMM
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_s = _cuda_time(lambda: a @ b, 10)
    a = b = None
    torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "copy_GBps": 2 * size / copy_s / 1e9,
            "bf16_gemm_TFLOPs": 2 * 8192 ** 3 / gemm_s / 1e12}


def _checkpoint(preset: str, root: Path) -> Path:
    from foveal.loader.tiny_model import build_checkpoint

    return build_checkpoint(root / preset, preset, weights=False)


def _model_bytes(model: torch.nn.Module) -> dict:
    """Bytes a decode step reads from the weights, and the prefill FLOP count per token."""
    params = dict(model.named_parameters())
    visual = lambda name: "visual" in name or "vision" in name or "multi_modal" in name  # noqa: E731
    tied = not any("lm_head" in name for name in params)
    text = {n: p for n, p in params.items() if not visual(n)}
    step = sum(p.numel() * p.element_size() for n, p in text.items()
               if "embed_tokens" not in n or tied)
    layer_params = sum(p.numel() for n, p in text.items() if ".layers." in n)
    return {"step_weight_bytes": step, "decoder_layer_params": layer_params}


_WORDS = ("red blue green circle square triangle left right above below count three seven "
          "reads the word card image frame moves towards small large shape colour").split()


def _prompts(tokenizer, length: int, count: int, seed: int) -> list[dict]:
    """count prompts of exactly `length` token ids of plain words (no special ids)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(" ".join(rng.choice(_WORDS, 64)))
        prompts.append({"prompt_token_ids": ids[:length]})
    return prompts


def _decode_ms(llm: LLM, batch: int, prompt_len: int, out_len: int,
               repeats: int) -> float:
    """Median ms per output token of each request (first token excluded)."""
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    runs = []
    for r in range(repeats):
        outputs = llm.generate(_prompts(llm.get_tokenizer(), prompt_len, batch, r), params, use_tqdm=False)
        runs.append(statistics.median(
            (o.metrics.finished_time - o.metrics.first_token_time) / (out_len - 1) * 1e3
            for o in outputs))
    return statistics.median(runs)


def _prefill_s(llm: LLM, length: int, repeats: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(repeats + 1):
        output = llm.generate(_prompts(llm.get_tokenizer(), length, 1, 100 + r), params, use_tqdm=False)[0]
        times.append(output.metrics.first_token_time - output.metrics.arrival_time)
    return statistics.median(times[1:])  # the first compiles and warms


def _image_chats(count: int, size: int) -> list[list[dict]]:
    from PIL import Image

    rng = np.random.default_rng(0)
    return [[{"role": "user", "content": [
        {"type": "image_pil", "image_pil": Image.fromarray(
            rng.integers(0, 255, (size, size, 3), dtype=np.uint8))},
        {"type": "text", "text": f"Describe image {i} in detail."}]}] for i in range(count)]


def bench_preset(preset: str, root: Path, ceiling: dict, args) -> dict:
    folder = _checkpoint(preset, root)
    started = time.perf_counter()
    llm = LLM(model=str(folder), load_format="dummy", device=args.device, dtype="bfloat16",
              max_model_len=args.prefill_len + 64, max_num_seqs=32,
              max_num_batched_tokens=args.prefill_len + 64,
              kv_cache_memory_bytes=args.kv_gib << 30)
    load_s = time.perf_counter() - started
    runner = llm.llm_engine.core.executor.model_runner
    graphs = runner.decode_graphs
    text = runner.config.model.text
    sizes = _model_bytes(runner.model)
    row = {"preset": preset, "engine_start_s": round(load_s, 1),
           "graphs": graphs.sizes if graphs is not None else None, **sizes}
    prompt_len, out_len = 128, args.output_len
    for mode in ("graphs", "eager"):
        runner.decode_graphs = graphs if mode == "graphs" else None
        for batch in (1, 32):
            row[f"decode_ms_b{batch}_{mode}"] = _decode_ms(llm, batch, prompt_len, out_len,
                                                           args.repeats)
    runner.decode_graphs = graphs
    if graphs is not None:  # where a batch-1 step's time goes: the graph, the head, the host
        with torch.inference_mode():
            row["b1_graph_replay_ms"] = _cuda_time(graphs.graphs[1].replay, 50) * 1e3
            hidden = graphs.outputs[1]
            row["b1_lm_head_ms"] = _cuda_time(lambda: runner.model.compute_logits(hidden),
                                              50) * 1e3
        row["b1_host_and_sampling_ms"] = (row["decode_ms_b1_graphs"] - row["b1_graph_replay_ms"]
                                          - row["b1_lm_head_ms"])
    # KV bytes the batch-1 step reads, at the mean context of the run
    kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 2
    step_bytes = sizes["step_weight_bytes"] + kv_per_token * (prompt_len + out_len // 2)
    roofline_ms = step_bytes / (ceiling["copy_GBps"] * 1e9) * 1e3
    row.update(step_bytes=step_bytes, roofline_ms=roofline_ms,
               roofline_fraction=roofline_ms / row["decode_ms_b1_graphs"])
    length = args.prefill_len
    prefill_s = _prefill_s(llm, length, args.repeats)
    attention = (2 * 2 * text.num_hidden_layers * text.num_attention_heads * text.head_dim
                 * length * length / 2)
    flops = 2 * sizes["decoder_layer_params"] * length + attention
    row.update(prefill_len=length, prefill_s=prefill_s, prefill_TFLOPs=flops / prefill_s / 1e12,
               prefill_gemm_fraction=flops / prefill_s / 1e12 / ceiling["bf16_gemm_TFLOPs"])
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    chats = _image_chats(33, args.image_size)
    llm.chat(chats[:1], one, use_tqdm=False)  # warm the vision path
    output = llm.chat(chats[1:2], one, use_tqdm=False)[0]
    row.update(image_size=args.image_size, image_prompt_tokens=len(output.prompt_token_ids),
               image_ttft_s=output.metrics.first_token_time - output.metrics.arrival_time)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.chat(chats[1:], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    row["image_32_output_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
    llm.shutdown()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,qwen2.5-vl-7b")
    parser.add_argument("--output-len", type=int, default=129)
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--image-size", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-gib", type=int, default=16)
    parser.add_argument("--json", help="write the report here too")
    parser.add_argument("--device", default="cuda",
                        help="cpu: a dry run of the script with tiny presets (no ceilings)")
    args = parser.parse_args()
    measured = ceilings() if args.device == "cuda" else {"copy_GBps": 1.0, "bf16_gemm_TFLOPs": 1.0}
    report = {"ceilings": measured, "rows": []}
    print(json.dumps(report["ceilings"]), flush=True)
    with tempfile.TemporaryDirectory() as root:
        for preset in args.presets.split(","):
            row = bench_preset(preset, Path(root), report["ceilings"], args)
            gc.collect()  # the preset's engine, before the next one takes the GPU
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
