"""The `foveal` logger: INFO lines on stderr, e.g. the KV cache capacity at start.

Level from FOVEAL_LOGGING_LEVEL (default INFO); FOVEAL_CONFIGURE_LOGGING=0
leaves handlers to the application.
"""
from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """A logger under `foveal`, with the package handler installed once."""
    global _configured
    if not _configured and os.environ.get("FOVEAL_CONFIGURE_LOGGING", "1") != "0":
        root = logging.getLogger("foveal")
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("FOVEAL_LOGGING_LEVEL", "INFO").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
