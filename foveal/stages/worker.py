"""The worker process: build the stage, load its model once, then serve batches.

Protocol over one duplex pipe: the worker first sends ("ready", pid) or
("error", exception); then each received list of items is answered with a
list of results or exceptions, one per item. `None` or a closed pipe ends it.
"""
from __future__ import annotations

import os
import signal
from typing import Any

from foveal.errors import FovealError, StageError


def worker_main(conn, target: str, options: dict[str, Any]) -> None:
    from foveal.stages import load_stage_class

    # Ctrl-C reaches the whole process group; the pool that owns us decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stage = load_stage_class(target)(**options)
        stage.load()
    except Exception as exc:
        error = exc if isinstance(exc, FovealError) else StageError(
            f"stage {target} failed to start ({type(exc).__name__}: {exc})")
        conn.send(("error", error))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            items = conn.recv()
        except (EOFError, OSError):
            return
        if items is None:
            return
        conn.send(stage.process_batch(items))
