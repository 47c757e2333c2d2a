"""A stand-in for nvidia-ml-py's ``pynvml`` over a simulated node's GPU files
(:mod:`demo.sim.gpus`): the agent's gpu collector and XID watcher take it as their
``nvml`` (``AgentService(nvml=...)``), so a simulated fleet exercises the real NVML path.

Only what the agent calls is here, with pynvml's names, argument order and return shapes;
the state is read again whenever ``state.json`` changed. NVLink is not simulated (no
active links); the PCIe link always runs at its maximum (a downgrade is the sysfs
fault's). ``nvmlEventSetWait`` polls the ``xids`` file until its timeout.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metalguard.demo.sim.gpus import STATE, XIDS, read_state

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_TIMEOUT = 10
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
nvmlEventTypeXidCriticalError = 0x8  # noqa: N816 (pynvml's name)
POLL_S = 0.2
"""How often the event wait looks for new XIDs."""
PCIE_GEN = 5
PCIE_WIDTH = 16


class NVMLError(Exception):
    """Like pynvml.NVMLError: the NVML return code as ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 10: "Timeout"}.get(self.value, f"NVML error {self.value}")


@dataclass(frozen=True, slots=True)
class Handle:
    """A device handle: the GPU's index."""

    index: int


@dataclass(frozen=True, slots=True)
class PciInfo:
    """What ``nvmlDeviceGetPciInfo`` returns (only ``busId`` is read)."""

    busId: str  # noqa: N815 (pynvml's name)


@dataclass(frozen=True, slots=True)
class EventData:
    """What ``nvmlEventSetWait`` returns."""

    device: Handle
    eventData: int  # noqa: N815 (pynvml's name)


class SimNvml:
    """The NVML of one simulated node, over its ``nvml/`` directory."""

    NVMLError = NVMLError

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._gpus: list[dict[str, Any]] = []
        self._seen = -1
        self._offset = 0
        self._lock = threading.Lock()

    # --- state ------------------------------------------------------------------------
    def _state(self) -> list[dict[str, Any]]:
        try:
            mtime = os.stat(self.directory / STATE).st_mtime_ns
        except FileNotFoundError:
            return []
        with self._lock:
            if mtime != self._seen:
                self._gpus, self._seen = read_state(self.directory), mtime
            return self._gpus

    def _gpu(self, handle: Handle) -> dict[str, Any]:
        gpus = self._state()
        if not 0 <= handle.index < len(gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpus[handle.index]

    # --- the calls --------------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names below too)
        """Start reading XIDs from the end of what is there."""
        try:
            self._offset = (self.directory / XIDS).stat().st_size
        except FileNotFoundError:
            self._offset = 0

    def nvmlShutdown(self) -> None:  # noqa: N802
        return None

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self._state())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:  # noqa: N802
        handle = Handle(index)
        self._gpu(handle)
        return handle

    def nvmlDeviceGetName(self, handle: Handle) -> str:  # noqa: N802
        return str(self._gpu(handle)["name"])

    def nvmlDeviceGetUUID(self, handle: Handle) -> str:  # noqa: N802
        return str(self._gpu(handle)["uuid"])

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> PciInfo:  # noqa: N802
        return PciInfo(str(self._gpu(handle)["bus_id"]))

    def nvmlDeviceGetTemperature(self, handle: Handle, _sensor: int) -> int:  # noqa: N802
        return int(self._gpu(handle)["temperature"])

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:  # noqa: N802
        return int(self._gpu(handle)["power_mw"])

    def nvmlDeviceGetTotalEccErrors(  # noqa: N802
        self, handle: Handle, error_type: int, _counter_type: int
    ) -> int:
        gpu = self._gpu(handle)
        corrected = error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED
        return int(gpu["ecc_sbe_volatile"] if corrected else gpu["ecc_dbe_volatile"])

    def nvmlDeviceGetRetiredPages(self, handle: Handle, _cause: int) -> list[int]:  # noqa: N802
        self._gpu(handle)
        return []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Handle) -> int:  # noqa: N802
        return int(self._gpu(handle)["retired_pending"])

    def nvmlDeviceGetRemappedRows(self, handle: Handle) -> tuple[int, int, int, int]:  # noqa: N802
        gpu = self._gpu(handle)
        return (0, 0, int(gpu["remap_pending"]), int(gpu["remap_failure"]))

    def nvmlDeviceGetPcieReplayCounter(self, handle: Handle) -> int:  # noqa: N802
        self._gpu(handle)
        return 0

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Handle) -> int:  # noqa: N802
        self._gpu(handle)
        return PCIE_GEN

    nvmlDeviceGetMaxPcieLinkGeneration = nvmlDeviceGetCurrPcieLinkGeneration  # noqa: N815

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Handle) -> int:  # noqa: N802
        self._gpu(handle)
        return PCIE_WIDTH

    nvmlDeviceGetMaxPcieLinkWidth = nvmlDeviceGetCurrPcieLinkWidth  # noqa: N815

    def nvmlDeviceGetNvLinkState(self, handle: Handle, _link: int) -> int:  # noqa: N802
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Handle) -> int:  # noqa: N802
        self._gpu(handle)
        return 0

    # --- XID events ---------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> list[EventData]:  # noqa: N802
        return []

    def nvmlDeviceRegisterEvents(  # noqa: N802
        self, handle: Handle, _mask: int, _event_set: list[EventData]
    ) -> None:
        self._gpu(handle)

    def nvmlEventSetFree(self, _event_set: list[EventData]) -> None:  # noqa: N802
        return None

    def nvmlEventSetWait(self, event_set: list[EventData], timeout_ms: int) -> EventData:  # noqa: N802
        """The next XID (read from ``xids``), else NVMLError(timeout) after ``timeout_ms``."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if not event_set:
                event_set.extend(self._new_xids())
            if event_set:
                return event_set.pop(0)
            if time.monotonic() >= deadline:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            time.sleep(POLL_S)

    def _new_xids(self) -> list[EventData]:
        try:
            with (self.directory / XIDS).open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        found = []
        for line in complete.decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and all(p.isdigit() for p in parts):
                found.append(EventData(Handle(int(parts[0])), int(parts[1])))
        return found
