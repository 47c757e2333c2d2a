"""``metalguard demo``: the one command a newcomer runs.

An embedded nats-server with the design's streams, a region controller (ingest, scoring,
lifecycle, the HTTP API), and a simulated fleet of real agents over generated sysfs trees
(agent/sim) playing a scenario of hardware faults.  Runs until Ctrl-C / SIGINT / SIGTERM
or ``--duration``; ``--report FILE`` writes what happened as JSON.  Like controller/cli.py
this module is a composition root: it wires the agent's simulation to the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
from aiohttp import web
from nats.aio.msg import Msg

from agent.config import parse_config
from agent.sim.fleet import SimFleet, SimNode
from agent.sim.scenario import (
    Scenario,
    ScenarioJob,
    due_faults,
    due_jobs,
    load_scenario,
    unknown_nodes,
)
from controller.api import make_app
from controller.api_sse import NatsEventSource
from controller.jobs import JobManager, JobSettings, report_rows
from controller.jobs_spec import JobRejectedError
from controller.jobs_store import JobStore
from controller.natsserver import NatsServer
from controller.qos import QosStore
from controller.region import RegionController
from controller.service import start_ingest
from controller.state import NodeStore
from controller.streams import ensure_streams
from proto.codec import CodecError, decode
from proto.events import ControllerEvent
from proto.subjects import Subjects

REGION = "r1"
DEFAULT_SCENARIO = Path("scenarios/default.toml")
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
        if not DEFAULT_SCENARIO.is_file():
            _say("no scenario (scenarios/default.toml not found here): a healthy fleet")
            return None
        path = DEFAULT_SCENARIO
    scenario = load_scenario(path)
    _say(f"scenario {path}: {scenario.description or f'{len(scenario.fault)} faults'}")
    return scenario


async def _play(fleet: SimFleet, scenario: Scenario | None, journal: _Journal) -> None:
    """Apply the scenario's faults when due and advance stateful ones, every tick."""
    applied: set[int] = set()
    while True:
        if scenario is not None:
            for index, fault in due_faults(scenario, journal.t(), applied):
                applied.add(index)
                result = fleet.apply(
                    fault.kind, fault.node, count=fault.count, duration_s=fault.duration_s
                )
                journal.faults.append({"t": journal.t(), "node": fault.node, "kind": fault.kind})
                _say(f"[{journal.t():6.1f}s] fault {fault.kind} on {fault.node}: {result.detail}")
        fleet.tick()
        await asyncio.sleep(fleet.interval_s)


async def _serve_api(app: web.Application, listen: str) -> tuple[web.AppRunner, str]:
    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, int(port)).start()
    except OSError:
        await web.TCPSite(runner, host, 0).start()  # the port is taken: any free one
    server = runner.addresses[0]
    return runner, f"http://{server[0]}:{server[1]}"


def _report(
    path: Path, region: RegionController, journal: _Journal, jobs: JobManager | None = None
) -> None:
    nodes = [
        {
            "node": r.node.node,
            "grade": r.grade,
            "score": r.score,
            "reasons": msgspec.to_builtins(r.reasons),
        }
        for r in sorted(region.store.records.values(), key=lambda r: r.node.node)
    ]
    doc = {"nodes": nodes, "faults": journal.faults, "events": journal.events}
    if jobs is not None:  # docs/jobs.md
        doc["jobs"] = report_rows(jobs.jobs.values())
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    _say(f"report written to {path}")


async def run_demo(options: DemoOptions) -> int:
    """Run the demo until a stop signal or the duration; return the exit status."""
    scenario = _scenario(options)
    subjects = Subjects(options.prefix)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    journal = _Journal()
    server = NatsServer()
    tmp = tempfile.TemporaryDirectory(prefix="mg-demo-", dir=_fast_tmp())
    cleanup: list[Any] = []
    try:
        _say("starting nats-server (JetStream)")
        url = await asyncio.to_thread(server.start)
        nc = await asyncio.wait_for(nats.connect(url, max_reconnect_attempts=1), 10)
        cleanup.append(nc.close)
        js = nc.jetstream()
        await ensure_streams(js, subjects)
        _say(
            f"NATS at {url} (streams {subjects.stream_telemetry}, {subjects.stream_events}, "
            f"{subjects.stream_control} and KV buckets ready)"
        )
        sub = await nc.subscribe(subjects.all_of("ctl"), cb=journal.on_event)
        cleanup.append(sub.unsubscribe)

        region = RegionController(js, await NodeStore.open(js, subjects), subjects, REGION)
        await region.start(silence_interval_s=1.0)
        cleanup.append(region.stop)
        ingest = start_ingest(js, subjects, REGION, region)
        await ingest.start()
        cleanup.append(ingest.stop)
        jobs = JobManager(  # runs the scenario's [[job]] entries (docs/jobs.md)
            nc,
            js,
            await JobStore.open(js, subjects),
            region.store,
            subjects,
            REGION,
            DEMO_JOBS,
            fleet=region.topology.fleet,
        )
        app = make_app(
            region,
            NatsEventSource(nc, subjects, REGION),
            registry=ingest.metrics.registry,
            qos=await QosStore.open(js, subjects),
            jobs=jobs,
        )
        runner, api_url = await _serve_api(app, options.http)
        cleanup.append(runner.cleanup)
        _say(f"controller for region {REGION} ready; API at {api_url}")

        fleet = WorkloadFleet(
            Path(tmp.name),
            url,
            racks=options.racks,
            nodes_per_rack=options.nodes_per_rack,
            interval_s=options.interval_s,
            prefix=subjects.prefix,
        )
        if scenario is not None and (missing := unknown_nodes(scenario, fleet.node_names)):
            _say(f"scenario names nodes not in this fleet, skipped: {', '.join(missing)}")
            scenario = msgspec.structs.replace(
                scenario, fault=tuple(f for f in scenario.fault if f.node not in missing)
            )
        _say(f"starting {len(fleet.node_names)} agents ({options.racks} racks)")
        await fleet.start()
        cleanup.append(fleet.stop)
        await _wait_agents(region, len(fleet.node_names), stop)
        await jobs.start()
        cleanup.append(jobs.stop)
        _say(f"try: curl {api_url}/v1/nodes   or   metalguard nodes --api {api_url}")
        _say(f"dashboard: {api_url}/ui/")
        _say("running; press Ctrl-C to stop")
        journal.started = time.monotonic()
        player = asyncio.create_task(_play(fleet, scenario, journal), name="scenario")
        cleanup.append(lambda: _cancel(player))
        if scenario is not None and scenario.job:
            ckpt = Path(tmp.name) / "checkpoints"
            submitter = asyncio.create_task(_submit_jobs(jobs, scenario, journal, ckpt))
            cleanup.append(lambda: _cancel(submitter))
        duration = options.duration_s
        if duration is None and options.headless:
            duration = 120.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), duration)
        _say("stopping")
        if options.report is not None:
            _report(options.report, region, journal, jobs)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for step in reversed(cleanup):
            with contextlib.suppress(Exception):
                await step()
        await asyncio.to_thread(server.close)
        tmp.cleanup()
    _say("stopped")
    return 0


async def _wait_agents(region: RegionController, expected: int, stop: asyncio.Event) -> None:
    """Report progress until every agent's first batch was taken in (or a deadline)."""
    deadline = time.monotonic() + AGENTS_UP_DEADLINE_S
    seen = -1
    while not stop.is_set() and time.monotonic() < deadline:
        up = len(region.store.records)
        if up != seen:
            _say(f"agents up: {up}/{expected}")
            seen = up
        if up >= expected:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    if seen < expected:
        _say(f"only {seen}/{expected} agents reported within {AGENTS_UP_DEADLINE_S:.0f}s")


async def _submit_jobs(
    jobs: JobManager, scenario: Scenario, journal: _Journal, checkpoints: Path
) -> None:
    """Submit the scenario's ``[[job]]`` entries when due (docs/jobs.md)."""
    submitted: set[int] = set()
    while len(submitted) < len(scenario.job):
        for index, entry in due_jobs(scenario, journal.t(), submitted):
            submitted.add(index)
            try:
                status = await jobs.submit(scenario_job(entry, Path.cwd(), checkpoints))
            except JobRejectedError as exc:
                _say(f"[{journal.t():6.1f}s] job {entry.name} rejected: {exc}")
                continue
            _say(f"[{journal.t():6.1f}s] job {entry.name} submitted as {status.job_id}")
        await asyncio.sleep(0.5)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# --- jobs: agents that run their members here, [[job]] entries (docs/jobs.md) -------------


def workload_section(node_dir: Path, *, stop_grace_s: float = 2.0) -> str:
    """The ``[workload]`` table of a simulated node: its own socket and work dir, short
    deadlines, this interpreter for ``python`` commands."""
    return (
        "\n[workload]\n"
        "enabled = true\n"
        f'work_dir = "{node_dir / "work"}"\n'
        f'socket = "{node_dir / "wl.sock"}"\n'
        f"stop_grace_s = {stop_grace_s}\n"
        "checkpoint_timeout_s = 3.0\n"
        "progress_interval_s = 0.2\n"
        f'python = "{sys.executable}"\n'
    )


class WorkloadFleet(SimFleet):
    """The simulated fleet with every agent's workload runner enabled, so each simulated
    node runs its job members as processes on this machine (MG_MASTER_ADDR 127.0.0.1)."""

    def _build(self) -> dict[str, SimNode]:
        nodes = super()._build()
        for node in nodes.values():
            text = node.config_path.read_text() + workload_section(node.config_path.parent)
            node.config_path.write_text(text)
            node.config = parse_config(text, str(node.config_path))
        return nodes


def scenario_job(entry: ScenarioJob, base: Path, checkpoints: Path) -> dict[str, Any]:
    """The job document the demo submits for a ``[[job]]`` entry: relative paths in
    ``args`` that exist under ``base`` are made absolute (members run in their own
    directories), and checkpoints go to ``checkpoints/<name>`` (shared by every node)."""
    args = [str((base / a).resolve()) if (base / a).is_file() else a for a in entry.args]
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
    }
