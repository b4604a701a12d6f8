"""The web playground: a chat page that `foveal serve` serves at "/", on the same
origin as the API. Plain HTML, CSS and JavaScript modules in static/, shipped
with the package (no build step, nothing fetched from elsewhere at run time):
streamed multi-turn chat with image, video, PDF and audio attachments, each
media item's visual-token plan and each turn's prefix- and encoder-cache hits
(from the response's `usage`), sampling and budget controls, live
TTFT and tokens/s, and a panel of the server's gauges.

The page and its files hold no secrets, so they are reachable without the API
key (`open_routes`); the page sends the key its user enters as a Bearer token.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

from foveal.entrypoints.openai.security import OpenRoutes

STATIC_DIR = Path(__file__).parent / "static"
ASSETS_PATH = "/playground"


def open_routes(routes: OpenRoutes) -> OpenRoutes:
    """`routes` and what the playground serves: GET of the page and of its files."""
    return dataclasses.replace(routes, get_paths=routes.get_paths | {"/"},
                               get_prefixes=(*routes.get_prefixes, f"{ASSETS_PATH}/"))


def mount_playground(app: FastAPI) -> None:
    """The page at "/" and its files under /playground/."""

    @app.get("/", include_in_schema=False)
    async def playground_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount(ASSETS_PATH, StaticFiles(directory=STATIC_DIR), name="playground")
