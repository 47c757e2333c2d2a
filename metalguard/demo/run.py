"""``metalguard demo``: the one command a newcomer runs.

An embedded nats-server with the design's streams (one set for every region), a region
controller per region (ingest, scoring, lifecycle, jobs, federation), one HTTP API over
every region's nodes (:class:`AllRegions`, docs/demo.md), a QoS profile stored for every
cluster, and a simulated fleet of real agents over generated sysfs trees (demo/sim)
playing a scenario of hardware faults and jobs.  Runs until Ctrl-C / SIGINT / SIGTERM or
``--duration``; ``--report FILE`` writes what happened as JSON, with ``ok`` when every
fault got its expected grade and every job its expected digest (:mod:`.report`).  Like
metalguard.cli this module is a composition root: it wires the simulated agents to the
controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from metalguard.agent.config import parse_config
from metalguard.controller.api.app import make_app
from metalguard.controller.api.fleet import add_fleet_routes
from metalguard.controller.api.sse import (
    NEW_ONLY,
    Deliver,
    NatsEventSource,
    StartAt,
    Unsubscribe,
    consumer_config,
)
from metalguard.controller.broker.server import NatsServer
from metalguard.controller.core.congestion import CongestionView
from metalguard.controller.core.lifecycle import OperatorAction
from metalguard.controller.core.lifecycle_model import LifecycleConfig
from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.controller.federation.service import Federation
from metalguard.controller.federation.view import busy_nodes, job_counts
from metalguard.controller.jobs.manager import JobManager, JobSettings
from metalguard.controller.jobs.spec import JobRejectedError
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.jobs.tenant_store import TenantStore
from metalguard.controller.qos import QosStore
from metalguard.controller.region import RegionController
from metalguard.controller.remediation import Remediation
from metalguard.controller.service import start_ingest
from metalguard.controller.state.store import NodeStore
from metalguard.controller.state.streams import ensure_streams
from metalguard.demo.provisioning import demo_handles, play_provision, start_provisioning
from metalguard.demo.report import (
    fault_pending,
    instance_rows,
    job_rows,
    report_ok,
    worst_grade_since,
)
from metalguard.demo.sim.faults import STRAGGLER_FILE, Applied, FaultError
from metalguard.demo.sim.fleet import SimFleet, SimNode, fleet_names
from metalguard.demo.sim.provision import SimProvisioning
from metalguard.demo.sim.scenario import (
    Scenario,
    ScenarioJob,
    due_faults,
    due_jobs,
    instances_off,
    load_scenario,
    unknown_nodes,
)
from metalguard.demo.stopping import Stopper
from metalguard.proto.addresses import parse_listen
from metalguard.proto.codec import CodecError, decode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.qos import decode_profile
from metalguard.proto.subjects import Subjects
from metalguard.runtime.deadlines import wait_event, within

DEFAULT_REGIONS = 2
FEDERATION_INTERVAL_S = 1.0
DEFAULT_SCENARIO = Path("scenarios/default.toml")
"""Used when it exists under the working directory; else the copy the package ships."""
DATA = Path(__file__).resolve().parent / "data"
"""What the package ships for the demo (scenarios/default.toml, examples/trainer.py and
examples/qos-profile.toml, as package data)."""
SHIPPED = {
    "scenarios/default.toml": DATA / "default-scenario.toml",
    "examples/trainer.py": DATA / "trainer.py",
    "examples/qos-profile.toml": DATA / "qos-profile.toml",
}
AGENTS_UP_DEADLINE_S = 90.0
DEMO_JOBS = JobSettings(
    tick_s=0.5, checkpoint_deadline_s=10.0, stop_grace_s=5.0, master_addr="127.0.0.1"
)
"""Every simulated node runs its members on this machine."""


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``metalguard demo`` was asked for."""

    duration_s: float | None = None
    prefix: str = "mg"
    regions: int | None = None
    """``None``: 2, or with an explicit ``scenario`` the highest region it names."""
    clusters: int = 1
    racks: int = 4
    nodes_per_rack: int = 8
    interval_s: float = 1.0
    scenario: Path | None = None
    report: Path | None = None
    headless: bool = False
    http: str = "127.0.0.1:8480"


@dataclass
class _Journal:
    """What happened, in seconds since the start, for the report."""

    started: float = field(default_factory=time.monotonic)
    faults: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    submitted: int = 0
    """Jobs the job managers accepted."""
    provision: list[dict[str, Any]] = field(default_factory=list)
    """The ``[[provision]]`` steps taken (docs/provisioning.md)."""

    def t(self) -> float:
        return round(time.monotonic() - self.started, 3)

    async def on_event(self, msg: Msg) -> None:
        try:
            event = decode(msg.data, ControllerEvent)
        except CodecError:
            return
        self.events.append(
            {
                "t": self.t(),
                "id": event.event_id,
                "kind": event.kind,
                "node": event.node.node if event.node else None,
                "reasons": msgspec.to_builtins(event.reasons),
            }
        )
        who = event.node.node if event.node else event.region
        why = event.reasons[0].message if event.reasons else event.message
        _say(f"[{self.t():6.1f}s] {event.kind} {who}: {why}")


def _fast_tmp() -> str | None:
    """tmpfs for the simulated trees when there is one (many small writes a second)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _say(line: str) -> None:
    print(f"metalguard demo: {line}", flush=True)


def _scenario(options: DemoOptions) -> Scenario | None:
    path = options.scenario
    if path is None:
        shipped = SHIPPED[DEFAULT_SCENARIO.as_posix()]
        found = [p for p in (DEFAULT_SCENARIO, shipped) if p.is_file()]
        if not found:
            _say("no scenario (scenarios/default.toml not found): a healthy fleet")
            return None
        path = found[0]
    scenario = load_scenario(path)
    _say(f"scenario {path}: {scenario.description or f'{len(scenario.fault)} faults'}")
    return scenario


def region_count(options: DemoOptions, scenario: Scenario | None) -> int:
    """How many regions to run: ``--regions``, else the highest region an explicit
    ``--scenario`` names (at least 1), else :data:`DEFAULT_REGIONS`."""
    if options.regions is not None:
        return options.regions
    if options.scenario is None or scenario is None:
        return DEFAULT_REGIONS
    named = [f.node for f in scenario.fault] + [j.region for j in scenario.job if j.region]
    numbers = [int(m.group(1)) for n in named if (m := _REGION_RE.match(n))]
    return max([1, *numbers])


_REGION_RE = re.compile(r"r(\d+)")


def expected_digest(entry: ScenarioJob) -> str | None:
    """The ``digest=`` an uninterrupted run of ``entry`` prints, when it runs
    examples/trainer.py with ``--steps N`` (its pure ``digest_after``); else None."""
    args = list(entry.args)
    if not args or Path(args[0]).name != "trainer.py" or "--steps" not in args:
        return None
    try:
        steps = int(args[args.index("--steps") + 1])
    except (IndexError, ValueError):
        return None
    path = Path(args[0]) if Path(args[0]).is_file() else TRAINER
    spec = importlib.util.spec_from_file_location("_mg_demo_trainer", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return str(module.digest_after(steps))


TRAINER = SHIPPED["examples/trainer.py"]


class DemoFleet:
    """One simulated fleet per region (``r{region}c{cluster}k{rack}n{node}``)."""

    def __init__(self, fleets: list[SimFleet]) -> None:
        self.fleets = fleets
        self._of = {name: f for f in fleets for name in f.node_names}
        self.interval_s = fleets[0].interval_s

    @property
    def node_names(self) -> list[str]:
        return list(self._of)

    async def start(self) -> None:
        for fleet in self.fleets:
            await fleet.start()

    async def stop(self) -> None:
        await asyncio.gather(*(f.stop() for f in self.fleets), return_exceptions=True)

    def apply(
        self,
        kind: str,
        node: str,
        *,
        count: int | None = None,
        duration_s: float | None = None,
        line: str = "",
        slowdown: float | None = None,
    ) -> Applied:
        return self._of[node].apply(
            kind, node, count=count, duration_s=duration_s, line=line, slowdown=slowdown
        )

    def tick(self) -> None:
        for fleet in self.fleets:
            fleet.tick()


@dataclass
class DemoRegion:
    """One region's controller and what runs beside it."""

    name: str
    controller: RegionController
    jobs: JobManager
    federation: Federation
    registry: Any
    """Ingest's metrics registry (the API's ``/metrics``)."""
    remediation: Remediation | None = None
    """GPU resets of drained nodes, power cycles (docs/decisions.md, "GPU")."""
    provision: SimProvisioning | None = None
    """The first region's provisioning over simulated hardware (docs/provisioning.md)."""


class AllRegions:
    """The API's view over every region's controller (demo only: one HTTP API, one
    heatmap for the whole fleet).  Handles are ``region.cluster.node``, so the regions'
    records never collide; actions and lookups go to the node's own region."""

    def __init__(self, regions: dict[str, RegionController]) -> None:
        self._regions = regions

    @property
    def store(self) -> AllRegions:
        return self

    @property
    def records(self) -> dict[str, NodeRecord]:
        return {h: r for c in self._regions.values() for h, r in c.store.records.items()}

    def _of(self, handle: str) -> RegionController:
        region = self._regions.get(handle.split(".", 1)[0])
        if region is None:
            raise KeyError(handle)
        return region

    async def operator_action(
        self, handle: str, action: OperatorAction, reason: str, who: str
    ) -> tuple[ControllerEvent, ...]:
        return await self._of(handle).operator_action(handle, action, reason, who)

    def recent_signals(self, handle: str) -> NodeSignals | None:
        return self._of(handle).recent_signals(handle)

    def recent_readings(self, handle: str) -> dict[str, Any]:
        return self._of(handle).recent_readings(handle)

    def warm_datasets(self, handle: str) -> frozenset[str]:
        return self._of(handle).warm_datasets(handle)

    def congestion_view(self) -> CongestionView:
        views = [c.congestion_view() for _, c in sorted(self._regions.items())]
        clusters = tuple(cluster for v in views for cluster in v.clusters)
        ts = max((v.ts for v in views), default=0.0)
        stale = max((v.stale_after_s for v in views), default=0.0)
        return CongestionView(ts, stale, clusters)


class AllRegionEvents(NatsEventSource):
    """Every demo region's ControllerEvents (the one ``<P>_CONTROL`` stream holds them)."""

    def __init__(self, nc: Client, subjects: Subjects, regions: list[str]) -> None:
        super().__init__(nc, subjects, regions[0])
        self._nc = nc
        self._regions = frozenset(regions)

    async def subscribe(self, deliver: Deliver, start: StartAt = NEW_ONLY) -> Unsubscribe:
        async def on_msg(msg: Msg) -> None:
            try:
                event = decode(msg.data, ControllerEvent)
            except CodecError:
                return
            if event.region in self._regions:
                deliver(event, msg.metadata.sequence.stream)

        sub = await self._nc.jetstream().subscribe(
            self._subjects.all_of("ctl"),
            stream=self._subjects.stream_control,
            cb=on_msg,
            ordered_consumer=True,
            config=consumer_config(start),
        )
        return sub.unsubscribe

    async def history(
        self, start: StartAt, limit: int
    ) -> tuple[list[tuple[ControllerEvent, int]], bool]:
        out: list[tuple[ControllerEvent, int]] = []
        cut: list[int] = []
        for region in sorted(self._regions):
            source = NatsEventSource(self._nc, self._subjects, region)
            events, left = await source.history(start, limit)
            out += events
            if left and events:
                cut.append(events[-1][1])  # that region's events after this are unread
        if cut:
            out = [e for e in out if e[1] <= min(cut)]
        out.sort(key=lambda item: item[1])
        return out[:limit], bool(cut) or len(out) > limit


async def _play(fleet: DemoFleet, scenario: Scenario | None, journal: _Journal) -> None:
    """Apply the scenario's faults when due and advance stateful ones, every tick."""
    applied: set[int] = set()
    while True:
        if scenario is not None:
            for index, fault in due_faults(scenario, journal.t(), applied):
                applied.add(index)
                try:
                    result = fleet.apply(
                        fault.kind,
                        fault.node,
                        count=fault.count,
                        duration_s=fault.duration_s,
                        slowdown=fault.slowdown,
                        line=fault.line,
                    )
                except FaultError as exc:  # the node lacks the device (a RoCE port, ...)
                    _say(f"[{journal.t():6.1f}s] fault {fault.kind} on {fault.node} skipped: {exc}")
                    continue
                journal.faults.append(
                    {
                        "t": journal.t(),
                        "node": fault.node,
                        "kind": fault.kind,
                        "expected": fault.expect,
                        "ts": time.time(),
                    }
                )
                _say(f"[{journal.t():6.1f}s] fault {fault.kind} on {fault.node}: {result.detail}")
        fleet.tick()
        await asyncio.sleep(fleet.interval_s)


async def _serve_api(app: web.Application, listen: str) -> tuple[web.AppRunner, str]:
    where = parse_listen(listen)
    host, port = where.host, where.port or 0
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await web.TCPSite(runner, host, 0).start()  # the port is taken: any free one
    server = runner.addresses[0]
    return runner, f"http://{server[0]}:{server[1]}"


def _fault_rows(view: AllRegions, journal: _Journal) -> list[dict[str, Any]]:
    """The report's faults: each with ``got``, the worst grade its node took since."""
    records = {r.node.node: r for r in view.records.values()}
    end_t = journal.t()
    rows = []
    for fault in journal.faults:
        got = worst_grade_since(records.get(fault["node"]), fault["ts"])
        row = {k: v for k, v in fault.items() if k != "ts"}
        pending = fault_pending(fault["expected"], got, fault["t"], end_t)
        rows.append(row | {"got": got, "pending": pending})
    return rows


def _report(
    path: Path,
    view: AllRegions,
    journal: _Journal,
    regions: list[DemoRegion],
    scenario: Scenario | None,
    stop: dict[str, Any] | None = None,
) -> None:
    nodes = [
        {
            "node": r.node.node,
            "region": r.node.region,
            "grade": r.grade,
            "score": r.score,
            "reasons": msgspec.to_builtins(r.reasons),
        }
        for r in sorted(view.records.values(), key=lambda r: r.node.node)
    ]
    jobs = scenario.job if scenario is not None else ()
    expected = {j.name: expected_digest(j) for j in jobs}
    doc: dict[str, Any] = {
        "regions": [r.name for r in regions],
        "nodes": nodes,
        "faults": _fault_rows(view, journal),
        "events": journal.events,
        "jobs": [r for g in regions for r in job_rows(g.jobs.jobs.values())],  # docs/jobs.md
        "jobs_submitted": journal.submitted,
        "expected_digests": expected,
        "instances": _instance_rows(regions, journal, scenario),  # docs/provisioning.md
        "provision_steps": journal.provision,
        **(stop or {}),
    }
    doc["ok"] = report_ok(doc)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    _say(f"report written to {path} (ok: {str(doc['ok']).lower()})")


def _instance_rows(
    regions: list[DemoRegion], journal: _Journal, scenario: Scenario | None
) -> list[dict[str, Any]]:
    """The report's ``instances``: the provisioned ones with the state the scenario's
    ``[[provision]]`` steps due by the end expect (the last step that says)."""
    expected: dict[str, str | None] = {}
    end_t = journal.t()
    for step in scenario.provision if scenario is not None else ():
        if step.at > end_t:
            continue  # not due yet when the run ended: not judged
        if step.expect is not None or step.instance not in expected:
            expected[step.instance] = step.expect
    last = {s["instance"]: s["t"] for s in journal.provision}
    instances = [
        i
        for r in regions
        if r.provision is not None
        for i in list(r.provision.service.store.instances.values())
    ]
    return instance_rows(instances, expected, last, end_t)


async def _start_region(
    nc: Client,
    js: JetStreamContext,
    subjects: Subjects,
    name: str,
    cleanup: list[Any],
    lifecycle: LifecycleConfig | None = None,
) -> DemoRegion:
    """A region's controller, ingest (its own region's subjects), job manager and
    federation (summaries every :data:`FEDERATION_INTERVAL_S`)."""
    store = await NodeStore.open(js, subjects)
    controller = RegionController(js, store, subjects, name, lifecycle)
    await controller.start(silence_interval_s=1.0)
    cleanup.append(controller.stop)
    ingest = start_ingest(js, subjects, name, controller)
    await ingest.start()
    cleanup.append(ingest.stop)
    jobs = JobManager(  # runs the scenario's [[job]] entries (docs/jobs.md)
        nc,
        js,
        await JobStore.open(js, subjects),
        controller.store,
        subjects,
        name,
        DEMO_JOBS,
        fleet=controller.topology.fleet,
        report_running=controller.report_running,
        report_suspects=controller.report_suspects,
        report_stragglers=controller.report_stragglers,
        tenants=await TenantStore.open(js, subjects),  # `metalguard tenants set` works here
    )
    federation = Federation(
        nc,
        subjects,
        name,
        lambda: controller.store.records,
        lambda: controller.topology.fleet(controller.store.records),
        interval_s=FEDERATION_INTERVAL_S,
        controller=f"demo-{name}",
        jobs=lambda: job_counts(jobs.jobs),
        busy=lambda: busy_nodes(jobs.jobs),
    )
    await federation.start()
    cleanup.append(federation.stop)
    remediation = Remediation(nc, js, controller.store, subjects, name, tick_s=1.0, timeout_s=60)
    return DemoRegion(
        name, controller, jobs, federation, ingest.metrics.registry, remediation=remediation
    )


async def run_demo(options: DemoOptions) -> int:
    """Run the demo until a stop signal or the duration; return the exit status.

    Meant for the ``metalguard demo`` process: it takes SIGINT and SIGTERM, and once the
    stop was due its watchdog ends the process if it has not exited within
    :data:`metalguard.demo.stopping.EXIT_AFTER_S` (docs/demo.md "Stopping")."""
    scenario = _scenario(options)
    names = [f"r{i}" for i in range(1, region_count(options, scenario) + 1)]
    subjects = Subjects(options.prefix)
    loop = asyncio.get_running_loop()
    journal = _Journal()
    server = NatsServer()
    tmp = tempfile.TemporaryDirectory(prefix="mg-demo-", dir=_fast_tmp())
    cleanup: list[Any] = []
    outcome = _Outcome(options.report, journal, scenario)
    stopper = Stopper(
        loop,
        force_report=lambda: outcome.write(stopper, forced=True),
        emergency=lambda: _emergency(server, Path(tmp.name)),
    )
    stopper.install()  # from here on, SIGINT / SIGTERM end the run with a report
    stop = stopper.requested
    try:
        _say("starting nats-server (JetStream)")
        url = await asyncio.to_thread(server.start)
        nc = await within(nats.connect(url, max_reconnect_attempts=1), 10)
        cleanup.append(nc.close)
        js = nc.jetstream()
        await ensure_streams(js, subjects)
        _say(
            f"NATS at {url} (streams {subjects.stream_telemetry}, {subjects.stream_events}, "
            f"{subjects.stream_control} and KV buckets ready; they carry every region)"
        )
        sub = await nc.subscribe(subjects.all_of("ctl"), cb=journal.on_event)
        cleanup.append(sub.unsubscribe)

        regions: list[DemoRegion] = []
        lifecycle = None
        if scenario is not None and scenario.rail_max_fraction is not None:
            lifecycle = LifecycleConfig(rail_max_fraction=scenario.rail_max_fraction)
            share = f"{scenario.rail_max_fraction:.0%}"
            _say(f"safety rail: {share} of a cluster an hour (the scenario's)")
        for name in names:
            _say(f"starting the controller of region {name} (ingest, jobs, federation)")
            regions.append(await _start_region(nc, js, subjects, name, cleanup, lifecycle))
        view = AllRegions({r.name: r.controller for r in regions})
        outcome.view, outcome.regions = view, regions
        first = regions[0]
        handles = demo_handles(
            first.name,
            fleet_names(1, options.clusters, options.racks, options.nodes_per_rack),
        )
        first.provision = await start_provisioning(
            nc, js, subjects, first.name, first.controller.store, handles, DATA
        )
        cleanup.append(first.provision.stop)
        _say(
            f"provisioning in region {first.name}: {len(handles)} simulated nodes may be "
            f"network-booted (image {first.provision.images.list()[0].name}; boot server "
            f"{first.provision.boot_url})"
        )
        qos = await QosStore.open(js, subjects)
        token = secrets.token_urlsafe(24)  # this run's admin token (printed once it runs)
        app = make_app(
            view,
            AllRegionEvents(nc, subjects, names),
            admin_tokens=(token,),
            open_reads=True,  # the dashboard and `metalguard nodes` read without it
            registry=first.registry,
            qos=qos,
            jobs=first.jobs,
            provision=first.provision.service,
            tenants=first.jobs,
        )
        add_fleet_routes(app, first.federation)
        runner, api_url = await _serve_api(app, options.http)
        cleanup.append(runner.cleanup)
        _say(
            f"controllers for {', '.join(names)} ready; API at {api_url} "
            f"(region {first.name}'s, with every region's nodes)"
        )
        await _push_qos(qos, options.clusters)

        fleet = DemoFleet(
            [
                WorkloadFleet(
                    Path(tmp.name) / f"r{i}",
                    url,
                    region=i,
                    clusters=options.clusters,
                    racks=options.racks,
                    nodes_per_rack=options.nodes_per_rack,
                    interval_s=options.interval_s,
                    prefix=subjects.prefix,
                )
                for i in range(1, len(names) + 1)
            ]
        )
        if scenario is not None and (missing := unknown_nodes(scenario, fleet.node_names)):
            _say(f"scenario names nodes not in this fleet, skipped: {', '.join(missing)}")
            scenario = msgspec.structs.replace(
                scenario, fault=tuple(f for f in scenario.fault if f.node not in missing)
            )
            outcome.scenario = scenario
        if scenario is not None and (off := instances_off(scenario, handles)):
            _say(
                f"scenario provisions on nodes not in region {first.name}'s fleet, skipped: "
                f"{', '.join(off)}"
            )
            scenario = msgspec.structs.replace(
                scenario, provision=tuple(p for p in scenario.provision if p.instance not in off)
            )
            outcome.scenario = scenario
        _say(
            f"starting {len(fleet.node_names)} agents ({len(names)} region(s) x "
            f"{options.clusters} cluster(s) x {options.racks} racks x "
            f"{options.nodes_per_rack} nodes)"
        )
        _say(QOS_NOTE)
        await fleet.start()
        cleanup.append(fleet.stop)
        per_region = {f"r{f.region}": len(f.node_names) for f in fleet.fleets}
        await _wait_agents(regions, per_region, stop)
        if not stop.is_set():
            for region in regions:
                await region.jobs.start()
                cleanup.append(region.jobs.stop)
                if region.remediation is not None:
                    await region.remediation.start()
                    cleanup.append(region.remediation.stop)
            _say(f"try: curl {api_url}/v1/fleet   or   metalguard nodes --api {api_url}")
            _say(f"dashboard: {api_url}/ui/")
            _say(
                f"actions (jobs submit, cordon, provision) need this run's admin "
                f"token: export METALGUARD_TOKEN={token}"
            )
            _say("running; press Ctrl-C to stop")
            journal.started = time.monotonic()
            duration = options.duration_s
            if duration is None and options.headless:
                duration = 120.0
            stopper.arm(duration)  # a loop timer, backed by the watchdog thread
            player = asyncio.create_task(_play(fleet, scenario, journal), name="scenario")
            cleanup.append(lambda: _cancel(player))
            if scenario is not None and scenario.provision:
                provisioner = asyncio.create_task(
                    play_provision(
                        first.provision,
                        scenario,
                        handles,
                        journal.t,
                        _say,
                        journal.provision,
                    ),
                    name="provision-steps",
                )
                cleanup.append(lambda: _cancel(provisioner))
            if scenario is not None and scenario.job:
                ckpt = Path(tmp.name) / "checkpoints"
                by_region = {r.name: r.jobs for r in regions}
                submitter = asyncio.create_task(
                    _submit_jobs(by_region, names[0], scenario, journal, ckpt)
                )
                cleanup.append(lambda: _cancel(submitter))
        await stop.wait()
        stopper.stopping()
        by = "a signal" if stopper.signals else "the duration"
        _say(f"stopping ({by}; {stopper.lag_s or 0.0:.2f} s after it was due)")
        outcome.write(stopper)
        stopper.reported()
    finally:
        await _clean_up(cleanup, server, CLEANUP_S)
        stopper.finished()
        stopper.uninstall()
        tmp.cleanup()
    _say("stopped")
    return 0


CLEANUP_S = 3.0
"""The most the stop's cleanup may take (each step is cut at what is left); the watchdog
ends a process still there :data:`metalguard.demo.stopping.EXIT_AFTER_S` after the stop."""


async def _clean_up(cleanup: list[Any], server: NatsServer, budget_s: float) -> None:
    """Run the cleanup steps newest first, within ``budget_s`` in all, then stop the
    nats-server."""
    end = time.monotonic() + budget_s
    for step in reversed(cleanup):
        left = max(0.05, end - time.monotonic())
        with contextlib.suppress(Exception):
            await within(step(), left)
    await asyncio.to_thread(_close_server, server)


def _close_server(server: NatsServer) -> None:
    server.stop(timeout=1.0)
    server.close()


def _emergency(server: NatsServer, tmp: Path) -> None:
    """Before an exit without cleanup (a second signal, a wedged loop): end the
    nats-server and remove the simulated trees (job members die with this process)."""
    pid = server.pid
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(tmp, ignore_errors=True)


class _Outcome:
    """The report, written once: by the loop when it stops, or by the stop watchdog's
    thread when the loop is wedged (``forced``)."""

    def __init__(self, path: Path | None, journal: _Journal, scenario: Scenario | None) -> None:
        self.path = path
        self.journal = journal
        self.scenario = scenario
        self.view: AllRegions | None = None
        self.regions: list[DemoRegion] = []
        self._lock = threading.Lock()
        self._written = False

    def write(self, stopper: Stopper, *, forced: bool = False) -> None:
        """Write the report (once; nothing without ``--report``)."""
        with self._lock:
            if self._written or self.path is None:
                return
            self._written = True
            stop = {
                "stop_lag_s": stopper.lag_s,
                "stopped_by": "signal" if stopper.signals else "duration",
                "stop_forced": forced,
            }
            view = self.view or AllRegions({})
            for attempt in range(3):  # from the watchdog the loop may change a dict meanwhile
                try:
                    _report(self.path, view, self.journal, self.regions, self.scenario, stop)
                    return
                except RuntimeError:
                    if attempt == 2:
                        raise


QOS_NOTE = (
    "QoS: the profile is stored in MG_QOS for every cluster (metalguard qos show); the "
    "simulated agents have no NICs to shape, so their reconciler is off and no node "
    "reports a QoS status (docs/demo.md)"
)
QOS_PROFILE = SHIPPED["examples/qos-profile.toml"]


async def _push_qos(qos: QosStore, clusters: int) -> None:
    """Store examples/qos-profile.toml as the profile of clusters ``c1``..``cN`` (the
    ``MG_QOS`` key is the cluster name, so one entry covers that cluster in every region;
    docs/qos.md)."""
    if not QOS_PROFILE.is_file():
        _say(f"no {QOS_PROFILE} here: no QoS profile pushed")
        return
    profile = decode_profile(QOS_PROFILE.read_bytes(), "toml")
    for c in range(1, clusters + 1):
        await qos.put(f"c{c}", None, profile)
    names = ", ".join(f"c{c}" for c in range(1, clusters + 1))
    _say(f"QoS profile {QOS_PROFILE.name} (version {profile.version}) stored for {names}")


async def _wait_agents(
    regions: list[DemoRegion], expected: dict[str, int], stop: asyncio.Event
) -> None:
    """Report progress per region until every agent's first batch was taken in (or a
    deadline)."""
    deadline = time.monotonic() + AGENTS_UP_DEADLINE_S
    total = sum(expected.values())
    line = ""
    up = 0
    while not stop.is_set() and time.monotonic() < deadline:
        counts = {r.name: len(r.controller.store.records) for r in regions}
        up = sum(counts.values())
        now = (
            f"agents up: {up}/{total} ("
            + ", ".join(f"{name} {counts[name]}/{expected.get(name, 0)}" for name in counts)
            + ")"
        )
        if now != line:
            _say(now)
            line = now
        if up >= total:
            return
        await wait_event(stop, 0.5)
    if up < total:
        _say(f"only {up}/{total} agents reported within {AGENTS_UP_DEADLINE_S:.0f}s")


async def _submit_jobs(
    jobs: dict[str, JobManager],
    default_region: str,
    scenario: Scenario,
    journal: _Journal,
    checkpoints: Path,
) -> None:
    """Submit the scenario's ``[[job]]`` entries when due, each to its ``region``'s job
    manager (default: the first region's; docs/jobs.md)."""
    submitted: set[int] = set()
    while len(submitted) < len(scenario.job):
        for index, entry in due_jobs(scenario, journal.t(), submitted):
            submitted.add(index)
            manager = jobs.get(entry.region or default_region)
            if manager is None:
                _say(f"[{journal.t():6.1f}s] job {entry.name}: no region {entry.region!r}")
                continue
            try:
                status = await manager.submit(scenario_job(entry, Path.cwd(), checkpoints))
            except JobRejectedError as exc:
                _say(f"[{journal.t():6.1f}s] job {entry.name} rejected: {exc}")
                continue
            journal.submitted += 1
            _say(f"[{journal.t():6.1f}s] job {entry.name} submitted as {status.job_id}")
        await asyncio.sleep(0.5)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# --- jobs: agents that run their members here, [[job]] entries (docs/jobs.md) -------------


def workload_section(node_dir: Path, *, stop_grace_s: float = 2.0) -> str:
    """The ``[workload]`` table of a simulated node: its own socket and work dir, short
    deadlines, this interpreter for ``python`` commands, the simulated ``nvidia-smi``
    (:mod:`demo.sim.nvidia_smi`) for GPU resets."""
    nvidia_smi = f"{sys.executable} -m metalguard.demo.sim.nvidia_smi --state {node_dir / 'nvml'}"
    return (
        "\n[workload]\n"
        "enabled = true\n"
        f'work_dir = "{node_dir / "work"}"\n'
        f'socket = "{node_dir / "wl.sock"}"\n'
        f"stop_grace_s = {stop_grace_s}\n"
        "checkpoint_timeout_s = 3.0\n"
        "progress_interval_s = 0.2\n"
        f'python = "{sys.executable}"\n'
        f'nvidia_smi = "{nvidia_smi}"\n'
        "gpu_reset_timeout_s = 30.0\n"
    )


class WorkloadFleet(SimFleet):
    """The simulated fleet with every agent's workload runner enabled, so each simulated
    node runs its job members as processes on this machine (MG_MASTER_ADDR 127.0.0.1),
    and NVIDIA GPUs behind a simulated NVML and a simulated kernel log (``nvml``,
    ``kmsg``: on unless told otherwise)."""

    def __init__(self, *args: Any, nvml: bool = True, kmsg: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, nvml=nvml, kmsg=kmsg, **kwargs)

    def _build(self) -> dict[str, SimNode]:
        nodes = super()._build()
        for node in nodes.values():
            text = node.config_path.read_text() + workload_section(node.config_path.parent)
            node.config_path.write_text(text)
            node.config = parse_config(text, str(node.config_path))
        return nodes


def _resolve(arg: str, base: Path) -> str:
    """``arg`` made absolute when it names a file under ``base``, else when it names a
    file the package ships (``examples/trainer.py``), else as it is."""
    if (base / arg).is_file():
        return str((base / arg).resolve())
    shipped = SHIPPED.get(Path(arg).as_posix())
    if shipped is not None and shipped.is_file():
        return str(shipped)
    return arg


def scenario_job(entry: ScenarioJob, base: Path, checkpoints: Path) -> dict[str, Any]:
    """The job document the demo submits for a ``[[job]]`` entry: relative paths in
    ``args`` that exist under ``base`` (else the files the package ships) are made absolute (members
    run in their own directories), and checkpoints go to ``checkpoints/<name>`` (shared by
    every node)."""
    args = [_resolve(a, base) for a in entry.args]
    extra: dict[str, Any] = {"timing_window_s": entry.timing_window_s}
    if args and Path(args[0]).name == "trainer.py":
        # a straggler fault slows the node's trainer (<node dir>/straggler; members run
        # in <node dir>/work/<job>.<rank>): docs/simulation.md "Faults"
        if "--slow-file" not in args:
            args += ["--slow-file", f"../../{STRAGGLER_FILE}"]
        if "--steps" in args and args.index("--steps") + 1 < len(args):
            with contextlib.suppress(ValueError):
                extra["total_steps"] = int(args[args.index("--steps") + 1])
    return {
        "name": entry.name,
        "nodes": entry.nodes,
        "priority": entry.priority,
        "preemptible": entry.preemptible,
        "command": entry.command,
        "args": args,
        "checkpoint_dir": str(checkpoints / entry.name),
        "checkpoint_every": entry.checkpoint_every,
        "hang_timeout": entry.hang_timeout,
        "max_restarts": entry.max_restarts,
        **extra,
    }
