"""Errors as OpenAI's JSON body {"error": {message, type, param, code}} with the
HTTP status a client expects: 400 for anything the request got wrong, 401 for
a missing or wrong API key, 503 when the engine or a preprocessing stage sheds
load, 502 when a stage (its worker or remote endpoint) failed on an item. A 500
means a bug in Foveal, never a bad request."""
from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from foveal import errors as foveal_errors

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
        logger.exception("internal error while serving a request", exc_info=error)
        return error_response(f"internal server error ({type(error).__name__}: {error})", status)
    return error_response(str(error), status, getattr(error, "param", None))


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    problems = []
    for item in error.errors():
        if item.get("type") == "json_invalid":
            return f"request body is not valid JSON ({item.get('msg')})", None
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        problems.append(f"{location or 'body'}: {item.get('msg')}")
    first = error.errors()[0].get("loc", ()) if error.errors() else ()
    param = str(first[1]) if len(first) > 1 else None
    return "invalid request: " + "; ".join(problems), param


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(message, HTTPStatus.BAD_REQUEST, param)

    async def on_json(_: Request, error: json.JSONDecodeError) -> JSONResponse:
        return error_response(f"request body is not valid JSON ({error})", HTTPStatus.BAD_REQUEST)

    async def on_any(_: Request, error: Exception) -> JSONResponse:
        return response_for(error)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(json.JSONDecodeError, on_json)
    app.add_exception_handler(APIError, on_any)
    app.add_exception_handler(foveal_errors.FovealError, on_any)
    app.add_exception_handler(Exception, on_any)
