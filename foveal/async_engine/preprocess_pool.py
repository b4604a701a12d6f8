"""Prompt -> engine Request in a pool of worker processes.

Tokenizing, decoding images and patchifying them is CPU work that can take
hundreds of milliseconds per large image; done here, a burst of images stalls
neither the asyncio event loop nor the engine loop. Each worker builds its own
InputProcessor from the EngineConfig and pickles the finished request once, so
the API process forwards the pixel tensors to the core without touching them.
A prompt with videos takes two calls: `video_speech` (each video's audio
track, extracted here) and then `process` with the transcripts the API
process's speech-to-text stage made of them.
"""
from __future__ import annotations

import asyncio
import functools
import multiprocessing
import signal
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from foveal.async_engine.messages import AddRequest, encode
from foveal.config import EngineConfig
from foveal.errors import ConfigError, InvalidRequestError
from foveal.input_processor import InputProcessor, PromptType
from foveal.sampling_params import SamplingParams


@dataclass
class PreprocessedRequest:
    """What the API process needs of a processed request.

    add_request_frame: the encoded AddRequest message for the engine core.
    preprocess_time: wall seconds from submitting to the pool to the result.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # finalized: max_tokens and eos ids filled in
    add_request_frame: bytes
    preprocess_time: float = 0.0
    mm_plan: list = field(default_factory=list)
    mm_hashes: list[str] = field(default_factory=list)
    # media items by mm_hash -> visual tokens (what an encode worker exports)
    mm_rows: dict[str, int] = field(default_factory=dict)
    transfer_stats: Any = None  # foveal.disagg.exchange.TransferStats of its pulls


_worker_processor: InputProcessor | None = None


def _build_processor(config: EngineConfig) -> InputProcessor:
    from foveal.tokenizer import Tokenizer

    return InputProcessor(config, Tokenizer.from_pretrained(config.model.path))


def _init_worker(config: EngineConfig) -> None:
    import torch

    global _worker_processor
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process shuts the pool down
    torch.set_num_threads(1)  # the pool's parallelism is its number of processes
    _worker_processor = _build_processor(config)


def _preprocess(processor: InputProcessor, request_id: str, prompt: PromptType,
                params: SamplingParams, transcripts: Sequence[str | None] | None,
                transfer: Any = None) -> PreprocessedRequest:
    """transfer: a foveal.disagg.exchange.TransferRequest: what to pull from
    peers (embeddings, prompt KV) before the request goes to the core."""
    processed = processor.process(request_id, prompt, params, transcripts)
    request = processed.request
    stats = None
    if transfer:
        from foveal.disagg.exchange import pull_into

        stats = pull_into(request, transfer, processor.config)
    features = request.mm_features
    return PreprocessedRequest(request_id, processed.text, request.prompt_token_ids,
                               request.sampling_params, encode(AddRequest(request)),
                               mm_plan=processed.mm_plan,
                               mm_hashes=[f.mm_hash for f in features],
                               mm_rows={f.mm_hash: f.placeholder.length for f in features},
                               transfer_stats=stats)


def _video_speech(processor: InputProcessor, prompt: PromptType) -> list[bytes | None] | None:
    return processor.video_speech(prompt)


def _run_in_worker(function: Callable, *args: Any) -> Any:
    return function(_worker_processor, *args)


def _run_with(processor: InputProcessor, function: Callable, *args: Any) -> Any:
    return function(processor, *args)


def _warm_up() -> None:
    """Runs once per worker at start so the first requests do not pay the spawn."""


class PreprocessPool:
    """num_workers processes (spawned), or one in-process thread when 0."""

    def __init__(self, config: EngineConfig, num_workers: int) -> None:
        if num_workers < 0:
            raise ConfigError(f"preprocess_workers={num_workers}; use 0 (an in-process "
                              f"thread) or a positive number of worker processes")
        self.config = config
        self.num_workers = num_workers
        self._lock = threading.Lock()
        if num_workers == 0:
            self._executor: Executor = ThreadPoolExecutor(1, "foveal-preprocess")
            self._runner: Callable = functools.partial(_run_with, _build_processor(config))
        else:
            self._executor = self._start_processes()
            self._runner = _run_in_worker

    def _start_processes(self) -> ProcessPoolExecutor:
        executor = ProcessPoolExecutor(
            self.num_workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(self.config,))
        for _ in range(self.num_workers):
            executor.submit(_warm_up)
        return executor

    async def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                      transcripts: Sequence[str | None] | None = None,
                      transfer: Any = None) -> PreprocessedRequest:
        """Raises the InvalidRequestError the InputProcessor raised. transcripts:
        one per video, made from `video_speech` (InputProcessor.process).
        transfer: what to pull from disaggregated peers (exchange.TransferRequest)."""
        start = time.perf_counter()
        result = await self._call(request_id, _preprocess, request_id, prompt, params,
                                  transcripts, transfer)
        result.preprocess_time = time.perf_counter() - start
        return result

    async def video_speech(self, request_id: str, prompt: PromptType) -> list[bytes | None] | None:
        """Each video's audio track for the speech-to-text stage (InputProcessor.video_speech)."""
        return await self._call(request_id, _video_speech, prompt)

    async def _call(self, request_id: str, function: Callable, *args: Any) -> Any:
        """function(the worker's InputProcessor, *args), run in the pool. A caller
        cancelled (its client gone) cancels the job unless the executor has handed it
        to the workers already (at most one per worker, plus one)."""
        loop = asyncio.get_running_loop()
        executor = self._executor
        try:
            return await loop.run_in_executor(executor, self._runner, function, *args)
        except BrokenProcessPool:
            self._replace_broken(executor)
            raise InvalidRequestError(
                f"request {request_id!r}: a preprocessing worker process died while "
                f"preparing it (malformed media or out of memory); check its inputs") from None

    def _replace_broken(self, broken: Executor) -> None:
        with self._lock:
            if self._executor is broken:
                self._executor = self._start_processes()
        broken.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        """Idempotent; waits for the worker processes to exit."""
        self._executor.shutdown(wait=True, cancel_futures=True)
