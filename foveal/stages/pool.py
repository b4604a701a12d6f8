"""A local stage: N worker processes fed from one bounded queue.

Each worker process has a feeder thread in the engine process that takes up
to `max_batch_size` queued items, sends them over the worker's pipe and waits
at most `timeout_s` per item. So items run in parallel across workers while
the caller only holds a `concurrent.futures.Future`.

Failure rules:
- queue full: `submit` raises StageOverloadedError at once (backpressure).
- worker killed or crashed: a replacement is started and each of its items is
  retried once, alone, so one poisonous input cannot fail its batch-mates; a
  second death fails that item with StageError.
- timeout: the worker is killed (it may be stuck in native code) and replaced
  on the next batch; the batch fails with StageTimeoutError.
- cancelled while queued (its caller gave up): it leaves the queue at once.
"""
from __future__ import annotations

import functools
import multiprocessing
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from foveal.errors import FovealError, StageError, StageOverloadedError, StageTimeoutError
from foveal.stages.metrics import StageMetrics
from foveal.stages.worker import worker_main

_POLL_S = 0.2


@dataclass(eq=False)
class _Job:
    item: Any
    future: Future
    attempts: int = 0


class _JobQueue(queue.Queue):
    """Bounded FIFO; a job cancelled while it waits leaves at once, freeing its slot."""

    def discard(self, job: _Job) -> None:
        with self.mutex:
            try:
                self.queue.remove(job)
            except ValueError:
                return  # a feeder has taken it
            self.not_full.notify()


class _WorkerDied(Exception):
    pass


class WorkerProcess:
    """One spawned worker process and its pipe; `call` (re)starts it when needed."""

    def __init__(self, stage: str, target: str, options: dict, startup_timeout_s: float) -> None:
        self.stage, self.target, self.options = stage, target, options
        self.startup_timeout_s = startup_timeout_s
        self.process = None
        self.conn = None
        self.pid: int | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def start(self) -> None:
        """Start the process if it is not running; errors are left for `call` to raise."""
        if not self.alive:
            try:
                self._start()
            except FovealError:
                pass

    def call(self, items: list, timeout_s: float) -> list:
        if not self.alive:
            self._start()
        try:
            self.conn.send(items)
            if not self.conn.poll(timeout_s):
                self.kill()
                raise StageTimeoutError(
                    f"{self.stage} stage took longer than {timeout_s:g} s on {len(items)} item(s); "
                    "the worker was killed; send smaller inputs or raise --stage-timeout")
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise _WorkerDied(self._death_note()) from exc

    def _start(self) -> None:
        self.kill()
        ctx = multiprocessing.get_context("spawn")  # fork would copy the engine's threads and CUDA state
        parent_conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child_conn, self.target, self.options),
                                   name=f"foveal-stage-{self.stage}", daemon=True)
        self.process.start()
        child_conn.close()
        self.conn = parent_conn
        if not parent_conn.poll(self.startup_timeout_s):
            self.kill()
            raise StageError(f"{self.stage} worker did not start within {self.startup_timeout_s:.0f} s")
        try:
            status, payload = parent_conn.recv()
        except (EOFError, OSError) as exc:
            raise StageError(f"{self.stage} worker died while starting ({self._death_note()})") from exc
        if status == "error":
            self.kill()
            raise payload
        self.pid = payload

    def _death_note(self) -> str:
        if self.process is not None:
            self.process.join(timeout=1.0)
        code = self.process.exitcode if self.process is not None else None
        return f"pid {self.pid}, exit code {code}"

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None

    def stop(self) -> None:
        if self.alive:
            try:
                self.conn.send(None)
                self.process.join(timeout=2.0)
            except OSError:
                pass
        self.kill()


class LocalStagePool:
    """`submit(item) -> Future` over `num_workers` processes of one stage."""

    def __init__(self, stage: str, target: str, options: dict, *, num_workers: int,
                 queue_size: int, timeout_s: float, max_batch_size: int,
                 metrics: StageMetrics, startup_timeout_s: float = 120.0) -> None:
        self.stage = stage
        self.timeout_s = timeout_s
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self._queue = _JobQueue(maxsize=queue_size)
        self._workers = [WorkerProcess(stage, target, options, startup_timeout_s)
                         for _ in range(num_workers)]
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._start_lock = threading.Lock()

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers if worker.alive]

    def warm_up(self) -> None:
        """Start every worker process (models loaded) now rather than on first use."""
        with self._start_lock:
            if self._threads:
                return
            starters = [threading.Thread(target=worker.start) for worker in self._workers]
            for starter in starters:
                starter.start()
            for starter in starters:
                starter.join()

    def submit(self, item: Any) -> Future:
        if self._closed.is_set():
            raise StageError(f"the {self.stage} stage pool is closed")
        self._start_threads()
        future: Future = Future()
        job = _Job(item, future)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.metrics.count("rejected")
            raise StageOverloadedError(
                f"{self.stage} stage queue is full ({self._queue.maxsize} items waiting for "
                f"{self.num_workers} worker(s)); retry later, or add workers "
                f"(--stage-workers {self.stage}=N) or raise --stage-queue-size") from None
        future.add_done_callback(functools.partial(self._discard_if_cancelled, job))
        return future

    def _discard_if_cancelled(self, job: _Job, future: Future) -> None:
        if future.cancelled():
            self._queue.discard(job)

    def _start_threads(self) -> None:
        with self._start_lock:
            if self._threads:
                return
            for index, worker in enumerate(self._workers):
                thread = threading.Thread(target=self._feed, args=(worker,), daemon=True,
                                          name=f"foveal-stage-{self.stage}-{index}")
                thread.start()
                self._threads.append(thread)

    def _feed(self, worker: WorkerProcess) -> None:
        while not self._closed.is_set():
            try:
                jobs = [self._queue.get(timeout=_POLL_S)]
            except queue.Empty:
                continue
            # leave queued items for idle workers: a batch takes only this worker's share
            share = 1 + self._queue.qsize() // self.num_workers
            while len(jobs) < min(self.max_batch_size, share):
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
            if jobs:
                self._run(worker, jobs)
        worker.stop()

    def _run(self, worker: WorkerProcess, jobs: list[_Job]) -> None:
        try:
            outcomes = worker.call([job.item for job in jobs], self.timeout_s * len(jobs))
        except _WorkerDied as died:
            self.metrics.count("worker_restarts")
            self._retry_alone(worker, jobs, str(died))
            return
        except FovealError as error:  # timeout, or the worker could not start
            for job in jobs:
                job.future.set_exception(error)
            return
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

    def _retry_alone(self, worker: WorkerProcess, jobs: list[_Job], death_note: str) -> None:
        for job in jobs:
            job.attempts += 1
            if job.attempts > 1:
                job.future.set_exception(StageError(
                    f"{self.stage} worker died twice while processing this item ({death_note}); "
                    "the input may crash the stage's library, or the machine is out of memory"))
            else:
                self._run(worker, [job])

    def close(self) -> None:
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=10.0)
        for worker in self._workers:  # a feeder still waiting on a slow item
            worker.kill()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(StageError(f"the {self.stage} stage pool was closed"))
