"""EDAC memory-controller error counters from ``devices/system/edac/mc/mc*``.

Reads the controller counters, the modern ``dimm*/`` and ``rank*/`` entries and the legacy
``csrow*/`` entries (``CONFIG_EDAC_LEGACY_SYSFS``).  One bad file costs one value and one
error entry, never the controller.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.agent.sysfs import ReadStatus, SysfsReader, natural_key, run_scan
from metalguard.proto.telemetry import (
    CollectorError,
    EdacChannel,
    EdacController,
    EdacCsrow,
    EdacDimm,
)

MC_DIR = "devices/system/edac/mc"
CONTROLLER_FILES = ("ce_count", "ue_count", "ce_noinfo_count", "ue_noinfo_count")
DIMM_FILES = ("dimm_ce_count", "dimm_ue_count", "dimm_label")
CSROW_FILES = ("ce_count", "ue_count")

_MC_RE = re.compile(r"^mc(\d+)$")
_DIMM_RE = re.compile(r"^(?:dimm|rank)\d+$")
_CSROW_RE = re.compile(r"^csrow(\d+)$")
_CHANNEL_FILE_RE = re.compile(r"^ch(\d+)_(ce_count|ue_count|dimm_label)$")
_COUNT_RE = re.compile(r"^[0-9]+$")

Issue = tuple[str, str]
"""A problem with one file: (path relative to the controller directory, message)."""


def parse_count(text: str) -> int | None:
    """A decimal counter; None for an empty file; ValueError for anything else."""
    value = text.strip()
    if not value:
        return None
    if not _COUNT_RE.match(value):
        raise ValueError(f"not a counter: {value[:40]!r}")
    return int(value)


class _Counts:
    """Parses counters out of one file mapping, remembering the bad ones."""

    def __init__(self, files: Mapping[str, str]) -> None:
        self.files = files
        self.issues: list[Issue] = []

    def count(self, key: str) -> int | None:
        text = self.files.get(key)
        if text is None:
            return None
        try:
            return parse_count(text)
        except ValueError as exc:
            self.issues.append((key, str(exc)))
            return None

    def label(self, key: str) -> str:
        return self.files.get(key, "").strip()


def parse_controller(mc: int, files: Mapping[str, str]) -> tuple[EdacController, list[Issue]]:
    """Build one controller from its files' texts, keyed by path below ``mc<N>/``.

    Keys look like ``ce_count``, ``dimm0/dimm_ce_count``, ``rank3/dimm_label``,
    ``csrow1/ue_count`` or ``csrow1/ch0_dimm_label``; absent keys give null fields.
    """
    counts = _Counts(files)
    subdirs: dict[str, set[str]] = {}
    for key in files:
        head, sep, tail = key.partition("/")
        if sep:
            subdirs.setdefault(head, set()).add(tail)

    dimms = []
    csrows = []
    for sub in sorted(subdirs, key=natural_key):
        if _DIMM_RE.match(sub):
            dimms.append(
                EdacDimm(
                    name=sub,
                    label=counts.label(f"{sub}/dimm_label"),
                    ce_count=counts.count(f"{sub}/dimm_ce_count"),
                    ue_count=counts.count(f"{sub}/dimm_ue_count"),
                )
            )
        elif match := _CSROW_RE.match(sub):
            csrows.append(_parse_csrow(int(match[1]), sub, subdirs[sub], counts))

    controller = EdacController(
        mc=mc,
        ce_count=counts.count("ce_count"),
        ue_count=counts.count("ue_count"),
        ce_noinfo_count=counts.count("ce_noinfo_count"),
        ue_noinfo_count=counts.count("ue_noinfo_count"),
        dimms=tuple(dimms),
        csrows=tuple(csrows),
    )
    return controller, counts.issues


def _parse_csrow(number: int, sub: str, names: set[str], counts: _Counts) -> EdacCsrow:
    channels = sorted(
        {int(m[1]) for name in names if (m := _CHANNEL_FILE_RE.match(name))},
    )
    return EdacCsrow(
        csrow=number,
        ce_count=counts.count(f"{sub}/ce_count"),
        ue_count=counts.count(f"{sub}/ue_count"),
        channels=tuple(
            EdacChannel(
                channel=ch,
                label=counts.label(f"{sub}/ch{ch}_dimm_label"),
                ce_count=counts.count(f"{sub}/ch{ch}_ce_count"),
                ue_count=counts.count(f"{sub}/ch{ch}_ue_count"),
            )
            for ch in channels
        ),
    )


def scan_edac(reader: SysfsReader) -> tuple[list[EdacController], list[CollectorError]]:
    """Read and parse every controller below the reader's root (blocking I/O)."""
    errors: list[CollectorError] = []
    controllers: list[EdacController] = []
    for entry in _list(reader, MC_DIR, errors):
        match = _MC_RE.match(entry)
        if match is None:
            continue
        mc_dir = f"{MC_DIR}/{entry}"
        files = _read_controller(reader, mc_dir, errors)
        controller, issues = parse_controller(int(match[1]), files)
        controllers.append(controller)
        errors.extend(_error(reader.display(f"{mc_dir}/{key}"), msg) for key, msg in issues)
    controllers.sort(key=lambda c: c.mc)
    return controllers, errors


def _read_controller(
    reader: SysfsReader, mc_dir: str, errors: list[CollectorError]
) -> dict[str, str]:
    """The texts of one controller's known files, keyed by path below ``mc_dir``.

    Only known names are read: ``reset_counters`` is write-only, and unknown files may be
    slow or large.
    """
    wanted: list[str] = list(CONTROLLER_FILES)
    for sub in _list(reader, mc_dir, errors):
        if _DIMM_RE.match(sub):
            wanted.extend(f"{sub}/{name}" for name in DIMM_FILES)
        elif _CSROW_RE.match(sub):
            wanted.extend(f"{sub}/{name}" for name in CSROW_FILES)
            wanted.extend(
                f"{sub}/{name}"
                for name in _list(reader, f"{mc_dir}/{sub}", errors)
                if _CHANNEL_FILE_RE.match(name)
            )
    files: dict[str, str] = {}
    for key, result in reader.read_files(mc_dir, wanted).items():
        if result.text is not None:
            files[key] = result.text
        elif result.status is ReadStatus.ERROR:
            errors.append(_error(reader.display(f"{mc_dir}/{key}"), result.error))
    return files


def _list(reader: SysfsReader, rel: str, errors: list[CollectorError]) -> tuple[str, ...]:
    listing = reader.listdir(rel)
    if listing.status is ReadStatus.ERROR:
        errors.append(_error(reader.display(rel), listing.error))
    return listing.names


def _error(path: str, message: str | None) -> CollectorError:
    return CollectorError(collector="edac", path=path, message=message or "unreadable")


@register("edac", default_interval_s=5)
class EdacCollector:
    """Collects every EDAC memory controller; one worker-thread scan per call."""

    name = "edac"
    field: BatchField = "edac"

    def __init__(self, settings: CollectorSettings, *, reader: SysfsReader | None = None) -> None:
        self._reader = reader or SysfsReader(settings.sysfs)

    async def collect(self) -> Collected:
        """Scan the controllers off the event loop."""
        controllers, errors = await run_scan(scan_edac, self._reader, watch=(MC_DIR,))
        return Collected(field=self.field, items=tuple(controllers), errors=tuple(errors))
