"""Who may call the HTTP API: bearer tokens, read-only and admin (docs/security.md).

Every handler starts with :func:`check_read` or :func:`check_admin`.  No token at all
configured (or ``open_reads``): reads are open.  No admin token: every action is refused
(403).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Collection
from typing import Final

from aiohttp import web

from metalguard.controller.api.errors import ApiError

log = logging.getLogger(__name__)


class Tokens:
    """Bearer tokens: read-only and admin.

    No token at all, or ``open_reads``: reads are open.  No admin token: every action is
    refused (403).
    """

    def __init__(
        self, read: Collection[str], admin: Collection[str], *, open_reads: bool = False
    ) -> None:
        self._read = tuple(t.encode() for t in read)
        self._admin = tuple(t.encode() for t in admin)
        self._open_reads = open_reads
        """Reads need no token even with tokens set (the demo: its dashboard reads, its
        actions need the admin token it prints)."""

    def check(self, request: web.Request, admin: bool) -> None:
        """Raise ApiError 401/403 unless the request may proceed; a refused write is
        logged (method, path, peer, why)."""
        try:
            self._check(request, admin)
        except ApiError as exc:
            if admin:
                log.warning(
                    "refused %s %s from %s: %d %s",
                    request.method,
                    request.path,
                    request.remote or "?",
                    exc.status,
                    exc.message,
                )
            raise

    def _check(self, request: web.Request, admin: bool) -> None:
        if not admin and (self._open_reads or not (self._read or self._admin)):
            return
        if admin and not self._admin:
            raise ApiError(403, "forbidden", "actions are disabled: no admin token is configured")
        given = bearer_token(request)
        if given is None:
            raise ApiError(401, "unauthorized", "a bearer token is required")
        if _member(given, self._admin):
            return
        if _member(given, self._read):
            if admin:
                raise ApiError(403, "forbidden", "this action needs an admin token")
            return
        raise ApiError(401, "unauthorized", "the bearer token is not valid")


TOKENS: Final = web.AppKey("tokens", Tokens)


def check_read(request: web.Request) -> None:
    """ApiError 401 unless the request may read (a read or admin token, or none needed)."""
    request.app[TOKENS].check(request, admin=False)


def check_admin(request: web.Request) -> None:
    """ApiError 401/403 unless the request carries an admin token (refusals are logged)."""
    request.app[TOKENS].check(request, admin=True)


def bearer_token(request: web.Request) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, if any."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()


def _member(token: bytes, tokens: tuple[bytes, ...]) -> bool:
    found = False
    for t in tokens:  # no early exit: the time taken does not tell which one matched
        found |= hmac.compare_digest(token, t)
    return found
