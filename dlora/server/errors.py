"""OpenAI-shaped error responses: {"error": {"message", "type", "param", "code"}}.

The `type` strings follow vLLM's server (BadRequestError, NotFoundError, ...) so clients written
against vLLM see the same errors; `code` is the HTTP status.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dlora.cluster.errors import ClusterError
from dlora.replica.errors import AdapterUnavailable, ReplicaFailure, RequestRejected

log = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    499: "ClientClosedRequest",  # nginx's code; http.HTTPStatus has no 499
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def as_api_error(exc: BaseException, request_id: str) -> APIError:
    """What a client may see of an error raised while its request was served.

    Only errors made for clients keep their message. Anything else (an engine crash, a Ray error)
    carries tracebacks, file paths and actor ids: it is logged here under the request id and the
    client gets that id to quote, nothing more.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestRejected):
        return APIError(400, exc.message, exc.param)
    if isinstance(exc, ClusterError):
        # No replica up, a deadline, too many replica failures: the cluster's messages are written
        # for clients (they name no process, actor or file).
        log.warning("request %s: %s: %s", request_id, type(exc).__name__, exc)
        return APIError(exc.http_status, f"{exc} (request id {request_id})")
    if isinstance(exc, AdapterUnavailable):
        # Registered, but no serving replica's node could get its files (the log says why): not
        # the client's doing, and another try may find a replica that can.
        log.warning("request %s: %s", request_id, exc)
        return APIError(
            503,
            f"adapter {exc.name!r} cannot be loaded on any serving replica now (request id {request_id}); "
            "try again later",
        )
    if isinstance(exc, ReplicaFailure):
        log.warning("request %s: its replica failed: %s", request_id, exc)
        return APIError(503, f"no replica is available to serve the request (request id {request_id}); try again later")
    log.error("request %s failed", request_id, exc_info=exc)
    return APIError(500, f"internal error while generating (request id {request_id})")


def _field_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # pydantic puts the union member type names in loc; keep only real field names
    parts = [p for p in parts if not (p[:1].isupper() or p.startswith(("list[", "str", "int")))]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if not isinstance(first, dict):  # vLLM raises some with plain messages (a wrong content type)
        return str(first), None
    field = _field_of(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    return (f"{field}: {msg}" if field else msg), field


def invalid_body(exc: ValidationError) -> APIError:
    """A body that failed its model's validation, as the 400 its route would have answered."""
    message, field = _validation_message(RequestValidationError(exc.errors()))
    return APIError(400, message, field)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, field = _validation_message(exc)
        return error_response(400, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # Starlette's default answer is plain text; keep the OpenAI shape and never the exception's text.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error")
