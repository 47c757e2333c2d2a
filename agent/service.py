"""``metalguard agent run``: the node agent's main loop under systemd.

Wakes every tick (the shortest collector interval), runs the due collectors, publishes
NodeEvents for what must not wait, and a TelemetryBatch every ``collect.interval_s``.
Speaks sd_notify itself (READY=1, WATCHDOG=1 while the loop makes progress, STATUS=),
reloads its config on SIGHUP, and on SIGTERM flushes the publisher (what cannot be
sent goes to the spool) and exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.js import JetStreamContext

from metalguard.agent.batch import CycleResult, build_batch
from metalguard.agent.collection import Collection, UnknownCollectorError, resolve_enabled
from metalguard.agent.collectors.gpu_xids import XID_LEDGER, XidLedger, boot_time, gpu_index
from metalguard.agent.collectors.rdma import NAME as RDMA_COLLECTOR
from metalguard.agent.config import AgentConfig, ConfigError, load_config
from metalguard.agent.events import detect_events
from metalguard.agent.publisher import Publisher, publisher_settings
from metalguard.agent.sdnotify import notify, watchdog_interval_s
from metalguard.agent.seqstore import SeqStore
from metalguard.agent.settings import collector_settings, node_identity
from metalguard.agent.spool import Spool, SpoolError

if TYPE_CHECKING:
    from metalguard.agent.bmc.proxy import ProxyService
    from metalguard.agent.collectors.udev import MonitorLike
    from metalguard.agent.kmsg.source import KmsgSource
    from metalguard.agent.metrics import MetricsServer
    from metalguard.agent.qos.reconciler import QosReconciler
    from metalguard.agent.workload.service import WorkloadService
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import GpuDevice, QosInterfaceStatus, RdmaPort, TelemetryBatch
from metalguard.runtime.deadlines import wait_event

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 10.0
"""How long SIGTERM waits for queued messages to be acknowledged before spooling them
(well inside the unit's TimeoutStopSec)."""


def _new_event_id() -> str:
    return uuid.uuid4().hex


class AgentService:
    """One agent: collection, event detection, publishing, systemd protocol."""

    def __init__(
        self,
        config_path: Path,
        config: AgentConfig,
        *,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        env: dict[str, str] | None = None,
        udev_opener: Callable[[Iterable[str]], MonitorLike] | None = None,
        nvml: object | None = None,
    ) -> None:
        """``env`` holds NOTIFY_SOCKET / WATCHDOG_USEC (default: the process
        environment); ``{}`` runs an agent that speaks no sd_notify (simulated fleets).
        ``udev_opener``: what opens the uevent monitor (default: the kernel's socket).
        ``nvml``: the NVML binding of the gpu collector and the XID watcher (default:
        nvidia-ml-py's; a simulated fleet gives its own)."""
        self._env = env
        self._nvml = nvml
        self.xids = XidLedger(
            path=Path(config.spool.dir) / XID_LEDGER, boot_ts=boot_time(Path(config.collect.procfs))
        )
        """Each GPU's XIDs, from the watcher to the gpu collector, until a GPU reset."""
        self._udev_opener = udev_opener
        self._config_path = config_path
        self._wall = wall_clock
        self._mono = monotonic
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._reload_requested = False
        self._last_progress = monotonic()
        self._apply(config)
        spool_dir = Path(config.spool.dir)
        self._seq = SeqStore(spool_dir / "seq")
        self._publisher = self._make_publisher(config)
        self._bmc_proxy: ProxyService | None = None
        self._qos_reconciler: QosReconciler | None = None
        self._workload: WorkloadService | None = None
        self._kmsg: KmsgSource | None = None
        self._gpus: tuple[GpuDevice, ...] = ()
        """The gpu collector's last readings (a kernel-log XID's PCI address -> index)."""

    def _apply(self, config: AgentConfig) -> None:
        """Take a (new) config for collection; NATS settings need a restart."""
        names = resolve_enabled(config.collect.enabled)
        self.config = config
        self.identity: NodeIdentity = node_identity(config)
        self.collection = Collection(
            names,
            dataclasses.replace(collector_settings(config), nvml=self._nvml, xid_ledger=self.xids),
            base_interval_s=config.collect.interval_s,
            intervals=dict(config.collect.intervals),
            timeout_s=config.collect.timeout_s,
            clock=self._mono,
        )

    def _make_publisher(self, config: AgentConfig) -> Publisher:
        spool = Spool(Path(config.spool.dir) / "queue", max_bytes=config.spool.max_bytes)
        nats = config.nats
        return Publisher(
            publisher_settings(nats, f"metalguard-agent-{self.identity.node}"),
            subjects=Subjects(nats.prefix),
            spool=spool,
        )

    # --- signals ----------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop after the current step (SIGTERM, SIGINT)."""
        self._stop.set()
        self._wake.set()

    def request_reload(self) -> None:
        """Reload the config before the next cycle (SIGHUP)."""
        self._reload_requested = True
        self._wake.set()

    def _reload(self) -> None:
        self._reload_requested = False
        try:
            new = load_config(self._config_path)
            if new.nats != self.config.nats or new.spool != self.config.spool:
                log.warning("reload: [nats] and [spool] changes take effect at restart")
            old_collection = self.collection
            self._apply(new)
            if self._bmc_proxy is not None:
                self._bmc_proxy.reload(new)
            elif new.bmc:
                log.warning("reload: a first [[bmc]] target takes effect at restart")
        except (ConfigError, UnknownCollectorError) as exc:
            log.error("reload rejected, keeping the running config: %s", exc)
            notify(f"STATUS=config reload rejected: {exc}", self._env)
            return
        asyncio.get_running_loop().create_task(old_collection.close())
        log.info("config reloaded from %s", self._config_path)

    async def _start_metrics(self) -> MetricsServer | None:
        """``[metrics] listen``: serve GET /metrics (a bind failure is logged, not fatal)."""
        listen = self.config.metrics.listen
        if not listen:
            return None
        from metalguard.agent.metrics import MetricsServer  # aiohttp.web: only when serving

        server = MetricsServer(listen, self._publisher.stats)
        try:
            await server.start()
        except OSError as exc:
            log.error("metrics: cannot listen on %s: %s", listen, exc)
            return None
        return server

    # --- main loop --------------------------------------------------------------------
    async def run(self) -> int:
        """Run until stopped; return the exit status."""
        await self._publisher.start()
        metrics = await self._start_metrics()
        sources = self._start_event_sources()
        sources += self._start_qos()
        sources += await self._start_workload()
        await self._start_bmc_proxy()
        watchdog = watchdog_interval_s(self._env)
        dog = asyncio.create_task(self._watchdog(watchdog), name="watchdog") if watchdog else None
        notify("READY=1", self._env)
        notify(f"STATUS=collecting {', '.join(self.collection.names)}", self._env)
        previous: TelemetryBatch | None = None
        next_batch = self._mono()
        try:
            while not self._stop.is_set():
                if self._reload_requested:
                    self._reload()
                started = self._wall()
                cycle = await self.collection.run_cycle()
                await self._check_dcqcn(cycle)
                snapshot = build_batch(
                    self.identity,
                    self._seq.last + 1,
                    cycle,
                    ts=self._wall(),
                    started_ts=started,
                    interval_s=self.config.collect.interval_s,
                )
                for event in detect_events(previous, snapshot, new_id=_new_event_id):
                    await self._publisher.publish_event(event)
                previous = snapshot
                self._gpus = snapshot.gpu or self._gpus
                if self._mono() >= next_batch:
                    next_batch = self._mono() + self.config.collect.interval_s
                    batch = build_batch(
                        self.identity,
                        await asyncio.to_thread(self._seq.next),
                        cycle,
                        ts=snapshot.ts,
                        started_ts=started,
                        interval_s=self.config.collect.interval_s,
                        spool_dropped=self._publisher.take_dropped(),
                        qos=self._qos_status(),
                        topology=self.config.node.topology(),
                        kmsg=self._kmsg.counts() if self._kmsg is not None else None,
                    )
                    await self._publisher.publish_batch(batch)
                self._last_progress = self._mono()
                self._status()
                self._wake.clear()
                await wait_event(self._wake, self.collection.tick_s)
        finally:
            notify("STOPPING=1", self._env)
            if metrics is not None:
                await metrics.stop()
            if dog is not None:
                dog.cancel()
                await asyncio.gather(dog, return_exceptions=True)
            for task in sources:
                task.cancel()
            await asyncio.gather(*sources, return_exceptions=True)
            if self._workload is not None:  # workloads stop with the agent (docs/workloads.md)
                try:
                    await self._workload.close()
                except Exception:
                    log.exception("stopping the workloads failed")
            await self.collection.close()
            await asyncio.gather(
                self._publisher.close(flush_timeout=FLUSH_TIMEOUT_S),
                *([self._bmc_proxy.close(FLUSH_TIMEOUT_S)] if self._bmc_proxy else []),
            )
        return 0

    # --- workloads (docs/workloads.md) ---------------------------------------------------
    def abandon_workloads(self) -> None:
        """Act out a dead node in a simulated fleet: SIGKILL this agent's workloads at once
        and report nothing about them (call before ``request_stop``)."""
        if self._workload is not None:
            self._workload.runner.abandon()

    async def _start_workload(self) -> list[asyncio.Task[None]]:
        """With ``[workload] enabled``, run jobs and answer the workload commands;
        ``[workload]`` changes take effect at restart."""
        if not self.config.workload.enabled:
            return []
        from metalguard.agent.workload.service import WorkloadService, dataset_dirs

        workload = WorkloadService(
            self.config.workload,
            lambda: self.identity,
            self._publisher.publish_event,
            self._publisher.connection.settings,
            self._publisher.subjects,
            wall_clock=self._wall,
            datasets=lambda: dataset_dirs(self.config.cache),
            xids=self.xids,
            on_gpu_reset=self.expedite_gpu,
        )
        try:
            await workload.start()
        except OSError as exc:
            log.error("workloads disabled: cannot open %s: %s", self.config.workload.socket, exc)
            return []
        self._workload = workload
        return [self._guarded(workload.run(), "workload")]

    # --- bmc-proxy (docs/bmc.md) --------------------------------------------------------
    async def _start_bmc_proxy(self) -> None:
        """With ``[[bmc]]`` targets, poll them and publish for their nodes (out of band)."""
        if not self.config.bmc:
            return
        from metalguard.agent.bmc.proxy import ProxyService

        self._bmc_proxy = ProxyService(self.config, self.identity.node)
        await self._bmc_proxy.start()

    # --- event sources (docs/collectors-udev-gpu.md) ------------------------------------
    async def _emit(self, event: NodeEvent) -> None:
        """The event path of the sources: published at once, not at the next batch."""
        await self._publisher.publish_event(event)

    async def _emit_uevent(self, event: NodeEvent) -> None:
        """A uevent: the collectors reading its device class run now, in a cycle of
        their own (``udev.REFRESH``), and the event is published at once."""
        from metalguard.agent.collectors.udev import refresh_for

        if self.collection.expedite(refresh_for(event)):
            self._wake.set()
        await self._emit(event)

    async def _emit_xid(self, event: NodeEvent) -> None:
        """An XID is published at once, and the gpu collector reads its GPU again in the
        next cycle (the XID is in that reading's ``xid_errors``)."""
        self.expedite_gpu()
        await self._emit(event)

    def expedite_gpu(self) -> None:
        """Read the GPUs in the next cycle (an XID came, or a GPU was reset)."""
        if self.collection.expedite(("gpu",)):
            self._wake.set()

    def _start_event_sources(self) -> list[asyncio.Task[None]]:
        """Start the uevent monitor and the GPU XID watcher as configured.  The monitor's
        socket is opened here, before READY=1, so no uevent after READY is missed;
        ``[events]`` changes take effect at restart."""
        events = self.config.events
        tasks: list[asyncio.Task[None]] = []
        if events.udev_on(self.config.collect):
            from metalguard.agent.collectors.udev import UdevMonitor, open_kernel_monitor

            monitor = UdevMonitor(
                lambda: self.identity,
                subsystems=events.udev_subsystems,
                clock=self._wall,
                opener=self._udev_opener or open_kernel_monitor,
            )
            monitor.open()
            tasks.append(self._guarded(monitor.run(self._emit_uevent), "udev"))
        kmsg = self._open_kmsg()
        if kmsg is not None:
            tasks.append(self._guarded(kmsg.run(), "kmsg"))
        if events.gpu_xid and "gpu" in self.collection.names:
            from metalguard.agent.collectors.gpu import XidWatcher

            watcher = XidWatcher(
                lambda: self.identity, nvml=self._nvml, xids=self.xids, clock=self._wall
            )
            tasks.append(self._guarded(watcher.run(self._emit_xid), "gpu-xid"))
        return tasks

    def _kernel_xid(self, pci: str, xid: int, ts: float) -> None:
        """An XID the kernel log names: into the XID ledger for the GPU at that address
        (as NVML's gpu collector last read it; one report with NVML's own), and a GPU
        reading in the next cycle. Without a reading of that GPU (NVML down) the event
        alone carries it."""
        index = gpu_index(pci, self._gpus)
        if index is not None and self.xids.record(index, xid, ts, source="kmsg"):
            self.expedite_gpu()

    def _oom_killed(self, pid: int, ts: float) -> None:
        """The kernel's OOM killer killed ``pid``: the workload runner's to know."""
        if self._workload is not None:
            self._workload.runner.note_oom_kill(pid, ts)

    @property
    def workload(self) -> WorkloadService | None:
        """The workload runner and its command handler (None: ``[workload]`` is off)."""
        return self._workload

    def _open_kmsg(self) -> KmsgSource | None:
        """The kernel log monitor as ``[kmsg]`` says (docs/kmsg.md), its log opened now,
        before READY=1; None when it is off or the log cannot be read (logged)."""
        section = self.config.kmsg
        if not section.on(self.config.collect):
            return None
        from metalguard.agent.kmsg.journal import JOURNAL_STATE
        from metalguard.agent.kmsg.rules import RulesError, merged
        from metalguard.agent.kmsg.source import (
            CURSOR,
            PSTORE_STATE,
            KmsgSource,
            load_user_rules,
        )

        try:
            user = load_user_rules(section.rules)
        except RulesError as exc:
            log.error("kmsg: %s; using the shipped rules only", exc)
            user = []
        own_log = Path(section.path).is_char_device()
        source = KmsgSource(
            lambda: self.identity,
            self._emit,
            Path(section.path),
            rules=merged(user),
            cursor_path=Path(self.config.spool.dir) / CURSOR,
            backfill_s=section.backfill_s,
            storm_window_s=section.storm_window_s,
            trust_user=section.trust_user_records,
            clock=self._wall,
            on_oom_kill=self._oom_killed,
            on_xid=self._kernel_xid,
            # the previous boot is the machine's own: not read for a simulated node's log
            pstore=tuple(Path(p) for p in section.pstore) if own_log else (),
            pstore_state=Path(self.config.spool.dir) / PSTORE_STATE,
            journalctl=section.journalctl if own_log else "",
            journal_state=Path(self.config.spool.dir) / JOURNAL_STATE,
        )
        try:
            source.reader.open()
        except OSError as exc:
            log.error("kmsg: cannot read %s (%s): the kernel log monitor is off", section.path, exc)
            return None
        self._kmsg = source
        return source

    def _guarded(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A background task whose death is logged, never silently lost."""

        async def guard() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event source %s died", name)

        return asyncio.create_task(guard(), name=name)

    # --- flow control (docs/qos.md) ----------------------------------------------------
    def _qos_status(self) -> tuple[QosInterfaceStatus, ...]:
        """The reconciler's last verdict per interface, for the batch (none when off)."""
        reconciler = self._qos_reconciler
        return () if reconciler is None else reconciler.verdicts()

    async def _check_dcqcn(self, cycle: CycleResult) -> None:
        """Hand the reconciler this cycle's RDMA ports when the rdma collector read them
        afresh (its DCQCN check compares successive readings, docs/qos.md)."""
        reconciler = self._qos_reconciler
        if reconciler is None:
            return
        if not any(run.collector == RDMA_COLLECTOR and run.success for run in cycle.runs):
            return
        ports = [p for p in cycle.readings.get("rdma", ()) if isinstance(p, RdmaPort)]
        try:
            await reconciler.observe_rdma(ports)
        except Exception:  # a bug in the check must not stop the collection loop
            log.exception("DCQCN counter check failed")

    def _start_qos(self) -> list[asyncio.Task[None]]:
        """Start the QoS profile watcher and reconciler when ``[qos] enabled``; ``[qos]``
        changes take effect at restart."""
        qos = self.config.qos
        if not qos.enabled:
            return []
        from metalguard.agent.qos.apply import QosTarget
        from metalguard.agent.qos.reconciler import QosReconciler
        from metalguard.agent.qos.watch import ProfileWatcher

        reconciler = self._qos_reconciler = QosReconciler(
            self.identity,
            self._publisher.publish_event,
            target=QosTarget(netns=qos.netns or None, sysfs=qos.sysfs or self.config.collect.sysfs),
            interfaces=qos.interfaces,
            interval_s=qos.reconcile_interval_s,
            wall_clock=self._wall,
        )
        watcher = ProfileWatcher(
            self._publisher.subjects, self.identity.cluster, self.identity.node, reconciler
        )
        connection = self._publisher.connection

        async def get_js() -> JetStreamContext:
            while True:
                await connection.wait_connected()
                if connection.js is not None:
                    return connection.js
                await asyncio.sleep(0.1)  # connected, JetStream context not set yet

        return [
            asyncio.create_task(reconciler.run(), name="qos-reconciler"),
            self._guarded(watcher.run(get_js), "qos-watch"),
        ]

    def _status(self) -> None:
        stats = self._publisher.stats()
        link = "connected" if stats.connected else "DISCONNECTED (spooling)"
        notify(
            f"STATUS=seq {self._seq.last}; NATS {link}; published {stats.published}, "
            f"spooled {stats.spooled}, dropped {stats.dropped}",
            self._env,
        )

    async def _watchdog(self, every_s: float) -> None:
        """Ping the systemd watchdog while the main loop keeps making progress."""
        stall_limit = max(3 * self.collection.tick_s, 2 * every_s) + self.config.collect.timeout_s
        while True:
            if self._mono() - self._last_progress <= stall_limit:
                notify("WATCHDOG=1", self._env)
            else:
                log.error(
                    "main loop stalled for %.0fs; withholding watchdog ping",
                    self._mono() - self._last_progress,
                )
            await asyncio.sleep(every_s)


async def _serve(config_path: Path) -> int:
    try:
        config = load_config(config_path)
        service = AgentService(config_path, config)
    except (ConfigError, UnknownCollectorError) as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    except (SpoolError, ValueError, OSError) as exc:  # locked spool, unusable TLS files
        print(f"metalguard: cannot start the agent: {exc}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, service.request_stop)
    loop.add_signal_handler(signal.SIGINT, service.request_stop)
    loop.add_signal_handler(signal.SIGHUP, service.request_reload)
    return await service.run()


def main_run(config_path: Path) -> int:
    """CLI body of ``agent run``."""
    return asyncio.run(_serve(config_path))
