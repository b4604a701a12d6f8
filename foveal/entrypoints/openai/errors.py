"""Errors as OpenAI's JSON body {"error": {message, type, param, code}} with the
HTTP status a client expects: 400 for anything the request got wrong, 401 for
a missing or wrong API key, 503 when the engine or a preprocessing stage sheds
load, 502 when a stage (its worker or remote endpoint) failed on an item. A 500
means a bug in Foveal, never a bad request; its message is generic (the log has
the exception). A body the schema refuses is a 400 naming each wrong field with
what it takes; unknown routes and methods are 404 / 405 in the same JSON."""
from __future__ import annotations

import json
import logging
import reprlib
import types
import typing
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from foveal import errors as foveal_errors
from foveal.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

# The server is fine but cannot take this request now: clients should retry.
_UNAVAILABLE = (foveal_errors.EngineOverloadedError, foveal_errors.StageOverloadedError,
                foveal_errors.EngineDeadError, foveal_errors.TransferError)


class APIError(Exception):
    """An error the API layer raises itself (auth, unknown model, bad body)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == HTTPStatus.UNAUTHORIZED:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": int(status)}}


def error_response(message: str, status: HTTPStatus, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=int(status))


def status_of(error: Exception) -> HTTPStatus:
    """HTTP status for an exception raised while serving one request."""
    if isinstance(error, APIError):
        return error.status
    if isinstance(error, _UNAVAILABLE):
        return HTTPStatus.SERVICE_UNAVAILABLE
    if isinstance(error, foveal_errors.InvalidRequestError):
        return HTTPStatus.BAD_REQUEST
    if isinstance(error, foveal_errors.StageError):
        return HTTPStatus.BAD_GATEWAY
    return HTTPStatus.INTERNAL_SERVER_ERROR


def response_for(error: Exception) -> JSONResponse:
    status = status_of(error)
    if status == HTTPStatus.INTERNAL_SERVER_ERROR and not isinstance(error, APIError):
        # The client sees no exception text: it may hold paths or internals.
        logger.exception("internal error while serving a request", exc_info=error)
        return error_response("internal server error; the server log has the details", status)
    return error_response(str(error), status, getattr(error, "param", None))


_MAX_PROBLEMS = 3


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    items = error.errors()
    body_problem = next((item for item in items if tuple(item.get("loc", ())) == ("body",)), None)
    if items and items[0].get("type") == "json_invalid":
        ctx = items[0].get("ctx") or {}
        position = items[0].get("loc", ("body", "?"))[-1]
        return f"request body is not valid JSON ({ctx.get('error', 'decode error')} at " \
               f"character {position})", None
    if body_problem is not None or not items:
        return _body_message(body_problem or {"type": "missing"}), None
    by_field: dict[str, list[dict]] = {}
    for item in items:
        by_field.setdefault(str(item["loc"][1]), []).append(item)
    body = error.body if isinstance(error.body, dict) else {}
    problems = [_field_problem(name, failures, body.get(name))
                for name, failures in by_field.items()]
    more = f" (and {len(problems) - _MAX_PROBLEMS} more)" if len(problems) > _MAX_PROBLEMS else ""
    return "invalid request: " + "; ".join(problems[:_MAX_PROBLEMS]) + more, next(iter(by_field))


def _field_problem(name: str, failures: list[dict], value) -> str:
    """One line per field: a union field's failures (one per member type) become
    the types it takes; a list's, the first few elements."""
    if any(_is_union_member(part) for item in failures for part in item["loc"][2:]) \
            and name in _FIELD_TYPES:
        return f"{name}: expected {_FIELD_TYPES[name]}, got {_short_repr(value)}"
    lines = []
    for item in failures[:_MAX_PROBLEMS]:
        path = ".".join(str(part) for part in item["loc"][1:])
        given = "" if item.get("type") == "missing" else f" (got {_short_repr(item.get('input'))})"
        lines.append(f"{path}: {item.get('msg')}{given}")
    more = len(failures) - _MAX_PROBLEMS
    return ", ".join(lines) + (f" (and {more} more in {name})" if more > 0 else "")


def _is_union_member(part) -> bool:
    # pydantic names the member of a union that failed by its type: "str", "list[int]".
    return isinstance(part, str) and ("[" in part or part in _PYTHON_TYPE_NAMES)


_JSON_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object",
               list: "array", type(None): "null"}
_PYTHON_TYPE_NAMES = frozenset(kind.__name__ for kind in _JSON_NAMES)


def _json_type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_json_type_name(arg) for arg in args)
    if origin is list:
        return f"array of {_json_type_name(args[0])}"
    return _JSON_NAMES.get(origin or annotation, "object")


_FIELD_TYPES = {name: _json_type_name(field.annotation)
                for model in (CompletionRequest, ChatCompletionRequest)
                for name, field in model.model_fields.items()}


def _body_message(item: dict) -> str:
    if item.get("type") == "missing":
        return "request body is empty; send a JSON object"
    given = item.get("input")
    if isinstance(given, (bytes, bytearray)):
        return "request body is not JSON; send a JSON object with 'Content-Type: application/json'"
    return f"request body must be a JSON object, got {_json_type(given)}"


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 40, 40


def _short_repr(value) -> str:
    return _REPR.repr(value)


_HTTP_HINTS = {HTTPStatus.NOT_FOUND: "see /v1/chat/completions, /v1/completions, /v1/models",
               HTTPStatus.METHOD_NOT_ALLOWED: "use POST for completions, GET for models"}


def _http_message(request: Request, error: StarletteHTTPException) -> str:
    status = HTTPStatus(error.status_code)
    if status in _HTTP_HINTS:
        return f"{request.method} {request.url.path[:100]}: {status.phrase.lower()}; " \
               f"{_HTTP_HINTS[status]}"
    cause = error.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return "request body is not valid UTF-8 JSON"
    if isinstance(cause, RecursionError):
        return "request body nests too deeply to parse; flatten the JSON"
    return str(error.detail)


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(message, HTTPStatus.BAD_REQUEST, param)

    async def on_json(_: Request, error: json.JSONDecodeError) -> JSONResponse:
        return error_response(f"request body is not valid JSON ({error})", HTTPStatus.BAD_REQUEST)

    async def on_http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        response = error_response(_http_message(request, error), HTTPStatus(error.status_code))
        response.headers.update(error.headers or {})
        return response

    async def on_any(_: Request, error: Exception) -> JSONResponse:
        return response_for(error)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(json.JSONDecodeError, on_json)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(APIError, on_any)
    app.add_exception_handler(foveal_errors.FovealError, on_any)
    app.add_exception_handler(Exception, on_any)
