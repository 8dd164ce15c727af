"""Errors in OpenAI's wire format: ``{"error": {"message", "type", "param", "code"}}``.

Every failure path of the app ends here, so clients (the official SDKs included) parse our errors
exactly like OpenAI's, and no traceback ever reaches a client.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str, valid: list[str]) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist. Available models: {', '.join(valid)}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def context_length_exceeded(
    prompt_tokens: int, max_context_len: int, param: str = "messages"
) -> APIError:
    return invalid_request(
        f"This model's maximum context length is {max_context_len} tokens. However, your messages "
        f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
        param,
        "context_length_exceeded",
    )


def queue_full(retry_after_s: int, depth: int) -> APIError:
    return APIError(
        429,
        f"The server is busy ({depth} requests waiting for this model). Please retry after "
        f"{retry_after_s}s.",
        "rate_limit_error",
        None,
        "rate_limit_exceeded",
        {"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(
        503,
        message,
        "server_error",
        None,
        "service_unavailable",
        {"Retry-After": str(retry_after_s)},
    )


def internal_error() -> APIError:
    return APIError(
        500, "The server had an error while processing your request.", "server_error", None, None
    )


def _loc_to_param(loc: tuple) -> str | None:
    # ("body", "messages", 0, "content") -> "messages[0].content"
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return invalid_request("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly.)"
        )
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing" and param is None:
        return invalid_request(
            "The request body is empty; send a JSON object with the request's parameters.",
            None,
            "empty_body",
        )
    if first.get("type") == "missing":
        return invalid_request(
            f"Missing required parameter: {param!r}.", param, "missing_required_parameter"
        )
    if param is None:
        return invalid_request(f"Invalid request body: {msg}.")
    return invalid_request(f"Invalid value for {param!r}: {msg}.", param, "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return APIError(
            exc.status_code, detail, "invalid_request_error", None, code, dict(exc.headers or {})
        ).response()

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()


# --- Anthropic's shape (/v1/messages): {"type": "error", "error": {"type", "message"}} ---------

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error_response(e: APIError) -> JSONResponse:
    return JSONResponse(
        {"type": "error", "error": {"type": anthropic_error_type(e.status), "message": e.message}},
        status_code=e.status,
        headers=e.headers,
    )


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_ERROR_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
