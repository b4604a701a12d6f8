"""Tensor parallelism across local processes: one worker process per rank.

Each rank joins torch.distributed (gloo on CPU, NCCL on CUDA) over a loopback
TCP rendezvous, joins the tensor-parallel group, builds its Worker (which
loads its shard of the weights and sizes its KV pool) and then serves calls
from a pipe: the engine sends every rank the same plan; rank 0 answers with
the step's output, the others with None. The layers' collectives are the only
traffic between ranks.

Faults are bounded: a rank that dies is seen within a poll interval; a rank
that hangs makes the others' collectives fail after `collective_timeout_s`;
every wait here has a deadline. Any of them raises EngineDeadError, and
shutdown kills what does not exit by itself, so no process is orphaned.
"""
from __future__ import annotations

import os
import pickle
import secrets
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Client, Listener
from typing import Any

from foveal.config import EngineConfig
from foveal.errors import EngineDeadError
from foveal.executor.base import Executor
from foveal.executor.ranks import (call_timeout_s, check_no_encoder_connector, free_port,
                                   is_start_error, rank_reply, start_rank, startup_timeout_s)
from foveal.logger import init_logger

logger = init_logger(__name__)

_POLL_S = 0.2


def _send(conn, obj: Any) -> None:
    """Plain pickle, not multiprocessing's: tensors travel by value, not as shared
    file descriptors that the receiving interpreter could not open."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn) -> Any:
    return pickle.loads(conn.recv_bytes())


def threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str,
                conn, collective_timeout_s: float) -> None:
    """One rank: join the group, build the worker, serve calls until shutdown."""
    import torch.distributed as dist

    try:
        worker = start_rank(config, rank, world_size, init_method, collective_timeout_s,
                            threads_per_rank(world_size), cuda_device=rank)
    except Exception as error:  # noqa: BLE001 - reported to the engine, which raises it
        _send(conn, ("error", _portable(error)))
        return
    _send(conn, ("ok", None))
    while True:
        try:
            method, args = _recv(conn)
        except (EOFError, OSError):  # the engine went away: exit, do not linger
            break
        try:
            result = getattr(worker, method)(*args)
            _send(conn, ("ok", rank_reply(rank, method, result)))
        except Exception as error:  # noqa: BLE001
            _send(conn, ("error", _portable(error)))
        if method == "shutdown":
            break
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly
        pass


def _portable(error: Exception) -> Exception:
    """The error itself when it pickles (typed errors keep their type), else a summary."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")


class MultiprocExecutor(Executor):
    def _init_workers(self, encoder_connector_worker: Any) -> None:
        check_no_encoder_connector(encoder_connector_worker)
        world_size = self.config.parallel.world_size
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = {**os.environ, "FOVEAL_TP_AUTHKEY": authkey.hex()}
        # A fresh interpreter per rank (not fork, not spawn): it imports neither the
        # caller's __main__ nor anything the engine process set up.
        self._processes = [subprocess.Popen(
            [sys.executable, "-m", "foveal.executor.multiproc", str(listener.address[1])],
            env=env) for _ in range(world_size)]
        self._conns: list[Any] = [None] * world_size
        self._dead = False
        try:
            self._accept(listener, world_size)
            init_method = f"tcp://127.0.0.1:{free_port()}"
            for rank, conn in enumerate(self._conns):
                _send(conn, (self.config, rank, world_size, init_method,
                           self.config.parallel.collective_timeout_s))
            self._gather("start", startup_timeout_s())
        except Exception:
            self._kill()
            raise
        finally:
            listener.close()
        logger.info("tensor parallel: %d worker processes (%s), %d threads each", world_size,
                    "nccl" if self.config.device.startswith("cuda") else "gloo",
                    threads_per_rank(world_size))

    def _accept(self, listener: Listener, world_size: int) -> None:
        """One connection per process, in rank order (rank = launch order)."""
        listener._listener._socket.settimeout(_POLL_S)  # so a dead child is noticed
        timeout = startup_timeout_s()
        deadline = time.monotonic() + timeout
        pending = world_size
        while pending:
            try:
                conn = listener.accept()
            except (socket.timeout, TimeoutError):
                for index, process in enumerate(self._processes):
                    if process.poll() is not None and self._conns[index] is None:
                        raise EngineDeadError(f"tensor-parallel worker {index} exited with "
                                              f"code {process.returncode} before connecting")
                if time.monotonic() > deadline:
                    raise EngineDeadError("tensor-parallel workers did not connect within "
                                          f"{timeout:.0f} s") from None
                continue
            pid = _recv(conn)
            index = next(i for i, p in enumerate(self._processes) if p.pid == pid)
            self._conns[index] = conn
            pending -= 1

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self._dead:
            raise EngineDeadError("a tensor-parallel worker failed earlier; start a new engine")
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)  # once for all
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except (BrokenPipeError, OSError) as error:
                self._fail(f"rank {rank} is gone ({error})")
        return self._gather(method, call_timeout_s(method))

    def _gather(self, method: str, timeout_s: float) -> list[Any]:
        """Each rank's answer to `method`, in rank order, or EngineDeadError."""
        results, errors = [], []
        deadline = time.monotonic() + timeout_s
        for rank, (conn, process) in enumerate(zip(self._conns, self._processes)):
            while not conn.poll(_POLL_S):
                if process.poll() is not None:
                    self._fail(f"rank {rank} died (exit code {process.returncode}) during "
                               f"{method}")
                if time.monotonic() > deadline:
                    self._fail(f"rank {rank} did not answer {method} within {timeout_s:.0f} s")
            try:
                status, value = _recv(conn)
            except (EOFError, OSError):
                self._fail(f"rank {rank} closed its pipe during {method}")
            (errors if status == "error" else results).append(value)
        if errors:
            if all(is_start_error(e, method) for e in errors):
                self._kill()
                raise errors[0]  # a typed error at start (ConfigError, CheckpointError)
            self._fail(f"{method} failed on a tensor-parallel rank: {errors[0]}", errors[0])
        return results

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        self._dead = True
        self._kill()
        raise EngineDeadError(message) from cause

    def shutdown(self) -> None:
        if not self._dead:
            try:
                for conn in self._conns:
                    _send(conn, ("shutdown", ()))
                self._gather("shutdown", 30)
            except (EngineDeadError, BrokenPipeError, OSError):
                pass
        self._kill()

    def _kill(self) -> None:
        """Wait for every rank briefly; terminate, then kill, what is still running."""
        for process in self._processes:
            for stop in (None, process.terminate, process.kill):
                if stop is not None and process.poll() is None:
                    stop()
                try:
                    process.wait(timeout=2)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._conns = []
        self._processes = []
        self._dead = True


def _child_main() -> None:
    """`python -m foveal.executor.multiproc PORT`: connect back, get the rank, serve."""
    authkey = bytes.fromhex(os.environ.pop("FOVEAL_TP_AUTHKEY"))
    conn = Client(("127.0.0.1", int(sys.argv[1])), authkey=authkey)
    _send(conn, os.getpid())
    config, rank, world_size, init_method, timeout = _recv(conn)
    worker_main(config, rank, world_size, init_method, conn, timeout)


if __name__ == "__main__":
    _child_main()
