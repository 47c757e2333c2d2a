"""The kernel log monitor on the real /dev/kmsg (root; docs/kmsg.md): a record written to
the kernel log reaches the controller as an event; an agent restart in the middle of a
stream neither repeats nor loses a record; a burst larger than the ring buffer is reported
as lost.

Records written from user space carry facility 1, never the kernel's 0 (../shared/NOTES.md
section 11), so these agents take them with ``trust_user_records``; the kernel rate-limits
such writes (``kernel.printk_devkmsg = ratelimit``), which the tests turn ``on`` and
restore."""

from __future__ import annotations

import ctypes
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.ingest.consumer import Ingest, IngestSettings
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.proto.codec import decode
from metalguard.proto.events import ControllerEvent, NodeEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import KmsgCounts, TelemetryBatch
from tests.support.harness.agent_proc import AgentProcess, write_agent_config
from tests.support.waiting import wait_until

DEVKMSG = Path("/dev/kmsg")
RATELIMIT = Path("/proc/sys/kernel/printk_devkmsg")

pytestmark = [
    pytest.mark.root,
    pytest.mark.xdist_group("kmsg"),
    pytest.mark.skipif(
        os.geteuid() != 0 or not os.access(DEVKMSG, os.R_OK | os.W_OK),
        reason="writing and reading /dev/kmsg needs root",
    ),
]


@pytest.fixture
def devkmsg_unlimited() -> Iterator[None]:
    """``kernel.printk_devkmsg = on`` for the test (user writes not rate-limited)."""
    before = RATELIMIT.read_text().strip() if RATELIMIT.exists() else None
    if before is not None and before != "on":
        RATELIMIT.write_text("on\n")
    try:
        yield
    finally:
        if before is not None and before != "on":
            RATELIMIT.write_text(before + "\n")


def _write(*lines: str) -> None:
    fd = os.open(DEVKMSG, os.O_WRONLY)
    try:
        for line in lines:
            os.write(fd, line.encode())
    finally:
        os.close(fd)


def _config(tmp: Path, nats_url: str, subjects: Subjects, node: str) -> Path:
    config = write_agent_config(
        tmp / "agent.toml", nats_url=nats_url, spool_dir=tmp / "spool", node=node
    )
    text = config.read_text().replace("[nats]\n", f'[nats]\nprefix = "{subjects.prefix}"\n', 1)
    # the fixture tree shows faults of its own (EDAC, PCIe, fans): a collector with none
    text = text.replace('enabled = ["edac", "pcie", "hwmon", "smart"]', 'enabled = ["cache"]')
    config.write_text(
        text + "\n[kmsg]\nenabled = true\ntrust_user_records = true\nbackfill_s = 0\n"
    )
    return config


async def test_a_kernel_log_record_reaches_the_controller_and_isolates_the_node(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects, devkmsg_unlimited: None
) -> None:
    tag = uuid.uuid4().hex[:8]
    node = f"kmsg{tag}"
    js = nc.jetstream(timeout=5)
    store = await NodeStore.open(js, subjects)
    lifecycle = LifecycleConfig(rail_max_fraction=1.0, rail_min_nodes=1000)
    region = RegionController(js, store, subjects, "r1", lifecycle)
    await region.start(silence_interval_s=0.25)
    ingest = Ingest(js, subjects, IngestSettings(region="r1"), region)
    await ingest.start()
    decisions: list[ControllerEvent] = []
    node_events: list[NodeEvent] = []

    async def on_decision(msg: Msg) -> None:
        decisions.append(decode(msg.data, ControllerEvent))

    async def on_node_event(msg: Msg) -> None:
        node_events.append(decode(msg.data, NodeEvent))

    subs = [
        await nc.subscribe(subjects.control_all("r1"), cb=on_decision),
        await nc.subscribe(subjects.node_event("r1", "c1", node, "*"), cb=on_node_event),
    ]
    agent = AgentProcess(_config(tmp_path, nats_url, subjects, node))
    handle = f"r1.c1.{node}"
    try:
        await wait_until(lambda: handle in store.records, 30, "the agent's first batch")
        assert store.records[handle].grade == "HEALTHY", store.records[handle].reasons
        _write(f"<3>EXT4-fs (mg{tag}): Remounting filesystem read-only\n")
        await wait_until(
            lambda: any(e.kind == "kmsg_fs_readonly" for e in node_events), 10, "the kmsg event"
        )
        (event,) = [e for e in node_events if e.kind == "kmsg_fs_readonly"]
        assert (event.source, event.device, event.severity) == ("kmsg", f"mg{tag}", "critical")
        await wait_until(
            lambda: any(
                e.kind == "node.isolated" and e.node and e.node.handle == handle for e in decisions
            ),
            10,
            "node.isolated",
        )
        isolated = [
            e for e in decisions if e.kind == "node.isolated" and e.node and e.node.handle == handle
        ]
        assert isolated[0].reasons[0].signal == "event.kmsg_fs_readonly"
        # the batch carries the count; the next batches keep the node FAILING (kmsg_fatal)
        await wait_until(
            lambda: any(r.rule == "kmsg_fatal" for r in store.records[handle].reasons),
            10,
            "kmsg_fatal",
        )
    finally:
        assert agent.terminate() == 0, agent.stderr()
        for sub in subs:
            await sub.unsubscribe()
        await ingest.stop()
        await region.stop()


class Batches:
    """The kernel log counts of a node's batches, as they arrive, from the agent started
    last: a batch finished before :meth:`restart` (one still in flight from the agent
    just stopped, or left in the shared spool and sent again by the next one) is not
    counted."""

    def __init__(self) -> None:
        self.counts: list[KmsgCounts] = []
        self.since = time.time()

    def restart(self) -> None:
        """Forget what came so far: only batches finished from now on count."""
        self.counts.clear()
        self.since = time.time()

    async def on_batch(self, msg: Msg) -> None:
        batch = decode(msg.data, TelemetryBatch)
        if batch.kmsg is not None and batch.ts >= self.since:
            self.counts.append(batch.kmsg)

    def hung(self) -> int:
        return self.counts[-1].findings.get("hung_task", 0) if self.counts else 0


async def test_a_restart_mid_stream_neither_repeats_nor_loses_and_a_burst_reports_its_loss(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects, devkmsg_unlimited: None
) -> None:
    tag = uuid.uuid4().hex[:8]
    node = f"kmsr{tag}"
    batches = Batches()
    sub = await nc.subscribe(subjects.telemetry("r1", "c1", node), cb=batches.on_batch)
    config = _config(tmp_path, nats_url, subjects, node)

    def hung(n: int) -> str:
        return f"<4>INFO: task mg{tag}-{n}:{n} blocked for more than 120 seconds.\n"

    try:
        agent = AgentProcess(config)
        try:
            await wait_until(lambda: bool(batches.counts), 30, "the agent's first batch")
            _write(*(hung(n) for n in range(5)))
            await wait_until(lambda: batches.hung() >= 5, 30, "5 hung tasks counted")
            assert batches.hung() == 5, batches.counts[-1]
        finally:
            assert agent.terminate() == 0, agent.stderr()
        # written while the agent is down: the next start takes these 3, and only these
        _write(*(hung(n) for n in range(5, 8)))
        batches.restart()
        agent = AgentProcess(config)
        try:
            await wait_until(lambda: bool(batches.counts), 60, "the agent's first batch")
            await wait_until(lambda: batches.hung() >= 3, 15, "the records written while down")
            settled = len(batches.counts)
            await wait_until(lambda: len(batches.counts) >= settled + 3, 10, "three more batches")
            assert batches.hung() == 3  # none again, none lost
            assert batches.counts[-1].lost == 0
        finally:
            assert agent.terminate() == 0, agent.stderr()
        # a burst larger than the ring buffer while the agent is down: reported as lost
        size = ctypes.CDLL(None).klogctl(10, None, 0)
        filler = "<6>mg-filler " + "x" * 200 + "\n"
        _write(*([filler] * (2 * size // len(filler) + 10)))
        batches.restart()
        agent = AgentProcess(config)
        try:
            # a deadline for the start (a loaded machine), then one for the count itself
            await wait_until(lambda: bool(batches.counts), 60, "the agent's first batch")
            await wait_until(lambda: batches.counts[-1].lost > 0, 30, "the loss")
        finally:
            assert agent.terminate() == 0, agent.stderr()
    finally:
        await sub.unsubscribe()
