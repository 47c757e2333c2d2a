"""The provisioning service's refusals: :class:`ProvisionError` (an HTTP status, a code,
a message, and every reason of an invalid request)."""

from __future__ import annotations

from typing import Final

from metalguard.controller.provision.storage import StorageError

CODES: Final = {
    400: "invalid",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    502: "failed",
    503: "unavailable",
    504: "timeout",
}


class ProvisionError(Exception):
    """A request the service refused or could not carry out; ``status`` is its HTTP
    status (400/403/404/409/502/503/504), ``code`` a short word, ``reasons`` every problem
    of an invalid request."""

    def __init__(
        self, status: int, message: str, code: str = "", reasons: list[str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or CODES.get(status, "error")
        self.reasons = reasons


def storage_error(exc: StorageError, what: str) -> ProvisionError:
    """A storage failure as the service's error (its status: 400/404/409/502)."""
    return ProvisionError(exc.status, f"{what}: {exc}", exc.kind)
