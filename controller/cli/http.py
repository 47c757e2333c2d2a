"""The CLI's one HTTP client of the controller's API (docs/api.md): the ``--api``,
``--token`` and ``--format`` options, JSON requests with the bearer token, the Server-Sent
Events stream, and the API's errors made readable.

Every failure is a :class:`~metalguard.controller.cli.console.CliError`: exit status 2
for a 4xx answer (the API's message; an invalid document's reasons one per line), 1 when
the API is unreachable (the URL named), fails (5xx) or answers something unreadable.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Collection, Iterator, Mapping
from http.client import HTTPException
from typing import IO, Any
from urllib.error import HTTPError, URLError
from urllib.parse import urlencode
from urllib.request import Request, urlopen

from metalguard.controller.cli.console import CliError

DEFAULT_API = "http://127.0.0.1:8480"
TIMEOUT_S = 10.0
FOLLOW_TIMEOUT_S = 120.0
"""A silent SSE stream (the server sends keep-alives every 15 s) is given up after this."""


def api_options(token_help: str = "bearer token (env METALGUARD_TOKEN)") -> argparse.ArgumentParser:
    """A parent parser with ``--api`` (env METALGUARD_API), ``--token`` (env
    METALGUARD_TOKEN) and ``--format table|json``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--api",
        default=os.environ.get("METALGUARD_API", DEFAULT_API),
        help=f"the controller's API (env METALGUARD_API, default {DEFAULT_API})",
    )
    common.add_argument("--token", default=os.environ.get("METALGUARD_TOKEN", ""), help=token_help)
    common.add_argument("--format", choices=("table", "json"), default="table")
    return common


class ApiClient:
    """The controller's API at ``url`` with ``token`` (none: no Authorization header).

    ``invalid`` names what a 4xx answer that lists reasons rejected ("invalid job");
    ``refusals``: 5xx statuses that are, like a 4xx, the API's answer about the request
    (exit status 2 with its message; provisioning's 502/504: a BMC that refused or did not
    answer).
    """

    def __init__(
        self,
        url: str,
        token: str = "",
        *,
        invalid: str = "invalid request",
        refusals: Collection[int] = (),
    ) -> None:
        self.url = url
        self.token = token
        self.invalid = invalid
        self.refusals = frozenset(refusals)

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        *,
        invalid: str = "invalid request",
        refusals: Collection[int] = (),
    ) -> ApiClient:
        """The client of a command's ``--api`` and ``--token`` (see :func:`api_options`)."""
        return cls(args.api, args.token, invalid=invalid, refusals=refusals)

    def get(self, path: str, query: Mapping[str, str] | None = None) -> Any:
        """``GET path?query``: the JSON answer."""
        return self.request("GET", path, query=query)

    def post(self, path: str, payload: Any) -> Any:
        """``POST path`` with ``payload`` as JSON: the JSON answer."""
        return self.request("POST", path, body=json.dumps(payload).encode())

    def put(self, path: str, body: bytes, content_type: str) -> Any:
        """``PUT path`` with ``body`` of ``content_type``: the JSON answer."""
        return self.request("PUT", path, body=body, content_type=content_type)

    def delete(self, path: str) -> Any:
        """``DELETE path``: the JSON answer."""
        return self.request("DELETE", path)

    def upload(
        self, path: str, file: IO[bytes], size: int, query: Mapping[str, str], timeout: float
    ) -> Any:
        """``POST path?query`` with the ``size`` bytes of ``file`` as
        ``application/octet-stream`` (streamed, not read into memory): the JSON answer."""
        request = self._build("POST", path, query, None, "", "application/json")
        request.data = file
        request.add_header("Content-Type", "application/octet-stream")
        request.add_header("Content-Length", str(size))
        with self._open(request, timeout) as response:
            try:
                return json.loads(response.read())
            except (ValueError, OSError, HTTPException) as exc:
                raise CliError(f"bad answer from {self.url}: {exc}", 1) from None

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: bytes | None = None,
        content_type: str = "application/json",
        timeout: float = TIMEOUT_S,
    ) -> Any:
        """One request; its JSON answer (CliError as the module says); ``timeout``: the
        most seconds the server may stay silent."""
        request = self._build(method, path, query, body, content_type, "application/json")
        with self._open(request, timeout) as response:
            try:
                return json.loads(response.read())
            except (ValueError, OSError, HTTPException) as exc:
                raise CliError(f"bad answer from {self.url}: {exc}", 1) from None

    def events(self, path: str, query: Mapping[str, str]) -> Iterator[tuple[str, str]]:
        """(event type, data) for each Server-Sent Event of ``GET path?query``."""
        request = self._build("GET", path, query, None, "", "text/event-stream")
        with self._open(request, FOLLOW_TIMEOUT_S) as response:
            kind, data = "message", list[str]()
            for raw in self._lines(response):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if not line:
                    if data:
                        yield kind, "\n".join(data)
                    kind, data = "message", []
                elif line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))

    def _build(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        body: bytes | None,
        content_type: str,
        accept: str,
    ) -> Request:
        url = self.url.rstrip("/") + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": accept}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            return Request(url, data=body, headers=headers, method=method)
        except ValueError as exc:  # not a URL urllib can open
            raise CliError(f"cannot reach the API at {self.url}: {exc}", 1) from None

    def _open(self, request: Request, timeout: float) -> IO[bytes]:
        try:
            response: IO[bytes] = urlopen(request, timeout=timeout)
        except HTTPError as exc:
            code = 2 if exc.code < 500 or exc.code in self.refusals else 1
            raise CliError(error_text(exc, self.invalid), code) from None
        except (URLError, OSError, ValueError, HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"cannot reach the API at {self.url}: {reason}", 1) from None
        return response

    def _lines(self, response: IO[bytes]) -> Iterator[bytes]:
        try:
            yield from response
        except OSError as exc:
            raise CliError(f"the event stream from {self.url} failed: {exc}", 1) from None


def error_text(exc: HTTPError, invalid: str) -> str:
    """The API's error message, or ``invalid`` and its reasons one per line."""
    try:
        error = json.loads(exc.read())["error"]
        text = f"{error['message']} (HTTP {exc.code} {error['code']})"
    except (ValueError, KeyError, TypeError, OSError):
        return f"HTTP {exc.code} {exc.reason}"
    reasons = error.get("reasons") or []
    if reasons:
        lines = "".join(f"\n  - {r}" for r in reasons)
        return f"{invalid} (HTTP {exc.code} {error['code']}):{lines}"
    return text
