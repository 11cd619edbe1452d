"""The FastAPI app: OpenAI's routes over a `Served` engine, /health, /metrics, and errors as OpenAI error bodies
(400 naming the field for a bad request; 500 without a traceback for anything else)."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.serve.completions import Served, chat_prompt_ids, completion_prompt_ids, run
from infer.serve.metrics import registry_for
from infer.serve.protocol import ChatCompletionRequest, CompletionRequest, ServingError, error_response

log = logging.getLogger("infer.serve")


def validation_error(err: RequestValidationError) -> JSONResponse:
    """The first pydantic error as a 400 naming its field (a JSON syntax error names the body)."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return error_response(f"malformed JSON body: {first.get('msg', 'cannot parse')} "
                              f"(at character {first.get('loc', ('', '?'))[-1]})", "body", 400)
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return error_response(f"{where}: {first.get('msg', 'invalid')}", param, 400)


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="infer.serve", docs_url=None, redoc_url=None)
    registry = registry_for(served.loop, served.model_name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err)

    @app.exception_handler(ServingError)
    async def _refused(_: Request, err: ServingError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(str(err.detail), None, err.status_code)

    @app.exception_handler(Exception)
    async def _crash(_: Request, err: Exception) -> JSONResponse:
        log.exception("a request failed")
        return error_response(f"internal error: {type(err).__name__}: {' '.join(str(err).split())}", None, 500,
                              "server_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await run(served, raw, body, completion_prompt_ids(served, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        if not body.messages:
            raise ServingError("messages is empty", "messages")
        return await run(served, raw, body, [chat_prompt_ids(served, body)], chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "infer", "max_model_len": served.engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if not served.loop.alive:
            return error_response("the engine loop has stopped", None, 503, "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
