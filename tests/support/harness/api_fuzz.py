"""Fuzzing the HTTP API against its OpenAPI document with Schemathesis (for
test_api_fuzz.py): a controller app with every route (nodes, events, jobs, QoS, leader,
fleet, provisioning over the demo's simulated BMC and storage) served on a free loopback
port, and the bounded runs over its operations.

The runs make blocking HTTP calls (requests, through Schemathesis), so they run in a
worker thread while the test's event loop serves the app.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from nats.aio.client import Client
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from metalguard.controller.api.app import make_app
from metalguard.controller.api.fleet import add_fleet_routes
from metalguard.controller.api.leader import add_leader_route
from metalguard.controller.core.topology import TopologyView
from metalguard.controller.jobs.manager import JobManager
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.leader import Leadership
from metalguard.controller.qos import QosStore
from metalguard.demo.sim.provision import SimProvisioning, sim_mac
from metalguard.proto.federation import NodeLookupReply
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from tests.support.harness.api_env import ADMIN_TOKEN, FLEET, READ_TOKEN, ApiEnv, api_env

READ = {"Authorization": f"Bearer {READ_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SEED = 20260416
CALL_TIMEOUT_S = 10.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
"""Schemathesis' checks of every answer (positive_data_acceptance and
negative_data_rejection are left out: a well-formed request for an unknown node is
rightly a 404, and the handlers accept some bodies the schema is stricter about)."""
PROVISIONED = {"r1.c1.n1": sim_mac(1), "r1.c1.n2": sim_mac(2)}
"""The fleet's nodes the provisioning routes may deploy (the documented example names
r1.c1.n1 and the image "base")."""
STREAMING = {("GET", "/v1/events")}
"""Never fuzzed: a 200 is an endless SSE stream (its filters are history's, fuzzed)."""

schemathesis.serializer.alias(["application/toml"], "text/plain")


@dataclass
class NoNodes:
    """The job manager's view of placement: no nodes, so jobs stay queued."""

    records: Mapping[str, NodeRecord] = field(default_factory=dict)


class StubFleet:
    """The federation's view, of this region alone (the routes' shapes are fuzzed)."""

    region = "r1"

    def fleet(self) -> list[dict[str, Any]]:
        return [{"region": "r1", "age_s": 0.0, "stale": False, "latency_ms": 0.0, "rtt_ms": None}]

    async def lookup(self, uuid: str) -> NodeLookupReply:
        return NodeLookupReply(uuid=uuid, found=False)


@dataclass
class Served:
    """The app on a loopback port, and what the state checks read."""

    url: str
    api: ApiEnv
    jobs: JobManager
    subjects: Subjects
    nc: Client
    provision: SimProvisioning

    async def snapshot(self) -> dict[str, Any]:
        """Everything a write could change: node records, jobs, the KV buckets' and the
        control stream's last sequences."""
        js = self.nc.jetstream(timeout=5)
        buckets = ("nodes", "jobs", "qos", "provision")
        streams = [f"KV_{self.subjects.bucket(b)}" for b in buckets]
        streams.append(self.subjects.stream_control)
        seqs = {s: (await js.stream_info(s)).state.last_seq for s in streams}
        return {
            "records": msgspec.to_builtins(dict(self.api.controller.store.records)),
            "jobs": msgspec.to_builtins(dict(self.jobs.jobs)),
            "images": [i.name for i in self.provision.images.list()],
            "volumes": [v.name for v in await self.provision.storage.list_volumes()],
            "seqs": seqs,
        }


@asynccontextmanager
async def served_api(nc: Client, subjects: Subjects) -> AsyncIterator[Served]:
    """A controller of r1 (FLEET fed) with every route, on ``http://127.0.0.1:<port>``."""
    async with api_env(nc, subjects) as api:
        await api.feed(*FLEET)
        js = nc.jetstream(timeout=5)
        jobs = JobManager(
            nc,
            js,
            await JobStore.open(js, subjects),
            NoNodes(),
            subjects,
            "r1",
            fleet=TopologyView().fleet,
            clock=api.clock,
        )
        provision = await SimProvisioning.start(  # r1.c1.n1 and n2 may be deployed
            nc, js, subjects, "r1", api.controller.store, PROVISIONED, boot_delay_s=0.1
        )
        await provision.service.add_image_from_dir("base", str(Path(__file__).parent), 0)
        app = make_app(
            api.controller,
            api.source,
            read_tokens={READ_TOKEN},
            admin_tokens={ADMIN_TOKEN},
            registry=api.metrics.registry,
            qos=await QosStore.open(js, subjects),
            jobs=jobs,
            provision=provision.service,
        )
        add_leader_route(app, Leadership.always())
        add_fleet_routes(app, StubFleet())
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            host, port = runner.addresses[0][:2]
            yield Served(f"http://{host}:{port}", api, jobs, subjects, nc, provision)
        finally:
            await runner.cleanup()
            await provision.stop()


def error_body_check(case: Any, response: Any) -> None:
    """Every error is a JSON body ``{"error": {"code", "message"}}``."""
    if response.status_code < 400:
        return
    where = f"{case.method} {case.formatted_path} -> {response.status_code}"
    kinds = [v for k, v in response.headers.items() if k.lower() == "content-type"]
    kind = str(kinds[0][0] if kinds and isinstance(kinds[0], list) else kinds[0] if kinds else "")
    assert kind.startswith("application/json"), f"{where}: content type {kind!r}"
    body = response.json()
    assert isinstance(body, dict), f"{where}: {body!r}"
    assert isinstance(body.get("error"), dict), f"{where}: {body!r}"
    message = body["error"].get("message")
    assert isinstance(message, str), f"{where}: no message in {body!r}"
    assert message.strip(), f"{where}: an empty message in {body!r}"
    assert isinstance(body["error"].get("code"), str), f"{where}: no code in {body!r}"


Check = Callable[[Any, Any], None]


@dataclass
class Run:
    """One bounded fuzzing run: which operations, with which headers and checks."""

    schema: Any
    base_url: str
    headers: Mapping[str, str]
    examples: int
    modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    keep: Callable[[str, str], bool] = lambda method, path: True
    checks: tuple[Check, ...] = (error_body_check,)
    calls: int = 0
    statuses: dict[tuple[str, int], int] = field(default_factory=dict)

    def by_status(self) -> dict[int, int]:
        """How many answers of each status."""
        out: dict[int, int] = {}
        for (_, status), n in self.statuses.items():
            out[status] = out.get(status, 0) + n
        return dict(sorted(out.items()))

    def report(self) -> str:
        """One line per operation: its answers by status."""
        ops: dict[str, list[str]] = {}
        for (label, status), n in sorted(self.statuses.items()):
            ops.setdefault(label, []).append(f"{status}x{n}")
        return "\n".join(f"  {label}: {' '.join(counts)}" for label, counts in ops.items())

    def operations(self) -> list[Any]:
        out = []
        for result in self.schema.get_all_operations():
            op = result.ok()
            key = (op.method.upper(), op.path)
            if key not in STREAMING and self.keep(*key):
                out.append(op)
        return out

    def go(self, deadline: float) -> None:
        """Fuzz each kept operation in each mode, stopping before ``deadline``
        (``time.monotonic()``): AssertionError naming the case on the first failure."""
        for op in self.operations():
            for mode in self.modes:
                if time.monotonic() > deadline:
                    raise AssertionError(f"fuzzing past its time limit at {op.label}")
                self._fuzz(op, mode)

    def _fuzz(self, op: Any, mode: GenerationMode) -> None:
        @seed(SEED)
        @settings(
            max_examples=self.examples,
            derandomize=True,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def fuzz(case: Any) -> None:
            response = case.call(
                base_url=self.base_url,
                headers=dict(self.headers),
                timeout=CALL_TIMEOUT_S,
                allow_redirects=False,
            )
            self.calls += 1
            key = (op.label, response.status_code)
            self.statuses[key] = self.statuses.get(key, 0) + 1
            case.validate_response(response, checks=CHECKS)
            for check in self.checks:
                check(case, response)

        try:
            fuzz()
        except Unsatisfiable:
            if mode is not GenerationMode.NEGATIVE:
                raise  # an operation with nothing to make invalid has no negative cases


def refused_check(allowed: frozenset[int]) -> Check:
    """A write without the admin token is refused with one of ``allowed``, or matches no
    route at all (aiohttp's 404 ``Not Found``: a path the negative mode made invalid,
    such as an action not in the enum), so no handler ran."""

    def check(case: Any, response: Any) -> None:
        if response.status_code == 404 and response.json()["error"]["message"] == "Not Found":
            return
        assert response.status_code in allowed, (
            f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:200]}"
        )

    return check
