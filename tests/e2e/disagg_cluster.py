"""Worker servers and a router as real processes on 127.0.0.1, for the
disaggregation tests (foveal/disagg/launch.py)."""
from __future__ import annotations

from foveal.disagg.launch import ServerProcess, metric, start_all

__all__ = ["ServerProcess", "metric", "start_all"]
