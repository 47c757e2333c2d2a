"""The Slurm bridge against a real Slurm (tests/support/harness/slurm_cluster.py), a real
RegionController and its HTTP API over the session nats-server.

A requeueable job runs examples/trainer.py on mgnode1; an uncorrectable ECC error fed to
the controller isolates the node -> Slurm drains it with the metalguard reason, the job
is asked to checkpoint (SIGUSR1) and requeued; the operator's uncordon through the API
resumes the node and the job finishes from its checkpoint with the digest of an
uninterrupted run.  A node an operator drained by hand is never resumed.  A sub-healthy
node is drained while its job runs on, and enters MAINTENANCE once the bridge's count of
its Slurm jobs (``slurm_jobs`` NodeEvents, through ingest) says its last job ended.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.api.app import make_app
from metalguard.controller.ingest.consumer import Ingest
from metalguard.controller.ingest.settings import IngestSettings
from metalguard.controller.slurm.bridge import SlurmBridge
from metalguard.controller.slurm.config import BridgeConfig, JobsSection, SlurmSection
from metalguard.controller.slurm.runner import SlurmRunner
from metalguard.controller.slurm.tools import SlurmTools
from metalguard.proto.codec import decode
from metalguard.proto.events import SLURM_JOBS_KIND, ControllerEvent, NodeEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.harness.api_env import ADMIN_TOKEN, ApiEnv, api_env, batch
from tests.support.harness.slurm_cluster import DEAD_NODE, NODE, SlurmCluster
from tests.support.scoring_helpers import pci
from tests.support.waiting import wait_for_value, wait_until

# One real Slurm (munged, slurmctld, slurmd) on the host at a time.
pytestmark = pytest.mark.xdist_group("slurm")

REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "examples" / "trainer.py"
STEPS = 60
STEP_S = 0.05
DEADLINE_S = 30.0
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SIGUSR1_BIT = 1 << (10 - 1)


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> AsyncIterator[ApiEnv]:
    """A controller for r1 knowing r1.c1.mgnode1 and r1.c1.mgnode2 (both healthy)."""
    async with api_env(nc, subjects) as e:
        await e.feed(batch("c1", NODE, 1), batch("c1", DEAD_NODE, 1))
        yield e


@pytest.fixture
async def api(env: ApiEnv) -> AsyncIterator[TestClient[Any, Any]]:
    app = make_app(env.controller, env.source, admin_tokens={ADMIN_TOKEN}, keepalive_s=0.05)
    async with TestClient(TestServer(app)) as client:
        yield client


@pytest.fixture
async def ingest(env: ApiEnv) -> AsyncIterator[Ingest]:
    """Ingest feeding the controller from the streams, on its clock: the bridge's NodeEvents
    reach it as they do in production."""
    settings = IngestSettings(
        region="r1", fetch_timeout_s=0.2, retry_delay_s=0.2, stop_timeout_s=5.0
    )
    consumer = Ingest(env.js, env.subjects, settings, env.controller, clock=env.clock)
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


def new_bridge(env: ApiEnv, slurm: SlurmCluster) -> SlurmBridge:
    cfg = BridgeConfig(
        region="r1",
        cluster="c1",
        slurm=SlurmSection(conf=str(slurm.conf), poll_s=0.2, attempts=2, backoff_s=0.1),
        jobs=JobsSection(checkpoint_wait_s=1.0),
    )
    return SlurmBridge(env.js, env.subjects, cfg, SlurmTools(SlurmRunner(cfg.slurm), "auto"))


@pytest.fixture
async def bridge(env: ApiEnv, slurm: SlurmCluster) -> AsyncIterator[SlurmBridge]:
    b = new_bridge(env, slurm)
    await b.start()
    try:
        yield b
    finally:
        await b.stop()


async def stream_messages(js: JetStreamContext, stream: str) -> list[bytes]:
    info = await js.stream_info(stream)
    if info.state.messages == 0:
        return []
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        out.append((await js.get_msg(stream, seq)).data or b"")
    return out


async def control_events(env: ApiEnv) -> list[ControllerEvent]:
    raw = await stream_messages(env.js, env.subjects.stream_control)
    return [decode(m, ControllerEvent) for m in raw]


def kinds(events: list[ControllerEvent], node: str) -> list[str]:
    return [e.kind for e in events if e.node is not None and e.node.node == node]


async def operator(api: TestClient[Any, Any], node: str, action: str, reason: str) -> None:
    body = {"reason": reason, "who": "alice"}
    response = await api.post(f"/v1/nodes/r1.c1.{node}/{action}", json=body, headers=ADMIN)
    assert response.status == 200, await response.text()


def trainer_ready(checkpoint_dir: Path) -> bool:
    """A trainer process for this directory runs and has its SIGUSR1 handler installed
    (before that, SIGUSR1 would kill it)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
        except OSError:
            continue
        if str(checkpoint_dir).encode() not in cmdline:
            continue
        caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
        if int(caught.split()[1], 16) & SIGUSR1_BIT:
            return True
    return False


def uninterrupted_digest(tmp: Path) -> str:
    """The digest of a run that was never stopped (same steps, no sleeping)."""
    out = subprocess.run(
        [
            *(sys.executable, str(TRAINER), "--steps", str(STEPS), "--step-seconds", "0"),
            *("--checkpoint-dir", str(tmp / "plain"), "--no-client"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return next(line for line in out.splitlines() if line.startswith("digest=")).split("=", 1)[1]


def submit_trainer(slurm: SlurmCluster, tmp: Path) -> tuple[str, Path, Path]:
    """sbatch a requeueable trainer; (job id, its output file, its checkpoint dir)."""
    ckpt, out = tmp / "ckpt", tmp / "trainer.out"
    script = tmp / "train.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --requeue\n"
        "#SBATCH --open-mode=append\n"
        f"#SBATCH --output={out}\n"
        'echo "start restart=${SLURM_RESTART_COUNT:-0}"\n'
        f"exec {sys.executable} {TRAINER} --steps {STEPS} --step-seconds {STEP_S} "
        f"--resume auto --checkpoint-dir {ckpt} --no-client\n"
    )
    reply = slurm.run("sbatch", "--parsable", f"--chdir={tmp}", str(script))
    return reply.strip().split(";")[0], out, ckpt


async def test_isolation_drains_checkpoints_requeues_and_uncordon_resumes(
    env: ApiEnv,
    api: TestClient[Any, Any],
    bridge: SlurmBridge,
    slurm: SlurmCluster,
    tmp_path: Path,
) -> None:
    job, out, ckpt = submit_trainer(slurm, tmp_path)
    await wait_until(lambda: trainer_ready(ckpt), DEADLINE_S, "the trainer to run on mgnode1")
    assert slurm.jobs()[job].nodes == (NODE,)

    fault_ts = time.monotonic()
    await env.feed(batch("c1", NODE, 2, ue=1))  # the fault, through metalguard

    def drained_and_requeued(state: tuple[Any, Any]) -> bool:
        node, j = state
        return bool(node.drained and j.state == "PENDING")

    node, _ = await wait_for_value(
        lambda: _async(lambda: (slurm.nodes()[NODE], slurm.jobs()[job])),
        drained_and_requeued,
        DEADLINE_S,
        "mgnode1 drained and the job requeued",
    )
    print(f"fault -> drained and requeued: {time.monotonic() - fault_ts:.2f} s")
    assert node.reason.startswith("metalguard: node.isolated: "), node.reason
    text = out.read_text()
    signalled = text.find("checkpoint step=")  # SIGUSR1's checkpoint, before the requeue
    assert 0 <= signalled < text.find("DUE TO JOB REQUEUE"), text
    # the bridge publishes slurm.job_requeued after its requeue, which Slurm may show first
    events = await wait_for_value(
        lambda: control_events(env),
        lambda evs: len(kinds(evs, NODE)) >= 4,
        DEADLINE_S,
        "the bridge's events of the isolation",
    )
    assert kinds(events, NODE) == [
        "node.isolated",
        "slurm.drained",
        "slurm.job_signalled",
        "slurm.job_requeued",
    ]
    assert not slurm.nodes()[NODE].down

    uncordon_ts = time.monotonic()
    await operator(api, NODE, "uncordon", "DIMM replaced")

    text = await wait_for_value(
        lambda: _async(lambda: out.read_text()),
        lambda t: "digest=" in t,
        DEADLINE_S,
        "the requeued job to finish",
    )
    print(f"uncordon -> job finished: {time.monotonic() - uncordon_ts:.2f} s")
    assert not slurm.nodes()[NODE].drained
    lines = text.splitlines()
    assert lines[0] == "start restart=0"
    assert "start restart=1" in lines, text
    resumed = next(line for line in lines if line.startswith("resumed step="))
    assert int(resumed.split()[1].split("=")[1]) > 0, resumed
    assert lines[-1] == f"digest={uninterrupted_digest(tmp_path)}"
    events = await wait_for_value(
        lambda: control_events(env),
        lambda evs: "slurm.resumed" in kinds(evs, NODE),
        DEADLINE_S,
        "the bridge's slurm.resumed",
    )
    assert kinds(events, NODE)[-2:] == ["node.uncordoned", "slurm.resumed"]


async def test_a_rail_flagged_node_is_drained_its_job_runs_on_and_uncordon_resumes(
    env: ApiEnv,
    api: TestClient[Any, Any],
    bridge: SlurmBridge,
    slurm: SlurmCluster,
    tmp_path: Path,
) -> None:
    """Two nodes, the default rail (one isolation per hour): mgnode2's fault isolates it,
    mgnode1's right after is refused: mgnode1 is flagged, drained with the rail's reason,
    and its job is neither signalled nor requeued; an uncordon resumes it."""
    _, out, ckpt = submit_trainer(slurm, tmp_path)
    await wait_until(lambda: trainer_ready(ckpt), DEADLINE_S, "the trainer to run on mgnode1")
    await env.feed(batch("c1", DEAD_NODE, 2, ue=1), batch("c1", NODE, 2, ue=1))
    assert env.controller.store.records[f"r1.c1.{NODE}"].rail_flagged

    node = await wait_for_value(
        lambda: _async(lambda: slurm.nodes()[NODE]),
        lambda n: n.drained,
        DEADLINE_S,
        "mgnode1 drained",
    )
    assert node.reason.startswith("metalguard: node.rail_flagged: rail-flagged:"), node.reason
    text = await wait_for_value(
        lambda: _async(lambda: out.read_text()),
        lambda t: "digest=" in t,
        DEADLINE_S,
        "the job to finish where it runs",
    )
    assert "DUE TO JOB REQUEUE" not in text, text
    assert "start restart=1" not in text, text
    assert text.splitlines()[-1] == f"digest={uninterrupted_digest(tmp_path)}"
    events = await control_events(env)
    mine = kinds(events, NODE)
    assert mine[:2] == ["node.rail_flagged", "slurm.drained"], mine
    assert "slurm.job_signalled" not in mine
    assert "slurm.job_requeued" not in mine

    await operator(api, NODE, "uncordon", "sensor checked")
    await wait_for_value(
        lambda: _async(lambda: slurm.nodes()[NODE]),
        lambda n: not n.drained,
        DEADLINE_S,
        "mgnode1 resumed",
    )
    events = await wait_for_value(
        lambda: control_events(env),
        lambda evs: "slurm.resumed" in kinds(evs, NODE),
        DEADLINE_S,
        "the bridge's slurm.resumed",
    )
    flags = [e for e in events if e.kind == "node.rail_flagged" and e.node is not None]
    assert [e.attributes["flagged"] for e in flags if e.node.node == NODE] == [True, False]  # type: ignore[union-attr]


async def test_a_node_drained_by_hand_is_never_resumed(
    env: ApiEnv, api: TestClient[Any, Any], bridge: SlurmBridge, slurm: SlurmCluster
) -> None:
    slurm.run("scontrol", "update", f"NodeName={DEAD_NODE}", "State=DRAIN", "Reason=disk swap")

    await operator(api, DEAD_NODE, "maintenance", "PSU swap")
    await operator(api, DEAD_NODE, "uncordon", "PSU back")

    def skipped_uncordon(events: list[ControllerEvent]) -> bool:
        return any(
            e.kind == "slurm.skipped" and e.attributes.get("cause") == "node.uncordoned"
            for e in events
        )

    events = await wait_for_value(
        lambda: control_events(env), skipped_uncordon, DEADLINE_S, "the bridge to skip"
    )
    node = slurm.nodes()[DEAD_NODE]
    assert node.drained
    assert node.reason == "disk swap"
    assert "slurm.resumed" not in kinds(events, DEAD_NODE)
    assert "slurm.drained" not in kinds(events, DEAD_NODE)  # its reason was never replaced

    # Slurm's own view flows back: the node it reports DOWN is a signal in metalguard.
    def slurm_down(raw: list[bytes]) -> bool:
        return any(_node_event(m, "slurm_down") for m in raw)

    raw = await wait_for_value(
        lambda: stream_messages(env.js, env.subjects.stream_events),
        slurm_down,
        DEADLINE_S,
        "a slurm_down NodeEvent",
    )
    down = next(e for m in raw if (e := _node_event(m, "slurm_down")) is not None)
    assert (down.node.region, down.node.cluster, down.node.node) == ("r1", "c1", DEAD_NODE)
    assert down.severity == "warning"
    assert down.source == "slurm"
    assert str(down.attributes["state"]).startswith("DOWN")


async def test_a_bridge_started_after_an_isolation_drains_the_node_from_the_records(
    env: ApiEnv, slurm: SlurmCluster
) -> None:
    await env.feed(batch("c1", NODE, 2, ue=1))  # isolated while no bridge runs
    late = new_bridge(env, slurm)

    assert await late.reconcile() == 1
    node = slurm.nodes()[NODE]
    assert node.drained
    assert node.reason.startswith("metalguard: node.isolated: "), node.reason
    drained = [e for e in await control_events(env) if e.kind == "slurm.drained"]
    assert len(drained) == 1
    assert str(drained[0].attributes["cause_event_id"]).startswith("reconcile@")

    assert await late.reconcile() == 1  # again, as after a restart: nothing new
    assert [e.kind for e in await control_events(env)].count("slurm.drained") == 1
    assert slurm.nodes()[NODE].reason == node.reason


def link_down(seq: int) -> TelemetryBatch:
    """mgnode1's batch ``seq`` with its GPU's PCIe link trained down to x8 of x16."""
    return msgspec.structs.replace(batch("c1", NODE, seq), pcie=(pci("0x030200", width=8),))


def submit_gated(slurm: SlurmCluster, tmp: Path, release: Path) -> tuple[str, Path]:
    """sbatch a job that runs until ``release`` exists, noting a checkpoint signal (it
    would have been asked to move); (job id, its output file)."""
    out, script = tmp / "gated.out", tmp / "gated.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --open-mode=append\n"
        f"#SBATCH --output={out}\n"
        "trap 'echo signalled' USR1\n"
        "echo started\n"
        f"while [ ! -e {release} ]; do sleep 0.1; done\n"
        "echo finished\n"
    )
    reply = slurm.run("sbatch", "--parsable", f"--chdir={tmp}", str(script))
    return reply.strip().split(";")[0], out


async def slurm_jobs_events(env: ApiEnv, node: str) -> list[NodeEvent]:
    raw = await stream_messages(env.js, env.subjects.stream_events)
    found = (_node_event(m, SLURM_JOBS_KIND) for m in raw)
    return [e for e in found if e is not None and e.node.node == node]


async def test_a_sub_healthy_node_is_drained_its_job_runs_on_then_it_enters_maintenance(
    env: ApiEnv, ingest: Ingest, bridge: SlurmBridge, slurm: SlurmCluster, tmp_path: Path
) -> None:
    """SUB_HEALTHY's promise on the Slurm path (docs/lifecycle.md "The job count",
    docs/slurm.md): a PCIe link trained down on mgnode1 while a Slurm job runs there makes
    it SUB_HEALTHY; the bridge drains it, the job is neither signalled nor requeued and runs
    to its end; then the bridge's count of mgnode1's Slurm jobs falls to 0 and the node
    enters MAINTENANCE: "sub-healthy and its last job ended"."""
    handle = f"r1.c1.{NODE}"
    records = env.controller.store.records
    release = tmp_path / "release"
    job, out = submit_gated(slurm, tmp_path, release)
    await wait_until(
        lambda: out.exists() and "started" in out.read_text(), DEADLINE_S, "the job to run"
    )
    assert slurm.jobs()[job].nodes == (NODE,)
    await wait_until(
        lambda: records[handle].slurm_jobs == 1, DEADLINE_S, "the controller to count the job"
    )
    counted = await slurm_jobs_events(env, NODE)
    assert counted[-1].attributes == {"slurm_node": NODE, "running": 1, "jobs": job}
    assert counted[-1].severity == "info"
    assert records[handle].running_jobs is None  # no native job manager here

    await env.feed(link_down(2))  # the fault, through metalguard
    assert records[handle].grade == "SUB_HEALTHY"
    node = await wait_for_value(
        lambda: _async(lambda: slurm.nodes()[NODE]),
        lambda n: n.drained,
        DEADLINE_S,
        "mgnode1 drained",
    )
    assert node.reason.startswith("metalguard: node.sub_healthy: "), node.reason
    await env.feed(link_down(3))  # still sub-healthy, its job still on it: no MAINTENANCE
    assert records[handle].grade == "SUB_HEALTHY"
    assert slurm.jobs()[job].state == "RUNNING"

    release.touch()  # the job ends by itself
    events = await wait_for_value(
        lambda: control_events(env),
        lambda evs: "node.maintenance" in kinds(evs, NODE),
        DEADLINE_S,
        "node.maintenance",
    )
    assert kinds(events, NODE) == ["node.sub_healthy", "slurm.drained", "node.maintenance"]
    entered = next(e for e in events if e.kind == "node.maintenance")
    assert entered.message == "sub-healthy and its last job ended"
    assert entered.attributes["grade_from"] == "SUB_HEALTHY"
    assert "action" not in entered.attributes  # nothing left to move: a drain
    last = entered.reasons[-1]
    assert (last.signal, last.message) == ("lifecycle.running_jobs", "its last job ended")
    record = records[handle]
    assert (record.grade, record.slurm_jobs, record.running_jobs) == ("MAINTENANCE", 0, None)
    assert record.history[-1].message == "sub-healthy and its last job ended"
    assert (await slurm_jobs_events(env, NODE))[-1].attributes["running"] == 0

    assert slurm.jobs()[job].state == "COMPLETED"
    text = out.read_text()
    assert text.splitlines() == ["started", "finished"], text  # never signalled, never requeued
    assert slurm.nodes()[NODE].drained  # the drain stays: MAINTENANCE takes no work


def _node_event(raw: bytes, kind: str) -> NodeEvent | None:
    event = decode(raw, NodeEvent)
    return event if event.kind == kind else None


async def _async(fn: Any) -> Any:
    return fn()
