"""`foveal bench peer`: llama.cpp (llama-cpp-python with mtmd) next to Foveal and
transformers, on GGUF files written from the same checkpoint, the same prompts and the
same images, one request at a time.

Each llama.cpp request runs its prompt's own token ids; only the image goes through
mtmd (its vision encoder and its M-RoPE positions), so every system sees the same tokens.
Greedy decoding, EOS ignored; TTFT counts from the request's start (raw RGB pixels in
hand, as Foveal gets a decoded image) to the first sampled token.

On CPUs with AMX, llama.cpp loads its weights without its extra buffer types (the AMX
and repacked layouts, `--no-repack` in its own CLI): its AMX matmul kernels fault on
these machines (SIGILL at the first tile instruction on worker threads, or a segfault;
llama.cpp pull request 26954), so q8_0 runs through its AVX-512 VNNI dot products there.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from foveal.bench.gguf_export import WEIGHT_TYPES, GGUFFiles, export_gguf
from foveal.bench.report import RequestRecord, ThroughputResult
from foveal.bench.workload import BenchRequest, PromptVocab, WorkloadSpec
from foveal.cpu_features import cpu_features
from foveal.errors import ConfigError, FovealError

# The Foveal engine that matches each GGUF weight type: the same weight precision.
FOVEAL_MATCH = {"f32": {"dtype": "float32"}, "f16": {"dtype": "float32"},
                "q8_0": {"dtype": "float32", "quantization": "int8", "quantize_lm_head": True}}


class LlamaCpp:
    """One llama.cpp model + mtmd context, running one request at a time."""

    def __init__(self, files: GGUFFiles, vocab: PromptVocab, n_ctx: int, threads: int,
                 kv_f32: bool = False) -> None:
        try:
            from llama_cpp import Llama, mtmd_cpp
        except ImportError as exc:
            raise ConfigError("the llama.cpp peer needs llama-cpp-python (pip install "
                              "llama-cpp-python; it builds from source in ~7 minutes)") from exc
        from llama_cpp._logger import llama_log_callback

        self._mtmd_cpp = mtmd_cpp
        self.vocab = vocab
        # mtmd logs through llama-cpp-python's logger too (errors only when not verbose)
        mtmd_cpp.mtmd_log_set(llama_log_callback, ctypes.c_void_p(0))
        mtmd_cpp.mtmd_helper_log_set(llama_log_callback, ctypes.c_void_p(0))
        with _extra_buffer_types(not cpu_features().amx):
            self.llama = Llama(model_path=str(files.model), n_ctx=n_ctx, n_batch=n_ctx,
                               n_ubatch=min(n_ctx, 512), n_threads=threads,
                               n_threads_batch=threads, logits_all=False, verbose=False,
                               **({"type_k": 0, "type_v": 0} if kv_f32 else {}))  # GGML_TYPE_F32
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = threads
        params.warmup = False
        self.mtmd = mtmd_cpp.mtmd_init_from_file(str(files.mmproj).encode(), self.llama.model,
                                                 params)
        if not self.mtmd:
            raise FovealError(f"llama.cpp could not load {files.mmproj}")
        self.marker = mtmd_cpp.mtmd_default_marker()
        self.before, self.after = self._image_wrapping()

    def close(self) -> None:
        if self.mtmd:
            self._mtmd_cpp.mtmd_free(self.mtmd)
            self.mtmd = None
        self.llama.close()

    def generate(self, request: BenchRequest) -> tuple[list[int], RequestRecord]:
        """Greedy tokens for one request, and its timing."""
        self.llama.reset()
        self.llama._ctx.kv_cache_clear()
        start = time.perf_counter()
        prompt_len = self._prefill(request)
        tokens, stamps = [], []
        while True:
            token = int(np.argmax(self._last_logits()))
            tokens.append(token)
            stamps.append(time.perf_counter() - start)
            if len(tokens) == request.output_len:
                break
            self.llama.eval([token])
        return tokens, RequestRecord(prompt_len, len(tokens), stamps[0], stamps[-1])

    def _last_logits(self) -> np.ndarray:
        from llama_cpp import llama_cpp

        pointer = llama_cpp.llama_get_logits_ith(self.llama._ctx.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.llama.n_vocab(),))

    def _prefill(self, request: BenchRequest) -> int:
        """Evaluates the prompt (text as token ids, each image through mtmd); returns its
        length in tokens."""
        ids = list(request.prompt_token_ids)
        images = list(request.images)
        if ids.count(self.vocab.image_token_id) != len(images):
            raise ConfigError("the llama.cpp peer needs one image placeholder per image")
        evaluated, text = 0, []
        position = 0
        while position < len(ids):
            if ids[position] != self.vocab.image_token_id:
                text.append(ids[position])
                position += 1
                continue
            if text[len(text) - len(self.before):] != self.before or \
                    ids[position + 1:position + 1 + len(self.after)] != self.after:
                raise ConfigError("an image placeholder is not wrapped the way llama.cpp "
                                  f"wraps images ({self.before} ... {self.after})")
            self.llama.eval(text)
            evaluated += len(text)
            evaluated += self._eval_image(images.pop(0))
            text = []
            position += 1
        self.llama.eval(text)  # never empty: the wrapping's end token at least
        return evaluated + len(text)

    def _eval_image(self, image) -> int:
        """Encodes one image and decodes its embeddings at the next positions; returns
        its token count."""
        mtmd = self._mtmd_cpp
        bitmap = self._bitmap(np.array(image.convert("RGB"), dtype=np.uint8))
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            chunk = self._image_chunk(chunks, bitmap)
            n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            new_n_past = ctypes.c_int32(0)
            status = mtmd.mtmd_helper_eval_chunk_single(
                self.mtmd, self.llama._ctx.ctx, chunk, self.llama.n_tokens, 0,
                self.llama.n_batch, False, ctypes.byref(new_n_past))
            if status != 0:
                raise FovealError(f"llama.cpp failed to evaluate an image (status {status})")
            self.llama.n_tokens = new_n_past.value
            return n_tokens
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def _bitmap(self, pixels: np.ndarray):
        """An mtmd bitmap of (H, W, 3) uint8 pixels (mtmd copies them)."""
        height, width = pixels.shape[:2]
        buffer = (ctypes.c_ubyte * pixels.size).from_buffer(pixels)  # needs a writable array
        return self._mtmd_cpp.mtmd_bitmap_init(width, height, buffer)

    def _tokenize_marker(self, chunks, bitmaps: list) -> list:
        mtmd = self._mtmd_cpp
        text = mtmd.mtmd_input_text()
        text.text = self.marker
        text.text_len = len(self.marker)
        text.add_special = False
        text.parse_special = True
        array = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        status = mtmd.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(text), array, len(bitmaps))
        if status != 0:
            raise FovealError(f"llama.cpp could not tokenize an image prompt (status {status})")
        return [mtmd.mtmd_input_chunks_get(chunks, i)
                for i in range(mtmd.mtmd_input_chunks_size(chunks))]

    def _image_chunk(self, chunks, bitmap):
        for chunk in self._tokenize_marker(chunks, [bitmap]):
            if self._mtmd_cpp.mtmd_input_chunk_get_type(chunk) == \
                    self._mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                return chunk
        raise FovealError("llama.cpp produced no image chunk")

    def _image_wrapping(self) -> tuple[list[int], list[int]]:
        """The text tokens mtmd puts before and after an image (for Qwen2-VL its
        vision start and end tokens), read from the prompt of one 28x28 black image."""
        mtmd = self._mtmd_cpp
        bitmap = self._bitmap(np.zeros((28, 28, 3), dtype=np.uint8))
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            parts, seen_image = ([], []), False
            for chunk in self._tokenize_marker(chunks, [bitmap]):
                if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    seen_image = True
                    continue
                count = ctypes.c_size_t()
                pointer = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                parts[seen_image].extend(int(pointer[i]) for i in range(count.value))
            return parts
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)


@contextlib.contextmanager
def _extra_buffer_types(enabled: bool) -> Iterator[None]:
    """Models loaded inside use llama.cpp's extra weight buffer types (AMX, repacked
    layouts) or not: llama-cpp-python's `Llama` takes no such option, so its default
    model parameters are wrapped while it loads."""
    from llama_cpp import llama_cpp

    default = llama_cpp.llama_model_default_params

    def params():
        out = default()
        out.use_extra_bufts = enabled
        return out

    llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_model_default_params = default


def run_llama_cpp(files: GGUFFiles, weights: str, requests: Sequence[BenchRequest],
                  warmup: BenchRequest, vocab: PromptVocab, n_ctx: int,
                  threads: int) -> ThroughputResult:
    # f32 weights run with an f32 KV cache (Foveal's fp32 engine keeps fp32 KV); the
    # other types with llama.cpp's default f16 cache.
    runner = LlamaCpp(files, vocab, n_ctx, threads, kv_f32=weights == "f32")
    try:
        runner.generate(warmup)
        start = time.perf_counter()
        outputs = [runner.generate(request) for request in requests]
        wall = time.perf_counter() - start
    finally:
        runner.close()
    return ThroughputResult(f"llama.cpp {weights}", wall, [record for _, record in outputs],
                            token_ids=[tokens for tokens, _ in outputs])


@dataclass(frozen=True)
class PeerPlan:
    """What `foveal bench peer` runs."""

    model_dir: Path
    workload: WorkloadSpec
    gguf_dir: Path
    weights: tuple[str, ...] = ("f32", "q8_0")
    threads: int = 2
    hf: bool = True
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def run_peer(plan: PeerPlan) -> dict:
    """Per weight type: the GGUF export, llama.cpp, and Foveal at the same weight precision;
    then transformers in fp32. Every system runs the same requests one at a time."""
    from foveal.bench.throughput import _release_memory, run_foveal
    from foveal.bench.workload import build_workload, warmup_request

    for weights in plan.weights:
        if weights not in WEIGHT_TYPES:
            raise ConfigError(f"--weights: {weights!r} is not one of {', '.join(WEIGHT_TYPES)}")
    vocab = PromptVocab.from_model_dir(plan.model_dir)
    requests = build_workload(plan.workload, vocab)
    warmup = warmup_request(vocab)
    n_ctx = int(plan.engine_kwargs.get("max_model_len") or 4096)
    results, comparisons = [], []
    foveal_by_engine: dict[str, ThroughputResult] = {}
    for weights in plan.weights:
        files = export_gguf(plan.model_dir, plan.gguf_dir, weights)
        peer = run_llama_cpp(files, weights, requests, warmup, vocab, n_ctx, plan.threads)
        _release_memory()
        engine = {**plan.engine_kwargs, **FOVEAL_MATCH[weights], "max_num_seqs": 1}
        key = json.dumps(FOVEAL_MATCH[weights], sort_keys=True)
        if key not in foveal_by_engine:
            label = "foveal int8" if "quantization" in FOVEAL_MATCH[weights] else "foveal fp32"
            foveal_by_engine[key] = run_foveal(plan.model_dir, requests, warmup, engine,
                                               one_at_a_time=True, system=label)
            results.append(foveal_by_engine[key])
        results.append(peer)
        comparisons.append(_compare(foveal_by_engine[key], peer))
    if plan.hf:
        results.append(_run_hf_one_at_a_time(plan, requests, warmup))
    return {"results": [result.summary() for result in results], "comparisons": comparisons}


def _compare(foveal: ThroughputResult, peer: ThroughputResult) -> dict:
    """Foveal over the peer (below 1: Foveal is faster), and how often they agree."""
    mine, theirs = foveal.summary(), peer.summary()
    same = sum(a == b for a, b in zip(foveal.token_ids, peer.token_ids))
    return {"foveal": foveal.system, "peer": peer.system,
            "ttft_ratio": mine["ttft_median_s"] / theirs["ttft_median_s"],
            "tpot_ratio": mine["tpot_median_s"] / theirs["tpot_median_s"],
            "same_greedy_tokens": f"{same}/{len(peer.token_ids)}"}


def _run_hf_one_at_a_time(plan: PeerPlan, requests: Sequence[BenchRequest],
                          warmup: BenchRequest) -> ThroughputResult:
    import torch

    from foveal.bench.hf_baseline import HFBaseline
    from foveal.bench.throughput import _release_memory

    baseline = HFBaseline(plan.model_dir, "cpu", torch.float32,
                          plan.engine_kwargs.get("mm_processor_kwargs"),
                          plan.engine_kwargs.get("max_model_len"))
    try:
        baseline.warmup(warmup)
        start = time.perf_counter()
        records = [record for request in requests
                   for record in baseline.run([request], 1).records]
        wall = time.perf_counter() - start
    finally:
        del baseline
        _release_memory()
    return ThroughputResult("hf", wall, records, batch_size=1)


def format_comparisons(comparisons: Sequence[dict]) -> str:
    return "\n".join(f"{c['foveal']} / {c['peer']}: TTFT {c['ttft_ratio']:.2f}x, "
                     f"TPOT {c['tpot_ratio']:.2f}x, same greedy tokens {c['same_greedy_tokens']}"
                     for c in comparisons)


def run_bench_peer(args: argparse.Namespace) -> int:
    from foveal.bench.cli import _engine_kwargs, _finite
    from foveal.bench.model_source import model_dir_from_args
    from foveal.bench.report import format_table, write_json_report
    from foveal.bench.workload import workload_spec_from_args, workload_summary

    model_dir = model_dir_from_args(args)
    spec = workload_spec_from_args(args)
    plan = PeerPlan(model_dir=model_dir, workload=spec,
                    gguf_dir=Path(args.gguf_dir) if args.gguf_dir else model_dir / "gguf",
                    weights=tuple(w.strip() for w in args.weights.split(",") if w.strip()),
                    threads=args.threads, hf=not args.no_hf,
                    engine_kwargs=_engine_kwargs(args))
    print(f"model: {model_dir}")
    print(f"workload: {json.dumps(workload_summary(spec))}", flush=True)
    report = run_peer(plan)
    print(format_table(report["results"]))
    print(format_comparisons(report["comparisons"]))
    if args.json:
        write_json_report(Path(args.json), _finite({
            "model_dir": str(model_dir), "workload": workload_summary(spec),
            "threads": plan.threads, **report}))
    return 0


def register_peer(subparsers) -> None:
    from foveal.bench.model_source import add_model_source_args
    from foveal.bench.workload import add_workload_args
    from foveal.entrypoints.cli_args import add_engine_args

    peer = subparsers.add_parser(
        "peer", help="llama.cpp vs Foveal vs transformers, one request at a time",
        description="Write GGUF files (language model at each --weights type, vision as "
                    "mmproj) from the checkpoint with `gguf`, run them with llama-cpp-python "
                    "(mtmd), and run Foveal at the same weight precision (f32/f16: fp32; "
                    "q8_0: int8 weights and LM head) and transformers (fp32) on the same "
                    "requests, one at a time, greedy, EOS ignored. Qwen2-VL / Qwen2.5-VL.")
    add_model_source_args(peer)
    add_workload_args(peer)
    peer.add_argument("--weights", default="f32,q8_0",
                      help=f"GGUF weight types, comma-separated ({', '.join(WEIGHT_TYPES)}; "
                           "default f32,q8_0)")
    peer.add_argument("--gguf-dir", help="where the GGUF files go (default MODEL/gguf)")
    peer.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    peer.add_argument("--no-hf", action="store_true", help="skip transformers")
    peer.add_argument("--json", metavar="OUT", help="write every number here")
    add_engine_args(peer)
    peer.set_defaults(func=run_bench_peer)
