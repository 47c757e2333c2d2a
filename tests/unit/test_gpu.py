"""The gpu collector over a fake NVML: readings, immediate events, XIDs, no driver."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import msgspec
import pytest

from metalguard.agent.collectors.base import REGISTRY, Collected
from metalguard.agent.collectors.gpu import GpuCollector, XidWatcher
from metalguard.agent.collectors.gpu_parse import pci_address, pcie_downgraded, xid_info
from metalguard.agent.events import detect_events
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import NODE_EVENT_KINDS, NodeEvent
from metalguard.proto.telemetry import GpuDevice, TelemetryBatch
from tests.support.fake_nvml import FakeGpu, FakeNvml

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
UNCORRECTED, CORRECTED, VOLATILE, AGGREGATE = 1, 0, 0, 1


def _batch(seq: int, collected: Collected) -> TelemetryBatch:
    assert collected.field == "gpu"
    gpus = tuple(g for g in collected.items if isinstance(g, GpuDevice))
    return TelemetryBatch(node=NODE, seq=seq, ts=1000.0 + seq, gpu=gpus, errors=collected.errors)


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"e{next(counter)}"


async def test_readings_of_a_healthy_gpu() -> None:
    gpu = FakeGpu(
        ecc={(CORRECTED, VOLATILE): 3, (CORRECTED, AGGREGATE): 40, (UNCORRECTED, AGGREGATE): 1},
        retired={0: [0x1000, 0x2000], 1: [0x3000]},
        remapped_rows=(2, 0, 0, 0),
        pcie_replays=7,
        nvlinks={0: {0: 5, 2: 1}, 3: {}},
        throttle=0x4 | 0x40,
    )
    result = await GpuCollector(nvml=FakeNvml([gpu])).collect()
    assert result.errors == ()
    (dev,) = result.items
    assert isinstance(dev, GpuDevice)
    assert (dev.index, dev.uuid, dev.name) == (0, gpu.uuid, "NVIDIA H100 80GB HBM3")
    assert dev.pci_address == "0000:18:00.0"
    assert (dev.temperature_c, dev.power_w) == (41.0, 72.5)
    assert (dev.ecc_sbe_volatile, dev.ecc_dbe_volatile) == (3, 0)
    assert (dev.ecc_sbe_aggregate, dev.ecc_dbe_aggregate) == (40, 1)
    assert (dev.ecc_corrected, dev.ecc_uncorrected) == (3, 0)
    assert (dev.retired_pages_sbe, dev.retired_pages_dbe, dev.retired_pages) == (2, 1, 3)
    assert dev.retired_pages_pending is False
    assert (dev.remapped_rows_correctable, dev.remapped_rows_uncorrectable) == (2, 0)
    assert (dev.row_remap_pending, dev.row_remap_failure) == (False, False)
    assert dev.pcie_replay_count == 7
    assert (dev.pcie_link_gen, dev.pcie_link_gen_max) == (5, 5)
    assert (dev.pcie_link_width, dev.pcie_link_width_max) == (16, 16)
    assert dev.pcie_downgraded is False
    assert [(n.link, n.replay, n.recovery, n.crc_flit, n.crc_data) for n in dev.nvlinks] == [
        (0, 5, 0, 1, 0),
        (3, 0, 0, 0, 0),
    ]
    assert dev.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")


async def test_double_bit_ecc_error_raises_gpu_ecc_dbe_at_once() -> None:
    gpu = FakeGpu()
    collector = GpuCollector(nvml=FakeNvml([FakeGpu(uuid="GPU-a"), gpu]))
    first = _batch(1, await collector.collect())
    assert detect_events(None, first) == []
    gpu.ecc[(UNCORRECTED, VOLATILE)] = 2
    second = _batch(2, await collector.collect())
    (event,) = detect_events(first, second, new_id=_ids())
    assert (event.kind, event.source, event.device) == ("gpu_ecc_dbe", "gpu", "gpu1")
    assert event.severity == "critical"
    assert event.attributes["new"] == 2
    assert event.attributes["ecc_dbe_volatile"] == 2
    assert event.attributes["uuid"] == gpu.uuid
    # the same count again is no new event
    assert detect_events(second, _batch(3, await collector.collect())) == []


async def test_row_remap_failure_raises_an_event_on_the_first_batch_once() -> None:
    gpu = FakeGpu(remapped_rows=(0, 3, 1, 1))
    collector = GpuCollector(nvml=FakeNvml([gpu]))
    first = _batch(1, await collector.collect())
    (event,) = detect_events(None, first)
    assert (event.kind, event.device, event.severity) == (
        "gpu_row_remap_failure",
        "gpu0",
        "critical",
    )
    assert event.attributes["remapped_rows_uncorrectable"] == 3
    assert event.attributes["row_remap_pending"] is True
    assert detect_events(first, _batch(2, await collector.collect())) == []


async def test_pcie_link_downgrade_raises_gpu_pcie_downgrade() -> None:
    gpu = FakeGpu(link_width=8)
    collector = GpuCollector(nvml=FakeNvml([gpu]))
    first = _batch(1, await collector.collect())
    (event,) = detect_events(None, first)
    assert (event.kind, event.device) == ("gpu_pcie_downgrade", "gpu0")
    assert event.attributes["pcie_link_width"] == 8
    assert event.attributes["pcie_link_width_max"] == 16
    assert event.attributes["pci_address"] == "0000:18:00.0"
    assert "x8 of max gen 5 x16" in event.message
    assert first.gpu[0].pcie_downgraded is True


async def test_lower_generation_counts_only_while_the_gpu_is_busy() -> None:
    gpu = FakeGpu(link_gen=1, throttle=0x1)  # idle: power saving, not a fault
    collector = GpuCollector(nvml=FakeNvml([gpu]))
    idle = _batch(1, await collector.collect())
    assert idle.gpu[0].pcie_downgraded is False
    assert detect_events(None, idle) == []
    gpu.throttle = 0
    busy = _batch(2, await collector.collect())
    assert [e.kind for e in detect_events(idle, busy)] == ["gpu_pcie_downgrade"]
    assert pcie_downgraded(4, 5, 16, 16, idle=False)
    assert not pcie_downgraded(None, 5, None, 16, idle=False)


async def test_xid_79_is_published_at_once_with_its_severity() -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b", bus_id="00000000:9A:00.0")])
    got: asyncio.Queue[NodeEvent] = asyncio.Queue()
    watcher = XidWatcher(lambda: NODE, nvml=fake, clock=lambda: 1234.5, wait_ms=20)
    task = asyncio.create_task(watcher.run(got.put))
    try:
        fake.raise_xid(1, 79)
        event = await asyncio.wait_for(got.get(), 5)
        assert (event.kind, event.source, event.device) == ("gpu_xid", "gpu", "gpu1")
        assert (event.severity, event.ts, event.node) == ("critical", 1234.5, NODE)
        assert event.attributes["xid"] == 79
        assert event.attributes["uuid"] == "GPU-b"
        assert event.attributes["pci_address"] == "0000:9a:00.0"
        assert "fallen off the bus" in event.message
        fake.raise_xid(0, 13)
        app = await asyncio.wait_for(got.get(), 5)
        assert (app.device, app.severity, app.attributes["xid"]) == ("gpu0", "warning", 13)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert fake.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]
    assert fake.initialised == 0


async def test_xid_watcher_skips_gpus_without_xid_events() -> None:
    fake = FakeNvml([FakeGpu(supports_xid=False), FakeGpu(uuid="GPU-b")])
    got: asyncio.Queue[NodeEvent] = asyncio.Queue()
    watcher = XidWatcher(lambda: NODE, nvml=fake, wait_ms=20)
    task = asyncio.create_task(watcher.run(got.put))
    try:
        fake.raise_xid(1, 48)
        event = await asyncio.wait_for(got.get(), 5)
        assert (event.device, event.attributes["xid"], event.severity) == ("gpu1", 48, "warning")
        assert [index for index, _, _ in watcher.registered.values()] == [1]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(("xid", "severity"), [(48, "warning"), (63, "info"),
    (64, "warning"), (74, "warning"), (79, "critical"), (94, "warning"), (95, "warning"),
    (13, "warning"), (31, "warning"), (43, "warning"), (45, "warning"), (92, "warning"),
    (999, "warning")])  # fmt: skip
def test_xid_severity_follows_nvidias_catalog(xid: int, severity: str) -> None:
    assert xid_info(xid).severity == severity
    assert xid_info(xid).listed == (xid != 999)


async def test_no_driver_library_reports_once_quietly_and_stays_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml(init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    collector = GpuCollector(nvml=fake)
    with caplog.at_level(logging.WARNING, logger="metalguard.agent.collectors.gpu"):
        first = await collector.collect()
        second = await collector.collect()
    assert first == second == Collected(field="gpu")
    assert fake.calls == ["nvmlInit"]
    assert [r.getMessage() for r in caplog.records] == [
        "gpu collector off: no NVIDIA driver library (libnvidia-ml.so.1): "
        "NVML Shared Library Not Found"
    ]
    # the XID watcher gives up at once too, without an event
    got: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        got.append(event)

    await asyncio.wait_for(XidWatcher(lambda: NODE, nvml=fake).run(emit), 5)
    assert got == []


async def test_driver_not_loaded_is_one_error_entry_then_off() -> None:
    fake = FakeNvml(init_error=FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED)
    collector = GpuCollector(nvml=fake)
    first = await collector.collect()
    assert [(e.collector, e.message) for e in first.errors] == [
        ("gpu", "off: NVML init: Driver Not Loaded")
    ]
    assert await collector.collect() == Collected(field="gpu")
    assert fake.calls == ["nvmlInit"]


async def test_a_lost_gpu_is_an_error_entry_and_the_others_are_read() -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-a", lost=True), FakeGpu(uuid="GPU-b")])
    result = await GpuCollector(nvml=fake).collect()
    assert [g.uuid for g in result.items if isinstance(g, GpuDevice)] == ["GPU-b"]
    assert [(e.path, e.message) for e in result.errors] == [("gpu0", "handle: GPU is lost")]


def test_registered_and_event_kinds_declared() -> None:
    from metalguard.agent.collectors import load_builtin

    load_builtin()
    assert REGISTRY["gpu"].default_interval_s == 5
    assert {"gpu_xid", "gpu_ecc_dbe", "gpu_row_remap_failure", "gpu_pcie_downgrade"} <= (
        NODE_EVENT_KINDS
    )


def test_gpu_device_wire_compatible() -> None:
    batch = TelemetryBatch(
        node=NODE, seq=1, ts=1.0, gpu=(GpuDevice(index=0, row_remap_failure=True),)
    )
    assert decode(encode(batch), TelemetryBatch) == batch
    old = msgspec.json.encode({"index": 0, "uuid": "GPU-x", "ecc_uncorrected": 2})
    dev = msgspec.json.decode(old, type=GpuDevice)
    assert (dev.ecc_uncorrected, dev.nvlinks, dev.pcie_downgraded) == (2, (), False)
    assert pci_address("00000000:9A:00.0") == "0000:9a:00.0"
