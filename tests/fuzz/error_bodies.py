"""What every error answer of the server must look like: OpenAI's error JSON, and
nothing of the server's insides (tracebacks, file paths)."""
from __future__ import annotations

import pathlib

import foveal

# A traceback, an installed package's path, the checkout's path.
INTERNAL_MARKERS = ("Traceback", 'File "', "site-packages",
                    str(pathlib.Path(foveal.__file__).parent.parent))


def check_error_body(status: int, text: str, body: dict) -> dict:
    """The body's "error" object, checked: OpenAI's four keys, the status as code,
    the type a client branches on, no internals anywhere in the text."""
    for marker in INTERNAL_MARKERS:
        assert marker not in text, f"{marker!r} leaks in {text[:500]}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error
