"""Base64 data URLs (`data:<mime>;base64,<payload>`) and local files -> bytes, for
every media kind."""
from __future__ import annotations

import base64
import binascii
import pathlib

from foveal.errors import MediaError


def decode_data_url(url: str, mime_prefixes: tuple[str, ...], kind: str) -> bytes:
    """The payload of a base64 data URL whose MIME type starts with one of mime_prefixes."""
    header, sep, payload = url.partition(",")
    mime, *params = header[len("data:"):].split(";")
    if not sep or not mime.lower().startswith(mime_prefixes):
        raise MediaError(
            f"data URL header {header[:64]!r} is not {kind}; expected "
            f"'data:{mime_prefixes[0]}<format>;base64,<payload>'")
    if "base64" not in (p.lower() for p in params):
        raise MediaError(f"only base64 data URLs are supported: "
                         f"'data:{mime_prefixes[0]}<format>;base64,<payload>'")
    return decode_base64(payload, kind)


def decode_base64(payload: str, kind: str) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{kind} data URL payload is not valid base64 ({exc})") from exc


def read_media_file(path: pathlib.Path, kind: str) -> bytes:
    """The bytes of a local `kind` file ("image", "audio", ...), or MediaError."""
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise MediaError(f"{kind} file not found: {str(path)!r}") from exc
    except (OSError, ValueError) as exc:  # ValueError: a NUL or an unpaired surrogate in the path
        raise MediaError(f"cannot read {kind} file {str(path)!r} "
                         f"({getattr(exc, 'strerror', None) or exc})") from exc
