"""The HTTP API fuzzed against its own OpenAPI document (GET /v1/openapi.json) with
Schemathesis, on a real controller over the session nats-server (tests/integration/
api_fuzz.py): no 5xx, every answer as the document says (status, content type, body
schema), every error a JSON body with a message, writes without the admin token refused
(401/403) and leaving the node records, jobs, QoS profiles and events as they were.

Bounded: a fixed number of examples per operation and mode, a fixed seed, derandomized,
no shrinking, and a time limit on the whole.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import schemathesis
from nats.aio.client import Client

from metalguard.proto.subjects import Subjects
from tests.support.harness.api_fuzz import (
    ADMIN,
    READ,
    Run,
    Served,
    error_body_check,
    refused_check,
    served_api,
)

TIME_LIMIT_S = 150.0
WRITES = frozenset({"POST", "PUT", "DELETE"})
REFUSED = frozenset({401, 403})

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIME_LIMIT_S + 60)]


async def fetch_schema(served: Served) -> object:
    """The document as the app serves it, loaded by Schemathesis (which validates it)."""
    url = f"{served.url}/v1/openapi.json"
    return await asyncio.to_thread(schemathesis.openapi.from_url, url)


async def run_all(*runs: Run, deadline: float) -> None:
    for run in runs:
        await asyncio.to_thread(run.go, deadline)
        print(f"{run.calls} calls, statuses {run.by_status()}\n{run.report()}")


async def test_refused_writes_change_nothing_then_admin_fuzz(
    nc: Client, subjects: Subjects
) -> None:
    deadline = time.monotonic() + TIME_LIMIT_S
    async with served_api(nc, subjects) as served:
        schema = await fetch_schema(served)

        def writes(method: str, path: str) -> bool:
            return method in WRITES

        refused = (error_body_check, refused_check(REFUSED))
        as_reader = Run(schema, served.url, READ, 10, keep=writes, checks=refused)
        anonymous = Run(schema, served.url, {}, 10, keep=writes, checks=refused)
        before = await served.snapshot()
        await run_all(as_reader, anonymous, deadline=deadline)
        assert await served.snapshot() == before, "a refused write changed the state"
        assert as_reader.by_status().get(403), "the read token's writes were refused as such"

        await run_all(Run(schema, served.url, ADMIN, 20), deadline=deadline)
