"""The OpenAI-compatible HTTP server: `build_app(engine, config)` wires the
routes onto an engine with AsyncLLM's interface and a `StagePools` (PDF, OCR,
ASR workers, started on first use); `serve(engine, config, host, port)` runs it
under uvicorn."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import foveal
from foveal.entrypoints.openai.errors import error_response, install_error_handlers
from foveal.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from foveal.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                ModelCard, ModelList)
from foveal.entrypoints.openai.playground import mount_playground, open_routes
from foveal.entrypoints.openai.security import OPEN_ROUTES, install_security
from foveal.entrypoints.openai.serving_chat import OpenAIServingChat
from foveal.entrypoints.openai.serving_completion import OpenAIServingCompletion
from foveal.entrypoints.openai.serving_engine import ServerConfig
from foveal.multimodal.media.fetch import MediaFetcher
from foveal.stages.service import StagePools


def build_app(engine, config: ServerConfig, *, owns_engine: bool = False,
              stage_pools: StagePools | None = None, services: tuple = ()) -> FastAPI:
    """owns_engine: shut the engine down with the app (several apps may share one).
    stage_pools: stages to use (the caller closes them); default: the app's own,
    built from config.stages and closed with the app. Pass the AsyncLLM's
    `stage_pools` so that input_audio parts and videos' audio tracks share one
    speech-to-text pool and cache. services: objects with async start() and
    stop(), run with the app (e.g. joining a router's pool)."""
    fetcher = MediaFetcher(config.media)
    stages = stage_pools or StagePools(config.stages)
    metrics = ServerMetrics(stages)
    chat = OpenAIServingChat(engine, config, metrics, fetcher, stages)
    completion = OpenAIServingCompletion(engine, config, metrics, fetcher)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        for service in services:
            await service.start()
        yield
        for service in services:
            await service.stop()
        await fetcher.aclose()
        if stage_pools is None:
            await asyncio.to_thread(stages.close)
        if owns_engine:
            engine.shutdown()

    app = FastAPI(title="Foveal OpenAI-compatible server", version=foveal.__version__,
                  lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    install_error_handlers(app)
    if config.playground:
        mount_playground(app)
    install_security(app, config.security,
                     open_routes(OPEN_ROUTES) if config.playground else OPEN_ROUTES)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.handle(request, raw_request)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.handle(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        max_model_len = engine.engine_config.scheduler.max_model_len
        cards = [ModelCard(id=name, root=config.model_path, max_model_len=max_model_len)
                 for name in config.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    _add_service_routes(app, engine, metrics)
    return app


def _add_service_routes(app: FastAPI, engine, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health() -> Response:
        if await engine.check_health():
            return Response(status_code=200)
        return error_response("the engine is not running", HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(engine), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": foveal.__version__})


def serve(engine, config: ServerConfig, host: str, port: int, services: tuple = ()) -> int:
    """Blocks until interrupted, or until the engine has failed for good (its core
    died or hung and was not restarted): then it stops and returns exit code 1
    (as when the server could not start).
    The engine stops in the app's shutdown: uvicorn re-raises SIGINT/SIGTERM once
    it has stopped, so code after run() never runs then."""
    import uvicorn

    app = build_app(engine, config, owns_engine=True, stage_pools=engine.stage_pools,
                    services=services)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_keep_alive=5, timeout_graceful_shutdown=5))
    failures = []

    def stop_serving(error) -> None:
        failures.append(error)
        server.should_exit = True  # uvicorn's main loop polls it, as its signal handler sets it

    engine.when_failed(stop_serving)
    server.run()
    return 1 if failures or not server.started else 0
