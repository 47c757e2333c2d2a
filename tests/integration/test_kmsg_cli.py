# ruff: noqa: E501  (real kernel log lines are kept whole)
"""``metalguard agent kmsg scan`` and ``import-npd`` as processes (docs/kmsg.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures" / "kmsg"
NPD = FIXTURES / "npd-kernel-monitor.json"
RECORDS = (
    "3,101,5000000,-;NVRM: Xid (PCI:0018:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
    " SUBSYSTEM=pci\n DEVICE=+pci:0018:01:00.0\n"
    "6,102,5100000,-;NVRM: GPU at PCI:0018:01:00: GPU-5f0e2b5a\n"
    "this is not a record\n"
    "12,103,5200000,-;INFO: task fake:1 blocked for more than 120 seconds.\n"
    "3,104,5300000,-;INFO: task jbd2/sda1-8:415 blocked for more than 120 seconds.\n"
)


def _metalguard(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "metalguard", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_scan_prints_one_finding_per_line_and_reports_what_it_skipped() -> None:
    done = _metalguard("agent", "kmsg", "scan", "--file", "-", "--format", "json", stdin=RECORDS)
    assert done.returncode == 0, done.stderr
    found = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(f["seq"], f["kind"], f["xid"], f["device"]) for f in found] == [
        (101, "gpu_xid", 79, "0018:01:00"),
        (104, "hung_task", None, ""),
    ]
    assert set(found[0]) == {
        "seq", "ts", "kind", "severity", "device", "xid", "action", "rule", "message",
    }  # fmt: skip
    assert (found[0]["severity"], found[0]["action"], found[0]["ts"]) == (
        "critical",
        "reboot the node",
        5.0,
    )
    assert "1 malformed record(s) skipped" in done.stderr
    assert "1 record(s) written from user space ignored" in done.stderr
    assert "Traceback" not in done.stderr
    trusted = _metalguard(
        "agent", "kmsg", "scan", "--file", "-", "--trust-user-records", "--format", "text",
        stdin=RECORDS,
    )  # fmt: skip
    assert [line.split()[3].rstrip(":") for line in trusted.stdout.splitlines()] == [
        "gpu_xid",
        "hung_task",
        "hung_task",
    ]


def test_scan_takes_node_problem_detectors_rules(tmp_path: Path) -> None:
    records = tmp_path / "k"
    records.write_text(
        "6,1,1,-;Killed process 42 (my trainer) total-vm:100kB, anon-rss:90kB, file-rss:0kB, shmem-rss:0kB\n"
    )
    done = _metalguard("agent", "kmsg", "scan", "--file", str(records), "--rules", str(NPD))
    assert done.returncode == 0, done.stderr
    (finding,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert (finding["kind"], finding["rule"]) == ("oom_kill", "npd_0_OOMKilling")


def test_import_npd_writes_a_rules_file_that_loads(tmp_path: Path) -> None:
    out = tmp_path / "npd.toml"
    done = _metalguard("agent", "kmsg", "import-npd", str(NPD), "--output", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.count("[[rule]]") == 12
    records = tmp_path / "k"
    records.write_text("6,1,1,-;XFS (dm-3): Corruption detected.  Shutting down filesystem\n")
    scanned = _metalguard("agent", "kmsg", "scan", "--file", str(records), "--rules", str(out))
    (finding,) = [json.loads(line) for line in scanned.stdout.splitlines()]
    assert (finding["kind"], finding["severity"]) == ("fs_readonly", "critical")


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    missing = _metalguard("agent", "kmsg", "scan", "--file", str(tmp_path / "none"))
    assert missing.returncode == 2
    assert "No such file" in missing.stderr
    rules = tmp_path / "bad.toml"
    rules.write_text("[[rule]]\nname = 'a'\nkind = 'x'\npattern = '('\n")
    bad = _metalguard("agent", "kmsg", "scan", "--file", "-", "--rules", str(rules), stdin="")
    assert bad.returncode == 2
    assert "bad.toml: rule 1 (a): bad pattern" in bad.stderr
    assert "Traceback" not in bad.stderr


DMESG_AND_SYSLOG = (
    "[  219.470994] NVRM: Xid (PCI:0000:2b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
    "[Sun Feb 23 16:24:18 2025] EXT4-fs (nvme0n1p2): Remounting filesystem read-only\n"
    "\n"
    "Dec  2 11:38:47 worker4 kernel: [  220.000001] INFO: task python3:4242 blocked for more than 120 seconds.\n"
    "Dec  2 11:38:48 worker4 myapp[42]: INFO: task python3:4242 blocked for more than 120 seconds.\n"
)


def test_scan_reads_dmesg_and_syslog_lines_with_input_text() -> None:
    done = _metalguard(
        "agent", "kmsg", "scan", "--file", "-", "--input", "text", "--format", "json",
        stdin=DMESG_AND_SYSLOG,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(f["seq"], f["ts"], f["kind"], f["xid"]) for f in found] == [
        (1, 219.470994, "gpu_xid", 79),
        (2, 0.0, "fs_readonly", None),
        (4, 220.000001, "hung_task", None),
    ]
    assert "1 record(s) written from user space ignored" in done.stderr  # myapp's line
    # the same lines read as /dev/kmsg records: refused, with the hint
    plain = _metalguard("agent", "kmsg", "scan", "--file", "-", stdin=DMESG_AND_SYSLOG)
    assert plain.returncode == 0
    assert plain.stdout == ""
    assert "--input text reads them" in plain.stderr
