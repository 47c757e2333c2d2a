"""How the HTTP API answers a client's mistake: :class:`ApiError`, the middleware that turns
it (and any other failure) into JSON, and the query-parameter checks every route shares.

Every error is ``{"error": {"code": ..., "message": ...}}`` (``reasons`` added when an
ApiError lists them); an unexpected exception is logged here and answered with a bare
500, never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """A client error answered as ``{"error": {"code", "message"}}`` with ``status``;
    ``reasons`` (every reason a document is invalid) are added to the body when given."""

    def __init__(
        self, status: int, code: str, message: str, reasons: Sequence[str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.reasons = None if reasons is None else list(reasons)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ApiError and HTTP errors as JSON; anything else a logged, bare 500."""
    try:
        return await handler(request)
    except ApiError as exc:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.code, exc.message, headers, exc.reasons)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = exc.reason.lower().replace(" ", "_")
        return error_response(exc.status, code, exc.reason)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, "internal", "internal error (logged by the controller)")


def error_response(
    status: int,
    code: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    reasons: Sequence[str] | None = None,
) -> web.Response:
    """The JSON error body with ``status`` (and ``reasons`` when not None)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if reasons is not None:
        error["reasons"] = list(reasons)
    return web.json_response({"error": error}, status=status, headers=headers)


def reject_unknown_query(
    request: web.Request, allowed: Collection[str], *, name_allowed: bool = True
) -> None:
    """ApiError 400 naming the query parameters not in ``allowed`` (and, with
    ``name_allowed``, the allowed ones)."""
    unknown = sorted(set(request.query) - set(allowed))
    if unknown:
        message = f"unknown query parameter(s) {', '.join(unknown)}"
        if name_allowed:
            message += f"; allowed: {', '.join(allowed)}"
        raise ApiError(400, "bad_request", message)


def query_params(request: web.Request, allowed: Sequence[str]) -> dict[str, str]:
    """The non-empty query parameters among ``allowed``; ApiError 400 for any other."""
    reject_unknown_query(request, allowed)
    return {k: request.query[k] for k in allowed if request.query.get(k)}
