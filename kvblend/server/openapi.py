"""``/openapi.json`` that says what the server does, built once from FastAPI's and then corrected:

- ``/v1/messages`` parses its own body (Anthropic-shaped errors), so FastAPI sees no request
  schema: the ``MessagesRequest`` model is added;
- the key: ``bearerAuth`` (``Authorization: Bearer``) everywhere under ``/v1/``, ``x-api-key`` as
  well on ``/v1/messages``; ``/health``, ``/metrics`` and this document are open;
- invalid bodies are 400 in the API's error shape, never FastAPI's 422; 401 / 413 / 503 come from
  the gate (``limits.py``) on every ``/v1/`` route; 502 / 504 from upstream models on the
  generating routes;
- generating routes answer JSON, or ``text/event-stream`` with ``stream: true``;
- ``model`` is an enum of the ids served.
"""

from __future__ import annotations

from typing import Any

from fastapi.openapi.utils import get_openapi

from kvblend.server.limits import is_api_path
from kvblend.server.schemas import ChatCompletion, Completion, ErrorResponse

GENERATING = {
    "/v1/chat/completions": ChatCompletion,
    "/v1/completions": Completion,
    "/v1/messages": None,
}
_ERRORS = {
    400: "Invalid request (the body, a parameter, or the context length)",
    401: "Missing or wrong API key",
    404: "Unknown model or path",
    413: "Request body over max_body_bytes",
    429: "Queue full; retry after Retry-After seconds",
    500: "Internal error",
    502: "An upstream model's service failed",
    503: "Loading, or draining for shutdown",
    504: "An upstream model's service timed out",
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: data is JSON or [DONE]",
    "properties": {name: {"type": "string"} for name in ("event", "data", "id")},
}


def install_openapi(app) -> None:
    app.openapi = lambda: _schema(app)


def _schema(app) -> dict:
    if app.openapi_schema is None:
        from kvblend.server.anthropic import MessagesRequest  # imports app modules: keep it lazy

        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        _add_model(components, MessagesRequest)
        _add_model(components, ErrorResponse)
        for model in GENERATING.values():
            if model is not None:
                _add_model(components, model)
        components["AnthropicError"] = _ANTHROPIC_ERROR
        _enumerate_models(components, sorted(app.state.kvblend.by_id))
        _limit_documents(components, app.state.kvblend.config.max_documents)
        schema["components"]["securitySchemes"] = {
            "bearerAuth": {"type": "http", "scheme": "bearer"},
            "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        for path, item in schema.get("paths", {}).items():
            for method, op in item.items():
                _fix_operation(path, method, op)
        app.openapi_schema = schema
    return app.openapi_schema


def _enumerate_models(components: dict, model_ids: list[str]) -> None:
    """``model`` lists the ids served (the document is built after the models loaded), so generated
    requests reach the models instead of stopping at 404."""
    if not model_ids:
        return
    for name in ("ChatCompletionRequest", "CompletionRequest", "ChunksRequest", "MessagesRequest"):
        prop = components.get(name, {}).get("properties", {}).get("model")
        if prop is None:
            continue
        if "anyOf" in prop:  # optional (ChunksRequest): keep null allowed
            prop["anyOf"] = [{"type": "string", "enum": model_ids}, {"type": "null"}]
        else:
            prop.pop("minLength", None)
            prop.update(type="string", enum=model_ids)


def _limit_documents(components: dict, max_documents: int) -> None:
    """``documents``: at most ``max_documents`` (the server's limit, not the model's static one)."""
    for name in ("ChatCompletionRequest", "CompletionRequest", "ChunksRequest", "MessagesRequest"):
        prop = components.get(name, {}).get("properties", {}).get("documents")
        for option in (prop or {}).get("anyOf", [prop] if prop else []):
            if option.get("type") == "array":
                option["maxItems"] = min(option.get("maxItems", max_documents), max_documents)


def _add_model(components: dict, model) -> None:
    defs_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in defs_schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, defs_schema)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _fix_operation(path: str, method: str, op: dict[str, Any]) -> None:
    if not is_api_path(path):
        return
    anthropic = path == "/v1/messages"
    op["security"] = [{"bearerAuth": []}] + ([{"apiKeyHeader": []}] if anthropic else [])
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    error = _ref("AnthropicError" if anthropic else "ErrorResponse")
    codes = [401, 404, 500, 503]
    if method in ("post", "put", "patch"):
        codes += [400, 413, 429]
    if path in GENERATING:
        codes += [502, 504]
    for code in sorted(codes):
        responses[str(code)] = {
            "description": _ERRORS[code],
            "content": {"application/json": {"schema": error}},
        }
    if path in GENERATING:
        if anthropic:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _ref("MessagesRequest")}},
            }
            body: dict = {"type": "object", "description": "An Anthropic Messages API message"}
        else:
            body = _ref(GENERATING[path].__name__)
        end = "message_stop" if anthropic else "data: [DONE]"
        text = f"The answer; with stream: true, server-sent events ending in {end} (or an error)"
        responses["200"] = {
            "description": text,
            "content": {
                "application/json": {"schema": body},
                "text/event-stream": {"schema": _SSE_EVENT},
            },
        }
