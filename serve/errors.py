"""HTTP errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error the server answers has this shape (OpenAI's)."""

    error: ErrorInfo


class OpenAIError(Exception):
    """An error the client sees with this status and message (never the request body)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        from fastapi.responses import JSONResponse  # (not at import: the CLI's --help imports this module)

        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message and the offending parameter from pydantic errors (inputs are not echoed)."""
    problems, param = [], None
    for error in errors:
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            problems.append(f"invalid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}")
            continue
        problems.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
        param = param or (loc[0] if loc else None)
    return "; ".join(problems), param
