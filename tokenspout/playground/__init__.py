"""The playground: one page (GET / and /playground) that shows the sampler at work, served from static files
shipped in the package (no build step).  The page is an ordinary client of the public /v1 API; see
static/playground.js for what it asks and README "Playground" for what it shows.  Behind --api-key like /v1/*:
a browser is challenged for HTTP Basic credentials (any user name, the key as password), which it then sends with
the page's own API calls."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
PAGE_PATHS = ("/", "/playground")


def is_page(path: str) -> bool:
    """The paths a browser opens (and gets a Basic challenge for, with --api-key)."""
    return path in PAGE_PATHS or path.startswith("/playground/")


def install_playground(app: FastAPI) -> None:
    app.mount("/playground/static", StaticFiles(directory=STATIC), name="playground-static")

    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    for path in PAGE_PATHS:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)
