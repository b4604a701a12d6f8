"""AsyncLLM: the asyncio front of the engine, with the engine core in its own process.

API process:  generate() -> PreprocessPool (worker processes) -> core socket
              (a prompt's videos: their audio tracks, extracted in the pool, go
              to the "asr" stage of `stage_pools`; the transcripts go back to
              the pool with the prompt)
              output thread: core socket -> OutputProcessor (detokenize, stop
              strings) -> one asyncio queue per request
Core process: EngineCore loop (foveal/async_engine/core_process.py)

The output thread owns the reading side of the core's socket, so outputs flow
whatever event loop (or loops) the callers run on; a lock guards the
OutputProcessor and the request table it shares with the callers.

A core that dies or hangs (core_process.py) fails every request in flight with
EngineDeadError; then the output thread starts a new core (restart_failed_core)
or the engine stays dead and says so (`when_failed`: a server exits).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from foveal.async_engine.core_process import DEFAULT_HANG_TIMEOUT_S, EngineCoreProcess
from foveal.async_engine.messages import (AbortRequests, CoreFailed, CoreOutputs, MetricsQuery,
                                          MetricsReply, RequestRejected, decode, encode)
from foveal.async_engine.preprocess_pool import PreprocessedRequest, PreprocessPool
from foveal.engine.output import CompletionOutput, OutputProcessor, RequestOutput
from foveal.engine.request import EngineCoreOutput, RequestStatus
from foveal.engine_args import EngineArgs
from foveal.disagg.exchange import (Exports, TransferRequest, parse_transfer_params,
                                    prompt_digest)
from foveal.errors import (ConfigError, EngineDeadError, EngineOverloadedError, FovealError,
                           InvalidRequestError)
from foveal.input_processor import PromptType
from foveal.input_processor.prompt import has_video
from foveal.logger import init_logger
from foveal.sampling_params import SamplingParams
from foveal.stages.assembly import video_transcripts
from foveal.stages.service import stage_pools_for
from foveal.tokenizer import Tokenizer

logger = init_logger(__name__)


@dataclass
class _RequestStream:
    """One generate() call in flight. Items are RequestOutputs or an exception."""

    loop: asyncio.AbstractEventLoop
    stream: bool
    arrival_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    preprocess_time: float | None = None
    mm_plan: list | None = None
    mm_hashes: list[str] = field(default_factory=list)
    mm_rows: dict[str, int] = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # set when its prompt KV is exported
    ec_transfer_params: dict | None = None  # set when its embeddings are exported
    in_core: bool = False
    finished: bool = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe hand-off to the caller's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is closed: nobody is waiting


class AsyncLLM:
    """Concurrent streaming generation for a server.

    >>> async with AsyncLLM(EngineArgs(model=path)) as llm:
    ...     async for delta in llm.generate("Hi", SamplingParams(), "req-1"):
    ...         print(delta.outputs[0].text, end="")
    """

    def __init__(self, engine_args: EngineArgs, *, preprocess_workers: int = 2,
                 max_pending_requests: int = 256, stages: Any = None,
                 restart_failed_core: bool = False,
                 core_hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        """stages: the StagePools whose "asr" stage transcribes videos' audio tracks
        (its creator closes it; a server passes the pools its input_audio parts
        use), or their config (StagesConfig, "asr=2", None) for pools this engine
        owns. Stage workers start on first use. restart_failed_core: start a new
        core process when the core dies or hangs (its requests fail either way);
        otherwise the engine stays dead. core_hang_timeout_s: how long the core
        may answer nothing (one step's limit) before it counts as hung."""
        if max_pending_requests < 1:
            raise ConfigError(f"max_pending_requests={max_pending_requests}; it must be >= 1")
        self.engine_config = engine_args.create_engine_config()
        self.tokenizer = Tokenizer.from_pretrained(self.engine_config.model.path)
        self.max_pending_requests = max_pending_requests
        self._output_processor = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestStream] = {}
        self._metrics_queries: dict[int, concurrent.futures.Future] = {}
        self._query_ids = itertools.count()
        self._dead_error: EngineDeadError | None = None
        self._shut_down = False
        self._restart_failed_core = restart_failed_core
        self._failure_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._final_error: EngineDeadError | None = None  # dead for good, not restarted
        self.num_core_restarts = 0
        self.stage_pools, self._owns_stage_pools = stage_pools_for(stages)
        self.role = self.engine_config.transfer.role
        self._exports = Exports(self.engine_config)  # served to disaggregated peers
        self._transfer_counts = dict.fromkeys(("pulls", "bytes", "seconds", "failures"), 0)
        # The pool first: its workers spawn while the core loads the model.
        self._pool = PreprocessPool(self.engine_config, preprocess_workers)
        try:
            self._core = EngineCoreProcess(self.engine_config, core_hang_timeout_s)
        except BaseException:
            self._pool.shutdown()
            raise
        self._output_thread = threading.Thread(target=self._run_output_loop,
                                               name="foveal-output", daemon=True)
        self._output_thread.start()

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None,
                       request_id: str, *, stream: bool = True,
                       kv_transfer_params: dict | None = None,
                       ec_transfer_params: dict | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield deltas (stream=True) or one final cumulative output (stream=False).

        Invalid requests raise their InvalidRequestError before anything is
        yielded. Stopping early (aclose, cancellation) aborts the request.
        kv_transfer_params / ec_transfer_params: disaggregated serving
        (foveal/disagg/exchange.py); the final output carries what this
        engine exported for the next worker.
        """
        transfer = parse_transfer_params(kv_transfer_params, ec_transfer_params)
        params = self._transfer_sampling_params(sampling_params or SamplingParams(), transfer)
        record = self._register(request_id, stream)
        try:
            processed = await self._preprocess(request_id, prompt, params, transfer)
            self._count_transfers(processed.transfer_stats)
            if self.role == "encode":
                self._submit_encode(request_id, record, processed)
            else:
                self._submit(request_id, record, processed)
            while True:
                item = await record.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._release(request_id, record)

    def _transfer_sampling_params(self, params: SamplingParams,
                                  transfer: TransferRequest) -> SamplingParams:
        if transfer and self.engine_config.parallel.tensor_parallel_size > 1:
            raise InvalidRequestError("moving a prompt's KV between engines needs "
                                      "tensor_parallel_size=1 on both")
        if self.role == "encode" and (transfer.export_kv or transfer.kv_source):
            raise InvalidRequestError("an encode worker holds no KV: send kv_transfer_params "
                                      "to prefill and decode workers")
        if not transfer.export_kv:
            return params
        if params.n != 1:
            raise InvalidRequestError("a prefill for a decode worker needs n=1")
        # The prefill ends at its first token; the decode worker samples its own.
        return dataclasses.replace(params, max_tokens=1, min_tokens=0)

    def _count_transfers(self, stats) -> None:
        if stats is None:
            return
        with self._lock:
            counts = self._transfer_counts
            counts["pulls"] += stats.num_pulls
            counts["bytes"] += stats.num_bytes
            counts["seconds"] += stats.seconds
            counts["failures"] += len(stats.failures)

    def _submit_encode(self, request_id: str, record: _RequestStream,
                       processed: PreprocessedRequest) -> None:
        """An encode worker's request: only the items its export store lacks
        go to the core; with none missing the answer is immediate."""
        record.mm_rows = processed.mm_rows
        held = self._exports.held_embeddings(processed.mm_hashes)
        if len(held) == len(set(processed.mm_hashes)):
            with self._lock:
                if record.finished:
                    return
                record.finished = True
                completion = CompletionOutput(0, "", [], None, None, finish_reason="stop")
                record.put(RequestOutput(request_id, processed.prompt, processed.prompt_token_ids,
                                         [completion], finished=True,
                                         ec_transfer_params=self._exports.embedding_params(
                                             processed.mm_rows)))
            return
        if held:
            message = decode(processed.add_request_frame)
            message.request.mm_features = [f for f in message.request.mm_features
                                           if f.mm_hash not in held]
            processed.add_request_frame = encode(message)
        self._submit(request_id, record, processed)

    async def _preprocess(self, request_id: str, prompt: PromptType,
                          params: SamplingParams, transfer: TransferRequest | None = None
                          ) -> PreprocessedRequest:
        """The pool's request; a prompt with videos first has their speech transcribed."""
        start = time.perf_counter()
        transcripts = None
        if has_video(prompt):
            speech = await self._pool.video_speech(request_id, prompt)
            if speech and any(speech):
                transcripts = await video_transcripts(self.stage_pools, speech)
        processed = await self._pool.process(request_id, prompt, params, transcripts,
                                             transfer or None)
        processed.preprocess_time = time.perf_counter() - start
        return processed

    def _register(self, request_id: str, stream: bool) -> _RequestStream:
        with self._lock:
            self._raise_if_dead()
            if request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in flight; "
                                          f"send a unique request id")
            if len(self._requests) >= self.max_pending_requests:
                raise EngineOverloadedError(
                    f"{len(self._requests)} requests are in flight, the limit "
                    f"(max_pending_requests) is {self.max_pending_requests}; retry later "
                    f"or raise the limit")
            record = _RequestStream(asyncio.get_running_loop(), stream, time.time())
            self._requests[request_id] = record
            return record

    def _submit(self, request_id: str, record: _RequestStream,
                processed: PreprocessedRequest) -> None:
        with self._lock:
            if record.finished:
                return  # aborted while it was preprocessed; its final output is queued
            self._raise_if_dead()
            record.prompt, record.prompt_token_ids = processed.prompt, processed.prompt_token_ids
            record.preprocess_time = processed.preprocess_time
            record.mm_plan = processed.mm_plan
            record.mm_hashes = processed.mm_hashes
            record.mm_rows = processed.mm_rows
            self._output_processor.add_request(
                request_id, processed.prompt, processed.prompt_token_ids,
                processed.sampling_params, record.arrival_time, stream_delta=record.stream)
            try:
                self._core.send(processed.add_request_frame)
            except EngineDeadError:
                self._output_processor.abort_requests([request_id])
                raise
            record.in_core = True

    def _release(self, request_id: str, record: _RequestStream) -> None:
        """Forget the request; abort it in the core if it is still running there."""
        with self._lock:
            if self._requests.get(request_id) is record:
                del self._requests[request_id]
            if record.in_core and not record.finished:
                record.finished = True
                self._abort_in_core([request_id], RequestStatus.FINISHED_ABORTED)

    def _abort_in_core(self, request_ids: list[str], status: RequestStatus) -> None:
        """Caller holds the lock. The engine frees the requests' KV blocks and encoder refs."""
        self._output_processor.abort_requests(request_ids)
        try:
            self._core.send(AbortRequests(request_ids, status))
        except EngineDeadError:
            pass  # nothing left to free

    async def abort(self, request_id: str) -> None:
        """Stop a request; its generate() yields a final output with finish_reason "abort"."""
        with self._lock:
            record = self._requests.get(request_id)
            if record is None or record.finished:
                return
            record.finished = True
            if record.in_core:
                self._abort_in_core([request_id], RequestStatus.FINISHED_ABORTED)
            completion = CompletionOutput(0, "", [], None, None, finish_reason="abort")
            record.put(RequestOutput(request_id, record.prompt, record.prompt_token_ids,
                                     [completion], finished=True))

    def transfer_metrics(self) -> dict[str, float]:
        """Disaggregation: pulls from peers (bytes, seconds, refused) and exports served."""
        with self._lock:
            counts = dict(self._transfer_counts)
        metrics = {f"foveal:transfer_{name}_total": value for name, value in counts.items()}
        for name, value in self._exports.stats().items():
            metrics[f"foveal:transfer_export_{name}"] = value
        return metrics

    async def get_metrics(self) -> dict[str, float]:
        """The core's counters and gauges (names as LLM.get_metrics()), transfers, and
        the requests this process tracks (0 for both once the server is idle)."""
        with self._lock:
            tracked = {"foveal:api_requests_in_flight": len(self._requests),
                       "foveal:detokenizer_requests":
                           self._output_processor.num_unfinished_requests()}
        return {**await self._core_metrics(), **self.transfer_metrics(), **tracked}

    async def _core_metrics(self) -> dict[str, float]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_dead()
            query_id = next(self._query_ids)
            self._metrics_queries[query_id] = future
            try:
                self._core.send(MetricsQuery(query_id))
            except EngineDeadError:
                del self._metrics_queries[query_id]
                raise
        return await asyncio.wrap_future(future)

    async def check_health(self) -> bool:
        return self._dead_error is None and not self._shut_down and self._core.alive

    @property
    def core_pid(self) -> int:
        """The engine core process's id (a new one after each restart)."""
        return self._core.pid

    def when_failed(self, callback: Callable[[EngineDeadError], None]) -> None:
        """callback(error), on the output thread, once the engine has failed for
        good: its core died or hung and was not restarted (or failed to restart).
        Never after shutdown(). Registered late, it runs at once."""
        with self._lock:
            error = self._final_error
            if error is None:
                self._failure_callbacks.append(callback)
                return
        callback(error)

    def _raise_if_dead(self) -> None:
        if self._shut_down:
            raise EngineDeadError("the engine was shut down; create a new AsyncLLM")
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error))

    def _run_output_loop(self) -> None:
        """The core's outputs until it fails; then a new core, or dead for good."""
        while True:
            error = self._pump_outputs()
            self._fail_all(error)
            if not self._restart_core(error):
                break
        with self._lock:
            if self._shut_down:
                return
            self._final_error = self._dead_error
            callbacks = list(self._failure_callbacks)
        logger.error("%s", self._final_error)
        for callback in callbacks:
            callback(self._final_error)

    def _pump_outputs(self) -> EngineDeadError:
        while True:
            try:
                for message in self._core.receive():
                    self._dispatch(message)
            except EngineDeadError as error:
                return error
            except Exception as error:  # a bug here would otherwise hang every caller
                logger.exception("output processing failed")
                return EngineDeadError(f"output processing failed: {error!r}")

    def _restart_core(self, error: EngineDeadError) -> bool:
        """A new core process in place of the failed one (whose requests have
        failed already); False when the engine stays dead."""
        with self._lock:
            if self._shut_down or not self._restart_failed_core:
                return False
            failed = self._core
            self._dead_error = EngineDeadError(f"{error}; a new engine core is starting, "
                                               f"retry shortly")
        logger.error("%s; starting a new engine core process", error)
        try:
            core = failed.replacement()
        except Exception as start_error:
            with self._lock:
                self._dead_error = EngineDeadError(
                    f"{error}; the new engine core failed to start: {start_error}")
            return False
        with self._lock:
            if not self._shut_down:
                self._core, self._dead_error = core, None
                self.num_core_restarts += 1
                return True
        core.stop()
        core.close()
        return False

    def _dispatch(self, message) -> None:
        if isinstance(message, CoreOutputs):
            self._process_outputs(message.outputs)
        elif isinstance(message, RequestRejected):
            with self._lock:
                self._output_processor.abort_requests([message.request_id])
                record = self._requests.get(message.request_id)
                if record is not None and not record.finished:
                    record.finished = True
                    record.put(message.error_type(message.message))
        elif isinstance(message, MetricsReply):
            with self._lock:
                future = self._metrics_queries.pop(message.query_id, None)
            # False when the caller was cancelled meanwhile; then nobody wants the answer.
            if future is not None and future.set_running_or_notify_cancel():
                future.set_result(message.metrics)
        elif isinstance(message, CoreFailed):
            with self._lock:
                self._dead_error = EngineDeadError(f"the engine core failed: {message.message}")

    def _export(self, core_outputs: list[EngineCoreOutput]) -> None:
        """Caller holds the lock. A finished prefill's KV and an encode's
        embeddings go to the export store; the final output names them."""
        for core_output in core_outputs:
            record = self._requests.get(core_output.request_id)
            if record is None or record.finished:
                continue
            try:
                if core_output.kv_export is not None:
                    digest = prompt_digest(record.prompt_token_ids, record.mm_hashes)
                    record.kv_transfer_params = self._exports.put_kv(
                        core_output.request_id, core_output.kv_export,
                        len(record.prompt_token_ids), digest)
                if core_output.embeddings is not None:
                    self._exports.put_embeddings(core_output.embeddings)
                    record.ec_transfer_params = self._exports.embedding_params(record.mm_rows)
            except FovealError as error:  # e.g. the export store cannot hold it
                core_output.finish_reason, core_output.error = "error", str(error)

    def _process_outputs(self, core_outputs: list[EngineCoreOutput]) -> None:
        with self._lock:
            self._export(core_outputs)
            outputs, stopped_ids = self._output_processor.process(core_outputs)
            if stopped_ids:  # stop strings, found here by the detokenizer
                self._abort_in_core(stopped_ids, RequestStatus.FINISHED_STOPPED)
            for output in outputs:
                record = self._requests.get(output.request_id)
                if record is None or record.finished:
                    continue
                record.finished = output.finished
                if not (record.stream or output.finished):
                    continue
                if output.metrics is not None:  # a copy: the processor keeps updating its own
                    output.metrics = dataclasses.replace(
                        output.metrics, preprocess_time=record.preprocess_time)
                output.mm_plan = record.mm_plan
                if output.finished:
                    output.kv_transfer_params = record.kv_transfer_params
                    output.ec_transfer_params = record.ec_transfer_params
                record.put(output)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._shut_down:
                error = EngineDeadError("the engine was shut down; create a new AsyncLLM")
            self._dead_error = self._dead_error or error
            message = str(self._dead_error)
            for request_id, record in self._requests.items():
                self._output_processor.abort_requests([request_id])
                if not record.finished:
                    record.finished = True
                    record.put(EngineDeadError(message))
            queries, self._metrics_queries = self._metrics_queries, {}
        for future in queries.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(message))

    def shutdown(self) -> None:
        """Stop the core process and the preprocessing pool; idempotent."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            core = self._core  # a restart under way stops its new core itself
        core.stop()
        self._output_thread.join()
        core.close()
        self._pool.shutdown()
        self._exports.close()
        if self._owns_stage_pools:
            self.stage_pools.close()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.shutdown()
