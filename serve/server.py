"""The OpenAI-compatible HTTP server (FastAPI): routes, error shapes, guards.

Routes: ``/v1/models`` (and ``/v1/models/{id}``), ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``, ``/tokenizer_info``, ``/health``, ``/version``, ``/metrics``, ``/openapi.json``.
Every client mistake is a 400 in the OpenAI error shape (pydantic validation included, never
FastAPI's 422), an unknown model a 404, a wrong method a 405 with ``Allow``, a body over the limit
a 413; with an API key set every route but ``/health`` needs it (401); a server still loading, whose
engine stopped, or shutting down answers 503. A request that fails in the engine gets a 500 alone.
Tokenization and template rendering run on worker threads (``preprocess``), never on the event
loop. The server makes no outbound connections.
"""

from __future__ import annotations

import inspect
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import autodeploy

from .async_engine import RequestFailedError
from .errors import OpenAIError, bad_request, error_body, validation_message
from .guards import RequestGuard
from .metrics import CONTENT_TYPE
from .openapi import GENERATION_ERRORS, READ_ERRORS, error_responses, install_openapi, streaming_response
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       DetokenizeRequest, DetokenizeResponse, HealthResponse, ModelCard, ModelList, TokenizeRequest,
                       TokenizeResponse, VersionResponse)
from .serving_chat import create_chat_completion
from .serving_common import ServerState, error_status
from .serving_completion import create_completion

log = logging.getLogger("autodeploy.serve.server")


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app serving ``state`` (its engine may be attached later, after loading)."""
    app = FastAPI(title="autodeploy", version=autodeploy.__version__, docs_url=None, redoc_url=None,
                  **_no_telemetry())
    app.state.server = state
    _add_error_handlers(app, state)
    app.add_middleware(RequestGuard, keys=state.keys, max_body_bytes=state.limits.max_request_body_bytes,
                       metrics_without_key=state.metrics_without_key)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    _add_tokenizer_routes(app, state)
    install_openapi(app, state.limits)
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
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=exc.headers)  # (405's Allow)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        status, message = error_status(exc), str(exc)
        if status == 500 and not isinstance(exc, RequestFailedError):  # (the engine's failures are logged there)
            log.exception("unhandled error in %s", request.url.path)
            message = f"internal server error: {type(exc).__name__}"
        if not isinstance(exc, RequestFailedError):  # (those the metrics counted when the engine reported them)
            _count_failure(request, state, status)
        return JSONResponse(error_body(status, message), status_code=status)


def _count_failure(request: Request, state: ServerState, status: int) -> None:
    if request.url.path.startswith("/v1/") and request.method == "POST":
        state.metrics.record_failure(status)


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_model=HealthResponse, responses=error_responses((503,)))
    async def health():
        state.require_engine()
        return HealthResponse()

    @app.get("/version", response_model=VersionResponse, responses=error_responses((401,)))
    async def version():
        return VersionResponse(version=autodeploy.__version__)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}},
                                                             **error_responses((401,))})
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses((401,)))
    async def models():
        return ModelList(data=[_model_card(state, name) for name in state.model_names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses((401, 404)))
    async def model(model_id: str):
        if model_id not in state.model_names:
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", "model")
        return _model_card(state, model_id)


def _model_card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, root=state.served_model_name, max_model_len=state.max_model_len or None)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", responses={**streaming_response(CompletionResponse),
                                            **error_responses(GENERATION_ERRORS)})
    async def completions(body: CompletionRequest, raw_request: Request):
        return await create_completion(state.sampling_defaults.fill(body), raw_request, state)

    @app.post("/v1/chat/completions", responses={**streaming_response(ChatCompletionResponse),
                                                 **error_responses(GENERATION_ERRORS)})
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        return await create_chat_completion(state.sampling_defaults.fill(body), raw_request, state)


def _add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(GENERATION_ERRORS))
    async def tokenize(body: TokenizeRequest):
        _require_tokenizer(state)
        state.check_model(body.model)
        tokens = await _tokenize(state, body)
        return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(GENERATION_ERRORS))
    async def detokenize(body: DetokenizeRequest):
        tokenizer = _require_tokenizer(state)
        state.check_model(body.model)
        vocab_size = len(tokenizer)
        bad = next((t for t in body.tokens if t >= vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of the tokenizer's vocabulary (size {vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await state.preprocess.decode(body.tokens))

    @app.get("/tokenizer_info", responses=error_responses(READ_ERRORS))
    async def tokenizer_info():
        return _tokenizer_info(_require_tokenizer(state), state.max_model_len)


def _require_tokenizer(state: ServerState):
    state.require_engine()
    if state.tokenizer is None:
        raise bad_request("this server has no tokenizer")
    return state.tokenizer


async def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages")
    if body.prompt is not None:
        return await state.preprocess.encode(body.prompt, body.add_special_tokens)
    try:
        messages = [m.for_template() for m in body.messages]
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    return await state.preprocess.chat(messages, add_generation_prompt=body.add_generation_prompt,
                                       continue_final_message=body.continue_final_message, tools=body.tools,
                                       chat_template=body.chat_template, template_kwargs=body.chat_template_kwargs)


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
