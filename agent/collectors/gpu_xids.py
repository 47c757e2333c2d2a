"""The agent's memory of each GPU's XIDs, between the XID watcher that hears them and the
gpu collector that reports them (``GpuDevice.xid_errors``), until a GPU reset clears them.

An XID whose class a reset clears, or that needs a reboot (``reset_gpu``, ``decode``,
``reboot``), is kept until the GPU is reset (:meth:`XidLedger.clear`, the ``gpu_reset``
command) or the node reboots; any other XID is kept for ``window_s`` (24 h), so the
controller can count a storm of 92s without a week-old one costing the node forever. At
most ``keep`` XIDs per GPU, the newest. Thread-safe: the watcher records from its own
thread.

With a ``path`` the ledger is kept in a file (the agent's spool directory), written
atomically on every change, so an agent restart does not forget a GPU waiting for its
reset; a file written before the node's last boot (``boot_ts``, /proc/stat's ``btime``)
is dropped: a rebooted node's GPUs start clean. A file that cannot be read is logged and
ignored, one that cannot be written is logged (the ledger goes on in memory).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from metalguard.agent.statefile import write_json
from metalguard.proto.telemetry import GpuDevice
from metalguard.proto.xid import XidClass, classify

STICKY_CLASSES: Final[frozenset[XidClass]] = frozenset({"reset_gpu", "decode", "reboot"})
"""Classes kept until the GPU is reset (or the node rebooted), whatever their age."""
WINDOW_S: Final = 86_400.0
KEEP: Final = 64
SAME_REPORT_S: Final = 5.0
"""Two reports of one XID on one GPU this close are one (NVML's and the kernel log's)."""
XID_LEDGER: Final = "xids.json"
"""The ledger's file name in the agent's spool directory."""
BOOT_SLACK_S: Final = 2.0
"""``btime`` is whole seconds and may move a little (NTP): a file's boot within this is
the same boot."""

log = logging.getLogger(__name__)


def _entry(raw: list[object]) -> tuple[float, int, str]:
    """One saved entry: ``[ts, xid, source]`` (a file of before sources: ``nvml``)."""
    ts, xid = raw[0], raw[1]
    if not isinstance(ts, int | float) or not isinstance(xid, int):
        raise TypeError(f"entry {raw!r}")
    return float(ts), xid, str(raw[2]) if len(raw) > 2 else "nvml"


def gpu_index(pci: str, gpus: Iterable[GpuDevice]) -> int | None:
    """The index of the GPU at PCI address ``pci`` as the kernel log writes it
    (``0000:2b:00``, the function left out), among the gpu collector's last readings."""
    want = pci.lower()
    for gpu in gpus:
        address = gpu.pci_address.lower()
        if address and (address == want or address.rsplit(".", 1)[0] == want):
            return gpu.index
    return None


def boot_time(procfs: Path = Path("/proc")) -> float | None:
    """When this node booted (/proc/stat ``btime``), None when it cannot be read."""
    try:
        for line in (procfs / "stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class XidLedger:
    """Each GPU's recent XIDs (by GPU index)."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        keep: int = KEEP,
        *,
        path: Path | None = None,
        boot_ts: float | None = None,
    ) -> None:
        self.window_s = window_s
        self.keep = keep
        self.path = path
        self.boot_ts = boot_ts
        self._seen: dict[int, deque[tuple[float, int, str]]] = {}
        self._lock = threading.Lock()
        if path is not None:
            self._load(path)

    def record(self, index: int, xid: int, ts: float, source: str = "nvml") -> bool:
        """One XID reported on GPU ``index`` at ``ts`` by ``source`` (``nvml``, ``kmsg``);
        False (not recorded) when another source recorded the same XID of the same GPU
        within ``SAME_REPORT_S``: NVML's event and the kernel log's line of one XID are
        one report (repeats from one source all count: a storm of 92s)."""
        with self._lock:
            seen = self._seen.setdefault(index, deque(maxlen=self.keep))
            if any(x == xid and src != source and abs(t - ts) <= SAME_REPORT_S
                   for t, x, src in seen):  # fmt: skip
                return False
            seen.append((ts, xid, source))
            self._save()
        return True

    def xids(self, index: int, now: float) -> tuple[int, ...]:
        """GPU ``index``'s XIDs, oldest first: the sticky ones since its last reset, the
        others of the last ``window_s``."""
        start = now - self.window_s
        with self._lock:
            seen = tuple(self._seen.get(index, ()))
        return tuple(
            x for ts, x, _ in seen if ts >= start or classify(x).xid_class in STICKY_CLASSES
        )

    def clear(self, index: int) -> int:
        """Forget GPU ``index``'s XIDs (it was reset); how many were forgotten."""
        with self._lock:
            gone = self._seen.pop(index, None)
            if gone:
                self._save()
        return len(gone) if gone else 0

    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("XID ledger %s unreadable (%s): starting empty", path, exc)
            return
        if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), dict):
            log.warning("XID ledger %s is not a ledger: starting empty", path)
            return
        booted = doc.get("boot_ts")
        if self.boot_ts is not None and (
            not isinstance(booted, int | float) or abs(booted - self.boot_ts) > BOOT_SLACK_S
        ):
            log.info("XID ledger %s is from before the node's boot: starting empty", path)
            return
        for key, entries in doc["gpus"].items():
            try:
                seen = deque(
                    (
                        (float(e[0]), int(e[1]), str(e[2]) if len(e) > 2 else "nvml")
                        for e in entries
                    ),
                    maxlen=self.keep,
                )
                self._seen[int(key)] = seen
            except (TypeError, ValueError):
                log.warning("XID ledger %s: GPU %r's entries unreadable: dropped", path, key)

    def _save(self) -> None:
        """Write the ledger (under the lock)."""
        if self.path is None:
            return
        doc = {
            "boot_ts": self.boot_ts,
            "gpus": {str(i): [list(e) for e in seen] for i, seen in self._seen.items() if seen},
        }
        write_json(self.path, doc, "XID ledger")
