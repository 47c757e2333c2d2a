"""gpu collector: NVIDIA GPU health through NVML (nvidia-ml-py, extra ``gpu``).

Two parts share one NVML binding, given as ``nvml`` (the ``pynvml`` module by default;
tests pass a fake with the same function names and constants):

- :class:`GpuCollector` reads every GPU on the collector's interval: ECC counts,
  retired pages, row remapping, PCIe replays and link state, NVLink error counters,
  temperature, power and clock throttle reasons (``TelemetryBatch.gpu``).  Counter
  growth and new bad states become NodeEvents through ``agent.events.detect_events``.
- :class:`XidWatcher` blocks (in a thread) on an NVML event set and publishes every XID
  critical error as a ``gpu_xid`` NodeEvent the moment the driver reports it.

Without nvidia-ml-py or libnvidia-ml.so the collector logs why once and stays off with
no error entry (a node without NVIDIA's stack); with a driver that will not initialise
it also puts one error entry in the next batch.  Either way it never retries until the
agent restarts or reloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.agent.collectors.gpu_parse import (
    NvmlValues,
    gpu_device,
    pci_address,
    text,
    xid_event,
)
from metalguard.agent.collectors.gpu_xids import XidLedger
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.telemetry import CollectorError

log = logging.getLogger(__name__)

Nvml = Any
"""The ``pynvml`` module, or an object with the same names (tests)."""

EmitEvent = Callable[[NodeEvent], Awaitable[None]]

NVLINK_COUNTERS = (
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY", 0),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY", 1),
    ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2),
    ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA", 3),
)
XID_EVENT_MASK = 0x8
"""nvmlEventTypeXidCriticalError."""
WAIT_MS = 1000
"""How long one nvmlEventSetWait blocks; also the longest a stop waits for it."""


class NvmlUnavailableError(Exception):
    """NVML cannot be used here; ``quiet`` when this node simply has no NVIDIA stack."""

    def __init__(self, reason: str, *, quiet: bool) -> None:
        super().__init__(reason)
        self.quiet = quiet


def import_nvml() -> Nvml:
    """The ``pynvml`` module of nvidia-ml-py; NvmlUnavailableError (quiet) if absent."""
    try:
        import pynvml  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError as exc:
        raise NvmlUnavailableError(
            f"nvidia-ml-py is not installed ({exc}); install metalguard[gpu]", quiet=True
        ) from None
    return pynvml


def _code(nvml: Nvml, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    return value if isinstance(value, int) else default


def open_nvml(nvml: Nvml) -> None:
    """``nvmlInit``; NvmlUnavailableError saying why (quiet when libnvidia-ml is missing)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        missing = code == _code(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12)
        reason = "no NVIDIA driver library (libnvidia-ml.so.1)" if missing else "NVML init"
        raise NvmlUnavailableError(f"{reason}: {exc}", quiet=missing) from None
    except OSError as exc:
        raise NvmlUnavailableError(f"NVML init: {exc}", quiet=False) from None


class _Reader:
    """NVML calls of one GPU; unsupported calls give None, failures are noted."""

    def __init__(self, nvml: Nvml, index: int) -> None:
        self.nvml = nvml
        self.index = index
        self.issues: list[str] = []
        self._silent = {
            _code(nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
            _code(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),
            _code(nvml, "NVML_ERROR_NO_DATA", 21),
        }

    def call(self, what: str, fn_name: str, *args: Any, quiet: bool = False) -> Any:
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            if not quiet and getattr(exc, "value", None) not in self._silent:
                self.issues.append(f"{what}: {exc}")
            return None


def read_gpu(nvml: Nvml, index: int) -> tuple[NvmlValues | None, list[str]]:
    """Every value of GPU ``index``; None when not even its handle can be had."""
    r = _Reader(nvml, index)
    handle = r.call("handle", "nvmlDeviceGetHandleByIndex", index)
    if handle is None:
        return None, r.issues or ["no handle"]
    n = nvml
    corrected = _code(n, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    uncorrected = _code(n, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    volatile = _code(n, "NVML_VOLATILE_ECC", 0)
    aggregate = _code(n, "NVML_AGGREGATE_ECC", 1)
    ecc = "nvmlDeviceGetTotalEccErrors"
    name = r.call("name", "nvmlDeviceGetName", handle)
    uuid_ = r.call("uuid", "nvmlDeviceGetUUID", handle)
    pci = r.call("pci info", "nvmlDeviceGetPciInfo", handle)
    temp = r.call(
        "temperature", "nvmlDeviceGetTemperature", handle, _code(n, "NVML_TEMPERATURE_GPU", 0)
    )
    sbe_pages = r.call(
        "retired pages",
        "nvmlDeviceGetRetiredPages",
        handle,
        _code(n, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0),
    )
    dbe_pages = r.call(
        "retired pages",
        "nvmlDeviceGetRetiredPages",
        handle,
        _code(n, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1),
    )
    pending = r.call("retired pages pending", "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    rows = r.call("remapped rows", "nvmlDeviceGetRemappedRows", handle)
    throttle_fn = (
        "nvmlDeviceGetCurrentClocksEventReasons"
        if hasattr(n, "nvmlDeviceGetCurrentClocksEventReasons")
        else "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    values = NvmlValues(
        index=index,
        uuid=text(uuid_) if uuid_ is not None else "",
        name=text(name) if name is not None else "",
        pci_address=pci_address(text(pci.busId)) if pci is not None else "",
        temperature_c=float(temp) if temp is not None else None,
        power_mw=r.call("power", "nvmlDeviceGetPowerUsage", handle),
        ecc_sbe_volatile=r.call("ecc", ecc, handle, corrected, volatile),
        ecc_dbe_volatile=r.call("ecc", ecc, handle, uncorrected, volatile),
        ecc_sbe_aggregate=r.call("ecc", ecc, handle, corrected, aggregate),
        ecc_dbe_aggregate=r.call("ecc", ecc, handle, uncorrected, aggregate),
        retired_pages_sbe=len(sbe_pages) if sbe_pages is not None else None,
        retired_pages_dbe=len(dbe_pages) if dbe_pages is not None else None,
        retired_pages_pending=bool(pending) if pending is not None else None,
        remapped_rows=tuple(int(x) for x in rows) if rows is not None else None,  # type: ignore[arg-type]
        pcie_replay_count=r.call("pcie replays", "nvmlDeviceGetPcieReplayCounter", handle),
        pcie_link_gen=r.call("pcie", "nvmlDeviceGetCurrPcieLinkGeneration", handle),
        pcie_link_gen_max=r.call("pcie", "nvmlDeviceGetMaxPcieLinkGeneration", handle),
        pcie_link_width=r.call("pcie", "nvmlDeviceGetCurrPcieLinkWidth", handle),
        pcie_link_width_max=r.call("pcie", "nvmlDeviceGetMaxPcieLinkWidth", handle),
        nvlinks=_nvlinks(r, handle),
        throttle_mask=r.call("throttle reasons", throttle_fn, handle),
    )
    return values, r.issues


def _nvlinks(r: _Reader, handle: Any) -> dict[int, dict[str, int | None]]:
    """Error counters of every active NVLink (absent links are silently skipped)."""
    links: dict[int, dict[str, int | None]] = {}
    for link in range(_code(r.nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = r.call("nvlink state", "nvmlDeviceGetNvLinkState", handle, link, quiet=True)
        if not state:
            continue
        links[link] = {
            key: r.call(
                f"nvlink{link} {key}",
                "nvmlDeviceGetNvLinkErrorCounter",
                handle,
                link,
                _code(r.nvml, const, default),
            )
            for key, const, default in NVLINK_COUNTERS
        }
    return links


@register("gpu", default_interval_s=5)
class GpuCollector:
    """Per-GPU NVML readings; off (reported once) without a driver or nvidia-ml-py."""

    name = "gpu"
    field: BatchField = "gpu"

    def __init__(
        self,
        settings: CollectorSettings | None = None,
        *,
        nvml: Nvml = None,
        xids: XidLedger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._nvml: Nvml = nvml if nvml is not None else (settings.nvml if settings else None)
        self._xids = xids if xids is not None else (settings.xid_ledger if settings else None)
        """The XIDs the agent's watcher heard, reported per GPU (``xid_errors``)."""
        self._clock = clock
        self._state = "new"  # new -> on | off

    async def collect(self) -> Collected:
        """Read every GPU once (off the event loop)."""
        return await asyncio.to_thread(self._collect)

    def _start(self) -> Collected | None:
        """Initialise NVML; the (once-only) result to return when it cannot be."""
        try:
            if self._nvml is None:
                self._nvml = import_nvml()
            open_nvml(self._nvml)
        except NvmlUnavailableError as exc:
            self._state = "off"
            log.warning("gpu collector off: %s", exc)
            if exc.quiet:
                return Collected(field=self.field)
            return Collected(
                field=self.field,
                errors=(CollectorError(collector=self.name, message=f"off: {exc}"),),
            )
        self._state = "on"
        return None

    def _collect(self) -> Collected:
        if self._state == "off":
            return Collected(field=self.field)
        if self._state == "new" and (stopped := self._start()) is not None:
            return stopped
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            err = CollectorError(collector=self.name, message=f"device count: {exc}")
            return Collected(field=self.field, errors=(err,))
        items: list[object] = []
        errors: list[CollectorError] = []
        now = self._clock()
        for index in range(count):
            values, issues = read_gpu(nvml, index)
            if values is not None:
                xids = self._xids.xids(index, now) if self._xids is not None else ()
                items.append(gpu_device(values, xids))
            errors.extend(
                CollectorError(collector=self.name, path=f"gpu{index}", message=issue)
                for issue in issues
            )
        return Collected(field=self.field, items=tuple(items), errors=tuple(errors))


def _new_id() -> str:
    return uuid.uuid4().hex


def _handle_key(handle: Any) -> object:
    """A hashable key for an NVML device handle (ctypes pointers compare by identity)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        pass
    try:
        hash(handle)
    except TypeError:
        return id(handle)
    return handle


class XidWatcher:
    """Publishes every XID critical error of every GPU at once, as ``gpu_xid``, and
    records it in ``xids`` (the gpu collector reports it in the GPU's next reading)."""

    def __init__(
        self,
        identity: Callable[[], NodeIdentity],
        *,
        nvml: Nvml = None,
        xids: XidLedger | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = _new_id,
        wait_ms: int = WAIT_MS,
    ) -> None:
        self._identity = identity
        self._nvml = nvml
        self._xids = xids
        self._clock = clock
        self._new_id = new_id
        self._wait_ms = wait_ms
        self.registered: dict[object, tuple[int, str, str]] = {}
        """Handle key -> (index, uuid, pci address) of every GPU watched."""

    async def run(self, emit: EmitEvent) -> None:
        """Wait for XIDs until cancelled; returns at once when NVML is unusable (the
        gpu collector reports why)."""
        try:
            nvml = self._nvml if self._nvml is not None else import_nvml()
            await asyncio.to_thread(open_nvml, nvml)
        except NvmlUnavailableError as exc:
            log.info("XID watcher off: %s", exc)
            return
        event_set = None
        # its own thread: the blocking wait never holds one of the loop's shared workers
        # (the collectors' reads run there; a simulated fleet runs many watchers at once)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xid-watch")
        try:
            event_set = await asyncio.to_thread(self._register, nvml)
            if not self.registered:
                log.warning("XID watcher off: no GPU supports XID events")
                return
            while True:
                data = await self._wait(pool, nvml, event_set)
                if data is not None:
                    await emit(self._event(nvml, data))
        finally:
            pool.shutdown(wait=False)
            with contextlib.suppress(Exception):
                if event_set is not None:
                    nvml.nvmlEventSetFree(event_set)
                nvml.nvmlShutdown()

    def _register(self, nvml: Nvml) -> Any:
        event_set = nvml.nvmlEventSetCreate()
        mask = getattr(nvml, "nvmlEventTypeXidCriticalError", XID_EVENT_MASK)
        for index in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
            except nvml.NVMLError as exc:
                log.warning("XID events of gpu%d not watched: %s", index, exc)
                continue
            values, _ = read_gpu_identity(nvml, handle)
            self.registered[_handle_key(handle)] = (index, *values)
        return event_set

    async def _wait(self, pool: ThreadPoolExecutor, nvml: Nvml, event_set: Any) -> Any:
        """One bounded nvmlEventSetWait in ``pool``; a cancel waits for it to return."""
        loop = asyncio.get_running_loop()
        task = loop.run_in_executor(pool, self._wait_sync, nvml, event_set)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await task
            raise

    def _wait_sync(self, nvml: Nvml, event_set: Any) -> Any:
        try:
            return nvml.nvmlEventSetWait(event_set, self._wait_ms)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) != _code(nvml, "NVML_ERROR_TIMEOUT", 10):
                log.warning("nvmlEventSetWait: %s", exc)
                time.sleep(self._wait_ms / 1000)  # a broken event set must not spin
            return None

    def _event(self, nvml: Nvml, data: Any) -> NodeEvent:
        found = self.registered.get(_handle_key(data.device))
        index, uuid_, pci = found if found else (None, "", "")
        ts = self._clock()
        xid = int(data.eventData)
        if self._xids is not None and index is not None:
            self._xids.record(index, xid, ts)
        return xid_event(
            xid,
            node=self._identity(),
            ts=ts,
            event_id=self._new_id(),
            gpu_index=index,
            uuid=uuid_,
            pci_address=pci,
        )


def read_gpu_identity(nvml: Nvml, handle: Any) -> tuple[tuple[str, str], list[str]]:
    """(uuid, pci address) of a GPU handle, empty strings where NVML will not say."""
    r = _Reader(nvml, -1)
    uuid_ = r.call("uuid", "nvmlDeviceGetUUID", handle)
    pci = r.call("pci info", "nvmlDeviceGetPciInfo", handle)
    return (
        text(uuid_) if uuid_ is not None else "",
        pci_address(text(pci.busId)) if pci is not None else "",
    ), r.issues
