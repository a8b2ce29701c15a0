"""The chat playground: a page at `/` and its static files under `/playground/`, shipped in the package
(openai_frontend/static/: plain HTML, CSS and JavaScript, no build step, nothing fetched from elsewhere, so it
works offline). The page calls this front's own /v1 API, so --api-key applies to it as to any client; the page
itself is public (it holds no data) and asks for the key when /v1 answers 401.

Every response of these routes carries a Content-Security-Policy that allows scripts, styles and connections
from this origin only and no inline script: a defect in how the page renders model output (which it treats as
untrusted text) could still not run injected code or send data elsewhere."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class _Static(StaticFiles):
    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def mount_playground(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "index.html", headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})

    app.mount("/playground", _Static(directory=STATIC), name="playground")
