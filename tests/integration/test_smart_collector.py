"""The smart collector end to end: saved-JSON mode, and real subprocesses (fake smartctl
scripts written to tmp_path, and the real smartctl when it is installed)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from metalguard.agent.collectors.base import REGISTRY, CollectorSettings, run_guarded
from metalguard.agent.collectors.smart import ProcessResult, SmartCollector, SmartctlError
from metalguard.agent.collectors.smart_parse import ScanEntry
from metalguard.proto.telemetry import SmartDevice
from tests.support import FIXTURES
from tests.support.waiting import wait_until

SMARTCTL = FIXTURES / "smartctl"
SEAGATE_ATA = SMARTCTL / "smartctl_exporter__ST3500418AS_12.json"
SAMSUNG = SMARTCTL / "smartctl_exporter__nvme-null-SAMSUNG_MZWLL3T2HAJQ-00005-nvme0.json"
DEADLINE_S = 10.0


def devices(items: Sequence[object]) -> dict[str, SmartDevice]:
    out = {}
    for item in items:
        assert isinstance(item, SmartDevice)
        out[item.device] = item
    return out


def fake_smartctl(tmp_path: Path, body: str) -> str:
    """An executable shell script standing in for smartctl; it logs each argv."""
    script = tmp_path / "smartctl"
    log = tmp_path / "argv.log"
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{body}\n')
    script.chmod(0o755)
    return str(script)


def scan_json(*entries: dict[str, str]) -> str:
    return json.dumps({"smartctl": {"exit_status": 0}, "devices": list(entries)})


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


async def wait_until_dead(pid: int) -> None:
    await wait_until(lambda: not _alive(pid), DEADLINE_S, f"pid {pid} to exit")


# ---------------------------------------------------------------- registration


def test_registered_with_a_300_s_interval() -> None:
    registration = REGISTRY["smart"]
    assert registration.default_interval_s == 300
    collector = registration.factory(CollectorSettings())
    assert (collector.name, collector.field) == ("smart", "smart")


# ---------------------------------------------------------------- saved JSON mode


async def test_json_dir_reads_every_file_and_reports_the_broken_one(tmp_path: Path) -> None:
    for path in SMARTCTL.glob("*.json"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "broken.json").write_text('{"smartctl": {"exit_status": 0}, "device":')
    (tmp_path / "notes.txt").write_text("not a *.json file: ignored")
    open_failed = {"smartctl": {"exit_status": 2, "messages": [{"string": "No such device"}]}}
    (tmp_path / "sdz.json").write_text(json.dumps(open_failed))

    result, run = await run_guarded(SmartCollector(CollectorSettings(smart_json_dir=tmp_path)))

    assert run.success
    assert len(result.items) == 7
    models = {d.model for d in result.items if isinstance(d, SmartDevice)}
    assert "SAMSUNG MZWLL3T2HAJQ-00005" in models
    errors = {Path(e.path).name: e.message for e in result.errors}
    assert set(errors) == {"broken.json", "sdz.json"}
    assert "broken.json" in errors["broken.json"]
    assert "not valid JSON" in errors["broken.json"]
    assert "open failed" in errors["sdz.json"]
    assert "No such device" in errors["sdz.json"]
    assert all(e.collector == "smart" for e in result.errors)


async def test_json_dir_missing_is_an_error(tmp_path: Path) -> None:
    settings = CollectorSettings(smart_json_dir=tmp_path / "absent")
    result = await SmartCollector(settings).collect()
    assert result.items == ()
    assert [e.path for e in result.errors] == [str(tmp_path / "absent")]


# ---------------------------------------------------------------- subprocess failures


async def test_smartctl_missing(tmp_path: Path) -> None:
    settings = CollectorSettings(smartctl=str(tmp_path / "no-smartctl"), sysfs=tmp_path)
    result, run = await run_guarded(SmartCollector(settings))
    assert result.items == ()
    assert [e.message for e in result.errors] == [
        f"smartctl not found: install smartmontools ({str(tmp_path / 'no-smartctl')!r})"
    ]
    assert not run.success


async def test_smartctl_not_executable(tmp_path: Path) -> None:
    script = tmp_path / "smartctl"
    script.write_text("#!/bin/sh\n")
    settings = CollectorSettings(smartctl=str(script), sysfs=tmp_path)
    result = await SmartCollector(settings).collect()
    assert len(result.errors) == 1
    assert "not executable" in result.errors[0].message


async def test_timeout_kills_smartctl_and_its_children(tmp_path: Path) -> None:
    scan = scan_json({"name": "/dev/sdq", "type": "sat", "protocol": "ATA"})
    smartctl = fake_smartctl(
        tmp_path,
        f"""case "$1" in --scan-open) echo '{scan}'; exit 0;; esac
echo $$ > {tmp_path}/shell.pid
sleep 60 &
echo $! > {tmp_path}/child.pid
wait""",
    )
    settings = CollectorSettings(smartctl=smartctl, smart_timeout_s=0.5, sysfs=tmp_path)

    started = time.monotonic()
    result = await SmartCollector(settings).collect()
    elapsed = time.monotonic() - started

    assert result.items == ()
    assert [e.path for e in result.errors] == ["/dev/sdq"]
    assert "timed out after 0.5 s (killed)" in result.errors[0].message
    assert elapsed < 5.0, "the collector waited for the sleeping script"
    for name in ("shell.pid", "child.pid"):
        await wait_until_dead(int((tmp_path / name).read_text()))


async def test_scan_timeout_falls_back_to_sysfs(tmp_path: Path) -> None:
    (tmp_path / "sys/class/nvme/nvme3").mkdir(parents=True)
    (tmp_path / "sys/block").mkdir(parents=True)
    smartctl = fake_smartctl(
        tmp_path,
        f"""case "$1" in --scan-open) exec sleep 60;; esac
cat {SAMSUNG}; exit 8""",
    )
    settings = CollectorSettings(smartctl=smartctl, smart_timeout_s=0.5, sysfs=tmp_path / "sys")
    result = await SmartCollector(settings).collect()
    assert [e.message.split(":")[0] for e in result.errors] == ["device scan failed"]
    assert "timed out" in result.errors[0].message
    assert list(devices(result.items)) == ["/dev/nvme0"]  # the name smartctl printed
    assert "-d nvme /dev/nvme3" in (tmp_path / "argv.log").read_text()


# ---------------------------------------------------------------- the full subprocess path


async def test_fake_smartctl_full_path(tmp_path: Path) -> None:
    scan = scan_json(
        {"name": "/dev/sda", "type": "sat", "protocol": "ATA"},
        {"name": "/dev/nvme0", "type": "nvme", "protocol": "NVMe"},
        {"name": "/dev/sdz", "type": "sat", "protocol": "ATA"},
        {"name": "/dev/sdy", "type": "scsi", "protocol": "SCSI", "open_error": "Permission denied"},
    )
    smartctl = fake_smartctl(
        tmp_path,
        f"""for a in "$@"; do last=$a; done
case "$1" in --scan-open) echo '{scan}'; exit 0;; esac
case "$last" in
  /dev/sda) cat {SEAGATE_ATA}; exit 0;;
  /dev/nvme0) cat {SAMSUNG}; exit 8;;
  *) echo "smartctl: something went wrong" >&2; echo garbage; exit 1;;
esac""",
    )
    settings = CollectorSettings(smartctl=smartctl, sysfs=tmp_path, smart_concurrency=2)

    result, run = await run_guarded(SmartCollector(settings))

    assert run.success
    found = devices(result.items)
    assert set(found) == {"/dev/sda", "/dev/nvme0"}
    assert found["/dev/sda"].reallocated_sectors == 304
    assert found["/dev/nvme0"].passed is False
    assert found["/dev/nvme0"].exit_status == 8
    errors = {e.path: e.message for e in result.errors}
    assert set(errors) == {"/dev/sdz", "/dev/sdy"}
    assert errors["/dev/sdz"].startswith("smartctl printed no JSON (exit status 1;")
    assert "something went wrong" in errors["/dev/sdz"]
    assert "open failed: Permission denied" in errors["/dev/sdy"]
    assert "CAP_SYS_RAWIO" in errors["/dev/sdy"]
    calls = sorted((tmp_path / "argv.log").read_text().splitlines())
    assert calls == [
        "--json -a -d nvme /dev/nvme0",
        "--json -a -d sat -n standby /dev/sda",
        "--json -a -d sat -n standby /dev/sdz",
        "--scan-open --json",
    ]


async def test_scan_printing_garbage_falls_back_to_sysfs(tmp_path: Path) -> None:
    (tmp_path / "sys/block/sdb").mkdir(parents=True)
    smartctl = fake_smartctl(
        tmp_path,
        f"""case "$1" in --scan-open) echo 'UNRECOGNIZED OPTION: json'; exit 1;; esac
cat {SEAGATE_ATA}""",
    )
    settings = CollectorSettings(smartctl=smartctl, sysfs=tmp_path / "sys")
    result = await SmartCollector(settings).collect()
    assert len(result.errors) == 1
    assert "device scan printed no JSON" in result.errors[0].message
    assert "UNRECOGNIZED OPTION" in result.errors[0].message
    assert list(devices(result.items)) == ["/dev/sda"]
    assert "--json -a -n standby /dev/sdb" in (tmp_path / "argv.log").read_text()


async def test_concurrency_is_bounded() -> None:
    active = 0
    peak = 0
    names = [f"/dev/sd{c}" for c in "abcdefgh"]

    async def runner(argv: Sequence[str], timeout_s: float) -> ProcessResult:
        nonlocal active, peak
        if "--scan-open" in argv:
            entries = [{"name": n, "type": "sat", "protocol": "ATA"} for n in names]
            return ProcessResult(0, scan_json(*entries).encode(), b"")
        active += 1
        peak = max(peak, active)
        for _ in range(5):  # let every other task that can start, start
            await asyncio.sleep(0)
        active -= 1
        if argv[-1] == "/dev/sdc":
            raise SmartctlError("smartctl timed out after 30 s (killed)")
        doc = json.loads(SEAGATE_ATA.read_bytes())
        doc["device"]["name"] = argv[-1]
        return ProcessResult(0, json.dumps(doc).encode(), b"")

    settings = CollectorSettings(smart_concurrency=3)
    result = await SmartCollector(settings, runner=runner).collect()
    assert peak == 3
    assert sorted(devices(result.items)) == sorted(set(names) - {"/dev/sdc"})
    assert [(e.path, e.message) for e in result.errors] == [
        ("/dev/sdc", "smartctl timed out after 30 s (killed)")
    ]


# ---------------------------------------------------------------- the real smartctl


def real_smartctl() -> str:
    path = shutil.which("smartctl") or shutil.which("smartctl", path="/usr/sbin:/sbin")
    if path is None:
        print("smartctl not installed: apt-get install smartmontools to run this test")
        pytest.skip("smartctl not installed: apt-get install smartmontools")
    return path


@pytest.mark.parametrize(
    ("entry", "cause"),
    [
        (ScanEntry("/dev/nonexistent-mg"), "Unable to detect device type"),
        (ScanEntry("/dev/nonexistent-mg", "nvme", "NVMe"), "No such device"),
        (ScanEntry("/dev/nonexistent-mg", "sat", "ATA"), "No such device"),
    ],
)
async def test_real_smartctl_on_a_missing_device(entry: ScanEntry, cause: str) -> None:
    settings = CollectorSettings(smartctl=real_smartctl(), smart_timeout_s=20)
    device, error = await SmartCollector(settings).query(entry)
    assert device is None
    assert error is not None
    assert error.path == "/dev/nonexistent-mg"
    assert error.message.startswith("no SMART data (smartctl exit status ")
    assert cause in error.message
    assert "/dev/nonexistent-mg" in error.message


async def test_real_smartctl_whole_run_never_raises(tmp_path: Path) -> None:
    settings = CollectorSettings(smartctl=real_smartctl(), smart_timeout_s=20, sysfs=tmp_path)
    result, _run = await run_guarded(SmartCollector(settings))
    assert all(isinstance(d, SmartDevice) for d in result.items)
    assert all(e.collector == "smart" for e in result.errors)


async def test_cancelling_a_run_kills_smartctl(tmp_path: Path) -> None:
    smartctl = fake_smartctl(
        tmp_path,
        f"""echo $$ > {tmp_path}/shell.pid.tmp; mv {tmp_path}/shell.pid.tmp {tmp_path}/shell.pid
exec sleep 60""",
    )
    settings = CollectorSettings(smartctl=smartctl, smart_timeout_s=60, sysfs=tmp_path)
    task = asyncio.create_task(SmartCollector(settings).collect())
    pid_file = tmp_path / "shell.pid"
    await wait_until(pid_file.exists, DEADLINE_S, "the fake smartctl to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_dead(int(pid_file.read_text()))
