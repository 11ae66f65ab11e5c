"""The dashboard pages' files (``static/``), shared by the server's and the router's dashboards; no heavy imports."""

from __future__ import annotations

from pathlib import Path

from fastapi.responses import Response

STATIC = Path(__file__).with_name("static")
MEDIA = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", "": "text/plain; charset=utf-8"}
EVENT_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
FRESH = 0.5  # a sample younger than this (seconds) is shared between viewers rather than taken again


def static_file(name: str) -> Response | None:
    """A file of static/ (names are looked up in the folder's listing, never joined to a path blindly)."""
    files = {p.relative_to(STATIC).as_posix(): p for p in STATIC.rglob("*") if p.is_file()}
    path = files.get(name)
    if path is None:
        return None
    return Response(path.read_bytes(), media_type=MEDIA.get(path.suffix, MEDIA[""]),
                    headers={"Cache-Control": "max-age=3600"})
