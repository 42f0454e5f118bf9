"""The OpenAI-compatible HTTP server (FastAPI): routes, error shapes, API-key check.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``, ``/tokenizer_info``, ``/health``, ``/version``, ``/metrics``. Every client
mistake is a 400 in the OpenAI error shape (pydantic validation included, never FastAPI's 422),
an unknown model a 404, a missing or wrong API key on ``/v1`` routes a 401, a server still
loading a 503. The server makes no outbound connections.
"""

from __future__ import annotations

import hmac
import inspect
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import autodeploy

from .errors import OpenAIError, bad_request, error_body, validation_message
from .metrics import CONTENT_TYPE
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from .serving_chat import create_chat_completion
from .serving_common import ServerState
from .serving_completion import create_completion
from .tokenizer import render_chat

log = logging.getLogger("autodeploy.serve.server")


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app serving ``state`` (its engine may be attached later, after loading)."""
    app = FastAPI(title="autodeploy", version=autodeploy.__version__, docs_url=None, redoc_url=None,
                  **_no_telemetry())
    app.state.server = state
    _add_error_handlers(app, state)
    _add_api_key_check(app, state)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    _add_tokenizer_routes(app, state)
    return app


def _no_telemetry() -> dict:
    """FastAPI >= 0.165 has OpenTelemetry built in, and exports (opens connections) when the
    environment says so. We never send telemetry: switch every part of it off where it exists."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False,
                          "auto_configure": False}}


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        _count_failure(request, state, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        _count_failure(request, state, 400)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        _count_failure(request, state, 500)
        return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}"), status_code=500)


def _count_failure(request: Request, state: ServerState, status: int) -> None:
    if request.url.path.startswith("/v1/") and request.method == "POST":
        state.metrics.record_failure(status)


def _add_api_key_check(app: FastAPI, state: ServerState) -> None:
    app.add_middleware(_APIKeyCheck, state=state)


class _APIKeyCheck:
    """401 on ``/v1`` routes without ``Authorization: Bearer <key>`` when a key is set.

    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would hide client disconnects
    from the handlers (``Request.is_disconnected``), and those abort requests.
    """

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        key = self.state.api_key
        if key and scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                await JSONResponse(error_body(401, "invalid or missing API key"), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        state.require_engine()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": autodeploy.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=state.served_model_name, root=state.served_model_name,
                         max_model_len=state.max_model_len or None)
        return ModelList(data=[card]).model_dump()


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request):
        return await create_completion(body, raw_request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await create_chat_completion(body, raw_request, state)


def _add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.require_engine()
        state.check_model(body.model)
        tokens = _tokenize(state, body)
        return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        tokenizer = _require_tokenizer(state)
        state.check_model(body.model)
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return _tokenizer_info(_require_tokenizer(state), state.max_model_len)


def _require_tokenizer(state: ServerState):
    state.require_engine()
    if state.tokenizer is None:
        raise bad_request("this server has no tokenizer")
    return state.tokenizer


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    tokenizer = _require_tokenizer(state)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages")
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    try:
        return render_chat(tokenizer, [m.for_template() for m in body.messages],
                           add_generation_prompt=body.add_generation_prompt, template_kwargs=body.chat_template_kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


def _tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """What lm-eval's remote tokenizer and other clients read about the tokenizer."""
    info = {
        "tokenizer_class": type(tokenizer).__name__,
        "model_max_length": max_model_len,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
        info[f"{name}_id"] = getattr(tokenizer, f"{name}_id", None)
    return info
