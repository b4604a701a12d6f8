"""The engine core in its own process, and the API process's handle on it.

The core process builds EngineCore exactly as LLMEngine does and loops:
drain incoming messages (without blocking while it has work), step, send the
step's outputs. With nothing to do it blocks on its input socket and on its
parent's sentinel, so it neither spins nor outlives the API process.

Two ZeroMQ PUSH/PULL pairs over ipc:// sockets in a private temp folder:
API -> core carries CoreInput messages, core -> API carries CoreMessages.

Faults are bounded on the API side: a core that exits (killed included) is seen
at once through its process sentinel; one that stops answering (hung in native
code, stopped) is seen by a deadline. Whenever the core has been silent for a
quarter of `hang_timeout_s` the reader pings it; the loop answers between steps,
or at once when idle. Silent for `hang_timeout_s` in all, it is killed and
counts as dead. So one step may take at most `hang_timeout_s`.
"""
from __future__ import annotations

import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

import zmq

from foveal.async_engine.messages import (AbortRequests, AddRequest, CoreFailed, CoreMessage,
                                          CoreOutputs, CoreReady, MetricsQuery, MetricsReply,
                                          Ping, Pong, RequestRejected, Shutdown, decode, encode)
from foveal.config import EngineConfig
from foveal.engine.core import EngineCore
from foveal.errors import ConfigError, EngineDeadError, FovealError, InvalidRequestError
from foveal.logger import init_logger

logger = init_logger(__name__)

_STOP_TIMEOUT_S = 10.0
_STRAGGLER_TIMEOUT_MS = 200  # messages sent just before the core exited
DEFAULT_HANG_TIMEOUT_S = 300.0  # as the multi-process executor's step timeout (executor/ranks.py)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Entry point of the engine core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    executor = None
    try:
        from foveal.executor import build_engine_core

        core = build_engine_core(config)
        executor = core.executor
        outputs.send(encode(CoreReady(core.num_blocks)))
        _CoreLoop(core, inputs, outputs).run()
    except BaseException as error:  # reported to the API process, then the process exits
        traceback.print_exc()
        error_type = type(error) if isinstance(error, FovealError) else EngineDeadError
        outputs.send(encode(CoreFailed(error_type, f"{type(error).__name__}: {error}")))
        raise SystemExit(1) from None
    finally:
        if executor is not None:
            executor.shutdown()
        inputs.close(linger=0)
        outputs.close(linger=int(_STOP_TIMEOUT_S * 1000))
        context.term()


class _CoreLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_sentinel = multiprocessing.parent_process().sentinel
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.poller.register(self.parent_sentinel, zmq.POLLIN)

    def run(self) -> None:
        while True:
            busy = self.core.has_unfinished_requests()
            events = dict(self.poller.poll(0 if busy else None))
            if self.parent_sentinel in events:
                return  # the API process is gone: nobody reads our outputs
            num_handled = self._drain()
            if num_handled is None:
                return
            if busy or num_handled:
                # Also after aborts alone: the step tells the workers to drop them.
                self._send(CoreOutputs(self.core.step()), skip_empty=True)

    def _drain(self) -> int | None:
        """Handle every waiting message; None when one asks to shut down."""
        num_handled = 0
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return num_handled
            message = decode(frame)
            if isinstance(message, Shutdown):
                return None
            self._handle(message)
            num_handled += 1

    def _handle(self, message) -> None:
        if isinstance(message, AddRequest):
            try:
                self.core.add_request(message.request)
            except InvalidRequestError as error:
                request_id = message.request.request_id
                self._send(RequestRejected(request_id, type(error), str(error)))
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids, message.status)
        elif isinstance(message, MetricsQuery):
            self._send(MetricsReply(message.query_id, self.core.get_stats()))
        elif isinstance(message, Ping):
            self._send(Pong())
        else:
            raise TypeError(f"the engine core got an unknown message {type(message).__name__}")

    def _send(self, message: CoreMessage, skip_empty: bool = False) -> None:
        if skip_empty and isinstance(message, CoreOutputs) and not message.outputs:
            return
        self.outputs.send(encode(message))


class EngineCoreProcess:
    """The API process's handle: starts the core process, sends to it, reads from it.

    `send` may be called from any thread; `receive` from one reader thread only.
    The constructor returns once the core has loaded the model and is ready.
    hang_timeout_s: how long the core may stay silent, pings unanswered, before
    `receive` kills it and raises EngineDeadError.
    """

    def __init__(self, config: EngineConfig,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        if hang_timeout_s <= 0:
            raise ConfigError(f"engine hang timeout {hang_timeout_s:g} s (--engine-hang-timeout): "
                              f"it must be > 0")
        self.config = config
        self.hang_timeout_s = hang_timeout_s
        self._ping_interval_ms = max(1, int(hang_timeout_s * 250))
        self._last_heard = time.monotonic()
        self._socket_dir = Path(tempfile.mkdtemp(prefix="foveal-core-"))
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(f"ipc://{self._socket_dir}/input")
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(f"ipc://{self._socket_dir}/output")
        self._send_lock = threading.Lock()
        self._closed = False
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="foveal-engine-core", daemon=True,
            args=(config, f"ipc://{self._socket_dir}/input",
                  f"ipc://{self._socket_dir}/output"))
        self.process.start()
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self.process.sentinel, zmq.POLLIN)
        try:
            self.num_blocks = self._wait_ready()
        except BaseException:
            self.stop()
            self.close()
            raise
        logger.info("engine core process %d is ready (%d KV blocks)", self.pid, self.num_blocks)

    def _wait_ready(self) -> int:
        """Loading the model has no deadline: it is not yet a hang."""
        try:
            first = self.receive(deadline=False)[0]
        except EngineDeadError as error:
            raise EngineDeadError(f"the engine core process failed to start: {error}") from None
        if isinstance(first, CoreFailed):
            raise first.error_type(f"the engine core failed to start: {first.message}")
        if not isinstance(first, CoreReady):
            raise EngineDeadError(f"the engine core sent {type(first).__name__} before ready")
        return first.num_blocks

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message_or_frame) -> None:
        """Send a CoreInput (or one already encoded); EngineDeadError if the core is gone."""
        frame = message_or_frame if isinstance(message_or_frame, bytes) \
            else encode(message_or_frame)
        with self._send_lock:
            if self._closed or not self.process.is_alive():
                raise EngineDeadError("the engine core process is not running; "
                                      "start a new engine")
            try:
                self._input.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as error:  # zmq.Again: the core has disconnected
                raise EngineDeadError(f"the engine core process is unreachable ({error}); "
                                      f"start a new engine") from None

    def receive(self, deadline: bool = True) -> list[CoreMessage]:
        """Block until the core sends something ([] for an answered ping);
        EngineDeadError once it exited and every message it sent before exiting
        has been returned, or (with deadline) once it has been silent for
        hang_timeout_s (it is killed)."""
        while True:
            events = dict(self._poller.poll(self._ping_interval_ms if deadline else None))
            if self._output in events or self.process.sentinel in events:
                break
            silent_s = time.monotonic() - self._last_heard
            if silent_s >= self.hang_timeout_s:
                self.kill()
                raise EngineDeadError(
                    f"the engine core process answered nothing for {silent_s:.1f} s (hung; "
                    f"the limit is {self.hang_timeout_s:g} s, --engine-hang-timeout); it was killed")
            self.send(Ping())
        if self._output not in events and not self._output.poll(_STRAGGLER_TIMEOUT_MS):
            self.process.join()
            raise EngineDeadError(
                f"the engine core process exited (exit code {self.process.exitcode})")
        self._last_heard = time.monotonic()
        messages = []
        while True:
            try:
                message = decode(self._output.recv(zmq.NOBLOCK))
            except zmq.Again:
                return messages
            if not isinstance(message, Pong):
                messages.append(message)

    def replacement(self) -> "EngineCoreProcess":
        """Kill this core (dead or hung) and start a new one like it, ready."""
        self.kill()
        self.close()
        return EngineCoreProcess(self.config, self.hang_timeout_s)

    def kill(self) -> None:
        """SIGKILL: a hung core answers no Shutdown (and a stopped one no SIGTERM).
        The wait is bounded: a process stuck in a driver call dies when it returns."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(_STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Ask the core to exit, then make sure it has; idempotent."""
        if self.process.is_alive():
            try:
                self.send(Shutdown())
            except EngineDeadError:
                pass  # it is exiting anyway; join/terminate below
            self.process.join(_STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def close(self) -> None:
        """Close the sockets once no thread uses them (after stop); idempotent."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
