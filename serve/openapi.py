"""``/openapi.json`` as the server really answers: errors in the OpenAI shape with their real status
codes (400 for every invalid request, never FastAPI's 422; 401, 404, 413, 500, 503 where they can
happen), and the operator's request limits in ``info`` (``x-request-limits``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .errors import ErrorResponse
from .limits import RequestLimits

ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a field out of its bounds, a request limit exceeded, a prompt "
         "longer than the context",
    401: "Missing or wrong API key (when the server requires one)",
    404: "Unknown model",
    413: "Request body larger than the server's limit",
    500: "The request failed in the server (other requests are not affected)",
    503: "The model is still loading, the engine has stopped, or the server is shutting down",
}
GENERATION_ERRORS = (400, 401, 404, 413, 500, 503)
READ_ERRORS = (401, 503)


def error_responses(statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


SSE_EVENT = {  # (before OpenAPI 3.2, the schema of an event stream describes one event)
    "type": "object",
    "properties": {"data": {"type": "string", "description": "one chunk as JSON (the response's shape with the "
                                                              "new text; or an error object), or [DONE] last"}},
    "required": ["data"],
}


def streaming_response(model: type) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON, or server-sent events when the request sets ``stream``."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def install_openapi(app: FastAPI, limits: RequestLimits) -> None:
    """Replace FastAPI's schema generator with one that drops the 422 it adds to every route."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="An OpenAI-compatible server for models compiled by autodeploy.")
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            schema["info"]["x-request-limits"] = limits.model_dump()
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
