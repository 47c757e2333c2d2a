"""hwmon fans and temperatures from ``class/hwmon/hwmon*`` (and each chip's ``device/``).

Chips are named exactly as node_exporter names them (``hwmon_linux.go``), so a chip keeps
its name across reboots even though ``hwmonN`` numbering is not stable.
"""

from __future__ import annotations

import posixpath
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.agent.sysfs import ReadStatus, SysfsReader, natural_key, run_scan
from metalguard.proto.telemetry import CollectorError, Fan, HwmonChip, Temperature

HWMON_DIR = "class/hwmon"
SENSOR_FILE_RE = re.compile(r"^(fan|temp)([0-9]+)_(input|min|alarm|label|crit|max)$")
"""The sensor files read; others (``reset_history``, ``*_enable``...) are never opened."""

_INVALID_CHARS = re.compile(r"[^a-z0-9:_]")
_NUMBER_RE = re.compile(r"^[+-]?[0-9]+(?:\.[0-9]+)?$")
MILLI = 1000.0

Issue = tuple[str, str]
"""A problem with one sensor file: (file name, message)."""


def clean_name(name: str) -> str:
    """node_exporter's ``cleanMetricName``: lower case, ``[^a-z0-9:_]`` to ``_``, trimmed."""
    return _INVALID_CHARS.sub("_", name.lower()).strip("_")


@dataclass(frozen=True, slots=True)
class ChipPaths:
    """What naming a chip needs to know about its hwmon directory."""

    entry: str
    """The ``class/hwmon`` entry name, e.g. ``hwmon3``."""
    real_name: str
    """The last element of the entry's symlink-free path."""
    device: str | None = None
    """The symlink-free path of ``device``, when that link resolves."""
    name_file: str | None = None
    """The contents of the ``name`` file, when readable."""


def base_chip_name(chip: ChipPaths) -> str | None:
    """``<parent dir>_<device>`` from the device link, else the name file, else hwmonN."""
    if chip.device:
        dev_type = clean_name(posixpath.basename(posixpath.dirname(chip.device)))
        dev_name = clean_name(posixpath.basename(chip.device))
        if dev_type and dev_name:
            return f"{dev_type}_{dev_name}"
        if dev_name:
            return dev_name
    if chip.name_file:
        cleaned = clean_name(chip.name_file)
        if cleaned:
            return cleaned
    return clean_name(chip.real_name) or None


def chip_labels(chips: Sequence[ChipPaths]) -> list[str | None]:
    """Unique chip labels, in input order; None where no name can be derived.

    Chips that share a base name (two hwmon nodes of one device) get ``_<name file>``
    appended, or ``_<hwmonN>`` when the name file is empty or also shared.
    """
    bases = [base_chip_name(chip) for chip in chips]
    names = [(chip.name_file or "").strip() for chip in chips]
    base_counts = Counter(b for b in bases if b is not None)
    pair_counts = Counter((b, n) for b, n in zip(bases, names, strict=True) if b is not None)
    labels: list[str | None] = []
    for chip, base, name in zip(chips, bases, names, strict=True):
        if base is None or base_counts[base] == 1:
            labels.append(base)
            continue
        suffix = clean_name(name)
        if not suffix or pair_counts[(base, name)] > 1:
            suffix = clean_name(chip.entry)
        labels.append(f"{base}_{suffix}")
    return labels


def parse_number(text: str) -> float | None:
    """A decimal sensor value; None for an empty file; ValueError for anything else."""
    value = text.strip()
    if not value:
        return None
    if not _NUMBER_RE.match(value):
        raise ValueError(f"not a number: {value[:40]!r}")
    return float(value)


def parse_chip(chip: str, name: str, files: Mapping[str, str]) -> tuple[HwmonChip, list[Issue]]:
    """Build one chip from its sensor files' texts, keyed by file name (``fan1_input``).

    Fan values are RPM; temperatures are converted from millidegrees to degrees Celsius.
    Empty values are skipped; unparsable ones are skipped and reported.
    """
    issues: list[Issue] = []

    def number(key: str, scale: float = 1.0) -> float | None:
        text = files.get(key)
        if text is None:
            return None
        try:
            value = parse_number(text)
        except ValueError as exc:
            issues.append((key, str(exc)))
            return None
        return None if value is None else value / scale

    sensors = sorted(
        {(m[1], int(m[2])) for key in files if (m := SENSOR_FILE_RE.match(key))},
        key=lambda s: (s[0], s[1]),
    )
    fans: list[Fan] = []
    temps: list[Temperature] = []
    for kind, num in sensors:
        prefix = f"{kind}{num}"
        label = files.get(f"{prefix}_label", "").strip()
        if kind == "fan":
            alarm = number(f"{prefix}_alarm")
            fans.append(
                Fan(
                    sensor=prefix,
                    label=label,
                    rpm=number(f"{prefix}_input"),
                    min_rpm=number(f"{prefix}_min"),
                    alarm=None if alarm is None else alarm != 0,
                )
            )
        else:
            temps.append(
                Temperature(
                    sensor=prefix,
                    label=label,
                    celsius=number(f"{prefix}_input", MILLI),
                    crit_celsius=number(f"{prefix}_crit", MILLI),
                    max_celsius=number(f"{prefix}_max", MILLI),
                )
            )
    return HwmonChip(chip=chip, name=name, fans=tuple(fans), temps=tuple(temps)), issues


def scan_hwmon(reader: SysfsReader) -> tuple[list[HwmonChip], list[CollectorError]]:
    """Read and parse every hwmon chip below the reader's root (blocking I/O)."""
    errors: list[CollectorError] = []
    listing = reader.listdir(HWMON_DIR)
    if listing.status is ReadStatus.ERROR:
        errors.append(_error(reader.display(HWMON_DIR), listing.error))
    dirs: list[str] = []
    paths: list[ChipPaths] = []
    for entry in listing.names:
        rel = f"{HWMON_DIR}/{entry}"
        real = reader.resolve(rel)
        if real is None or not reader.is_dir(rel):
            continue  # dangling link or not a directory, as node_exporter skips them
        name = reader.read(f"{rel}/name")
        if name.status is ReadStatus.ERROR:
            errors.append(_error(reader.display(f"{rel}/name"), name.error))
        dirs.append(rel)
        paths.append(
            ChipPaths(
                entry=entry,
                real_name=posixpath.basename(real) or entry,
                device=reader.resolve(f"{rel}/device"),
                name_file=name.text,
            )
        )

    chips: list[HwmonChip] = []
    for rel, chip_paths, label in zip(dirs, paths, chip_labels(paths), strict=True):
        if label is None:
            continue
        files, sources = _read_sensor_files(reader, rel, errors)
        chip, issues = parse_chip(label, (chip_paths.name_file or "").strip(), files)
        chips.append(chip)
        errors.extend(_error(reader.display(sources[key]), msg) for key, msg in issues)
    chips.sort(key=lambda c: natural_key(c.chip))
    return chips, errors


def _read_sensor_files(
    reader: SysfsReader, rel: str, errors: list[CollectorError]
) -> tuple[dict[str, str], dict[str, str]]:
    """Sensor texts from the hwmon dir, then its ``device/`` (which wins, as in node_exporter).

    Returns the texts by file name and the root-relative path each one came from.
    """
    files: dict[str, str] = {}
    sources: dict[str, str] = {}
    dirs = [rel]
    if reader.is_dir(f"{rel}/device"):
        dirs.append(f"{rel}/device")
    for directory in dirs:
        listing = reader.listdir(directory)
        if listing.status is ReadStatus.ERROR:
            errors.append(_error(reader.display(directory), listing.error))
        wanted = [name for name in listing.names if SENSOR_FILE_RE.match(name)]
        for name, result in reader.read_files(directory, wanted).items():
            path = f"{directory}/{name}"
            if result.text is not None:
                files[name] = result.text
                sources[name] = path
            elif result.status is ReadStatus.ERROR:
                errors.append(_error(reader.display(path), result.error))
    return files, sources


def _error(path: str, message: str | None) -> CollectorError:
    return CollectorError(collector="hwmon", path=path, message=message or "unreadable")


@register("hwmon", default_interval_s=5)
class HwmonCollector:
    """Collects every hwmon chip's fans and temperatures; one worker-thread scan per call."""

    name = "hwmon"
    field: BatchField = "hwmon"

    def __init__(self, settings: CollectorSettings, *, reader: SysfsReader | None = None) -> None:
        self._reader = reader or SysfsReader(settings.sysfs)

    async def collect(self) -> Collected:
        """Scan the chips off the event loop."""
        chips, errors = await run_scan(scan_hwmon, self._reader, watch=(HWMON_DIR,))
        return Collected(field=self.field, items=tuple(chips), errors=tuple(errors))
