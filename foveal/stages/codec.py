"""Stage items, results and errors <-> JSON, for remote stages.

Driven by the dataclasses' type hints, so nothing is pickled across the
network: bytes travel as base64, dataclasses as objects, NamedTuples as
arrays. Errors travel as {"type", "message"} and come back as the same
`foveal.errors` class (any other name becomes StageError).
"""
from __future__ import annotations

import base64
import dataclasses
import types
import typing
from typing import Any

from foveal import errors
from foveal.errors import FovealError, StageError


def encode(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if dataclasses.is_dataclass(value):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(annotation: Any, data: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _decode_union(typing.get_args(annotation), data)
    if data is None:
        return None
    if annotation is bytes:
        return base64.b64decode(data)
    if dataclasses.is_dataclass(annotation):
        hints = typing.get_type_hints(annotation)
        return annotation(**{f.name: decode(hints[f.name], data[f.name])
                             for f in dataclasses.fields(annotation) if f.name in data})
    if isinstance(annotation, type) and issubclass(annotation, tuple) and hasattr(annotation, "_fields"):
        hints = typing.get_type_hints(annotation)
        return annotation(*(decode(hints[name], v) for name, v in zip(annotation._fields, data)))
    if origin in (list, tuple):
        return origin(_decode_sequence(origin, typing.get_args(annotation), data))
    return data


def _decode_union(options: tuple, data: Any) -> Any:
    if data is None:
        return None
    concrete = [option for option in options if option is not type(None)]
    return decode(concrete[0], data)


def _decode_sequence(origin: type, args: tuple, data: list) -> list:
    if origin is tuple and args and args[-1] is not Ellipsis:
        return [decode(arg, v) for arg, v in zip(args, data)]
    element = args[0] if args else Any
    return [decode(element, v) for v in data]


def encode_error(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)}


def decode_error(data: dict[str, str]) -> FovealError:
    error_type = getattr(errors, str(data.get("type")), None)
    if not (isinstance(error_type, type) and issubclass(error_type, FovealError)):
        error_type = StageError
    return error_type(str(data.get("message", "remote stage error")))
