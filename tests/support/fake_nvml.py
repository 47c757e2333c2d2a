"""A stand-in for nvidia-ml-py's ``pynvml`` module, for a machine without a GPU.

:class:`FakeNvml` has the function names, constants and ``NVMLError`` (with ``.value``
and subclasses chosen by code) of the real binding, with the same signatures and return
shapes; the collector takes it through its ``nvml`` parameter.  Tests set each GPU's
state in :class:`FakeGpu` and push XIDs with :meth:`FakeNvml.raise_xid`.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any


class NVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code as ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return ERROR_STRINGS.get(self.value, f"NVML error {self.value}")


NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_NO_DATA = 21

ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
}


@dataclass
class FakeGpu:
    """One GPU's state, in NVML's units (mW, counts, link gen/width)."""

    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = "00000000:18:00.0"
    temperature: int = 41
    power_mw: int = 72_500
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    """(error type, counter type) -> count."""
    retired: dict[int, list[int]] = field(default_factory=dict)
    """cause -> page addresses."""
    retired_pending: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    pcie_replays: int = 0
    link_gen: int = 5
    link_gen_max: int = 5
    link_width: int = 16
    link_width_max: int = 16
    nvlinks: dict[int, dict[int, int]] = field(default_factory=dict)
    """Active link -> {counter: count}."""
    throttle: int = 0
    lost: bool = False
    supports_xid: bool = True


@dataclass(frozen=True)
class Handle:
    """An opaque device handle (pynvml hands out ctypes pointers)."""

    index: int


@dataclass
class EventData:
    """Like pynvml.c_nvmlEventData_t."""

    device: Any
    eventType: int  # noqa: N815 - NVML's field name
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


@dataclass
class PciInfo:
    """Like pynvml.nvmlPciInfo_t (only what the collector reads)."""

    busId: str  # noqa: N815


class FakeNvml:
    """The pynvml names the collector uses, over a list of :class:`FakeGpu`."""

    NVMLError = NVMLError
    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_NO_DATA = NVML_ERROR_NO_DATA
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    NVML_FEATURE_DISABLED = 0
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_NVLINK_ERROR_DL_REPLAY = 0
    NVML_NVLINK_ERROR_DL_RECOVERY = 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    NVML_NVLINK_ERROR_DL_CRC_DATA = 3
    nvmlEventTypeSingleBitEccError = 0x1  # noqa: N815
    nvmlEventTypeDoubleBitEccError = 0x2  # noqa: N815
    nvmlEventTypeXidCriticalError = 0x8  # noqa: N815
    nvmlClocksThrottleReasonGpuIdle = 0x1  # noqa: N815
    nvmlClocksThrottleReasonSwPowerCap = 0x4  # noqa: N815
    nvmlClocksThrottleReasonHwThermalSlowdown = 0x40  # noqa: N815

    def __init__(self, gpus: list[FakeGpu] | None = None, *, init_error: int = 0) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.init_error = init_error
        self.initialised = 0
        self.calls: list[str] = []
        self._events: queue.Queue[EventData] = queue.Queue()
        self._event_sets: dict[int, set[int]] = {}

    # --- what a test does -----------------------------------------------------------
    def raise_xid(self, index: int, xid: int) -> None:
        """The driver reports XID ``xid`` on GPU ``index`` (as in dmesg's NVRM: Xid)."""
        self._events.put(EventData(Handle(index), self.nvmlEventTypeXidCriticalError, xid))

    # --- the binding ----------------------------------------------------------------
    def _gpu(self, handle: Handle) -> FakeGpu:
        self._check_init()
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _check_init(self) -> None:
        if self.initialised <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.calls.append("nvmlInit")
        if self.init_error:
            raise NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls.append("nvmlShutdown")
        self._check_init()
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:  # noqa: N802
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return Handle(index)

    def nvmlDeviceGetName(self, handle: Handle) -> str:  # noqa: N802
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: Handle) -> bytes:  # noqa: N802
        return self._gpu(handle).uuid.encode()  # older bindings return bytes

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> PciInfo:  # noqa: N802
        return PciInfo(self._gpu(handle).bus_id)

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:  # noqa: N802
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(handle).temperature

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:  # noqa: N802
        return self._gpu(handle).power_mw

    def nvmlDeviceGetTotalEccErrors(  # noqa: N802
        self, handle: Handle, error_type: int, counter_type: int
    ) -> int:
        return self._gpu(handle).ecc.get((error_type, counter_type), 0)

    def nvmlDeviceGetRetiredPages(self, handle: Handle, cause: int) -> list[int]:  # noqa: N802
        return list(self._gpu(handle).retired.get(cause, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Handle) -> int:  # noqa: N802
        return self._gpu(handle).retired_pending

    def nvmlDeviceGetRemappedRows(  # noqa: N802
        self, handle: Handle
    ) -> tuple[int, int, int, int]:
        return self._gpu(handle).remapped_rows

    def nvmlDeviceGetPcieReplayCounter(self, handle: Handle) -> int:  # noqa: N802
        return self._gpu(handle).pcie_replays

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Handle) -> int:  # noqa: N802
        return self._gpu(handle).link_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Handle) -> int:  # noqa: N802
        return self._gpu(handle).link_gen_max

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Handle) -> int:  # noqa: N802
        return self._gpu(handle).link_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Handle) -> int:  # noqa: N802
        return self._gpu(handle).link_width_max

    def nvmlDeviceGetNvLinkState(self, handle: Handle, link: int) -> int:  # noqa: N802
        gpu = self._gpu(handle)
        if not gpu.nvlinks:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self.NVML_FEATURE_ENABLED if link in gpu.nvlinks else self.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(  # noqa: N802
        self, handle: Handle, link: int, counter: int
    ) -> int:
        gpu = self._gpu(handle)
        if link not in gpu.nvlinks:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlinks[link].get(counter, 0)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Handle) -> int:  # noqa: N802
        return self._gpu(handle).throttle

    def nvmlDeviceGetIndex(self, handle: Handle) -> int:  # noqa: N802
        self._gpu(handle)
        return handle.index

    def nvmlEventSetCreate(self) -> int:  # noqa: N802
        self._check_init()
        key = len(self._event_sets) + 1
        self._event_sets[key] = set()
        return key

    def nvmlDeviceRegisterEvents(  # noqa: N802
        self, handle: Handle, event_types: int, event_set: int
    ) -> None:
        gpu = self._gpu(handle)
        if event_types & self.nvmlEventTypeXidCriticalError and not gpu.supports_xid:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        self._event_sets[event_set].add(handle.index)

    def nvmlEventSetWait(self, event_set: int, timeoutms: int) -> EventData:  # noqa: N802
        self._check_init()
        watched = self._event_sets[event_set]
        try:
            data = self._events.get(timeout=timeoutms / 1000)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None
        if data.device.index not in watched:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        return data

    def nvmlEventSetFree(self, event_set: int) -> None:  # noqa: N802
        self.calls.append("nvmlEventSetFree")
        del self._event_sets[event_set]
