"""The agent's memory of each GPU's XIDs, between the XID watcher that hears them and the
gpu collector that reports them (``GpuDevice.xid_errors``), until a GPU reset clears them.

An XID whose class a reset clears, or that needs a reboot (``reset_gpu``, ``decode``,
``reboot``), is kept until the GPU is reset (:meth:`XidLedger.clear`, the ``gpu_reset``
command) or the agent restarts (a rebooted node's GPUs start clean); any other XID is kept
for ``window_s`` (24 h), so the controller can count a storm of 92s without a week-old
one costing the node forever. At most ``keep`` XIDs per GPU, the newest. Thread-safe: the
watcher records from its own thread.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Final

from metalguard.proto.xid import XidClass, classify

STICKY_CLASSES: Final[frozenset[XidClass]] = frozenset({"reset_gpu", "decode", "reboot"})
"""Classes kept until the GPU is reset (or the node rebooted), whatever their age."""
WINDOW_S: Final = 86_400.0
KEEP: Final = 64


class XidLedger:
    """Each GPU's recent XIDs (by GPU index)."""

    def __init__(self, window_s: float = WINDOW_S, keep: int = KEEP) -> None:
        self.window_s = window_s
        self.keep = keep
        self._seen: dict[int, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()

    def record(self, index: int, xid: int, ts: float) -> None:
        """One XID reported on GPU ``index`` at ``ts``."""
        with self._lock:
            self._seen.setdefault(index, deque(maxlen=self.keep)).append((ts, xid))

    def xids(self, index: int, now: float) -> tuple[int, ...]:
        """GPU ``index``'s XIDs, oldest first: the sticky ones since its last reset, the
        others of the last ``window_s``."""
        start = now - self.window_s
        with self._lock:
            seen = tuple(self._seen.get(index, ()))
        return tuple(x for ts, x in seen if ts >= start or classify(x).xid_class in STICKY_CLASSES)

    def clear(self, index: int) -> int:
        """Forget GPU ``index``'s XIDs (it was reset); how many were forgotten."""
        with self._lock:
            gone = self._seen.pop(index, None)
        return len(gone) if gone else 0
