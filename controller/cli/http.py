"""What the API clients of the CLI share (``jobs``, ``qos``): the ``--api``, ``--token``
and ``--format`` options, and one JSON request with the API's errors made readable."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from metalguard.controller.cli.ops import DEFAULT_API, TIMEOUT_S, CliError


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


def send(
    args: argparse.Namespace,
    method: str,
    path: str,
    data: bytes | None = None,
    *,
    content_type: str = "application/json",
    invalid: str = "invalid request",
) -> Any:
    """One request to the API; its JSON answer. CliError (exit 2 for a 4xx answer, 1 when
    the API is unreachable or fails) with the API's message, or ``invalid`` and the
    reasons one per line when the answer lists reasons."""
    headers = {"Accept": "application/json"}
    if args.token:
        headers["Authorization"] = f"Bearer {args.token}"
    if data is not None:
        headers["Content-Type"] = content_type
    request = Request(args.api.rstrip("/") + path, data=data, headers=headers, method=method)
    try:
        with urlopen(request, timeout=TIMEOUT_S) as response:
            return json.loads(response.read())
    except HTTPError as exc:
        raise CliError(error_text(exc, invalid), 2 if exc.code < 500 else 1) from None
    except (URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CliError(f"cannot reach the API at {args.api}: {reason}", 1) from None
    except ValueError as exc:
        raise CliError(f"bad answer from {args.api}: {exc}", 1) from None


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
