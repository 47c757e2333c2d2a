# ruff: noqa: E501  (real kernel log lines are kept whole)
"""The kernel log monitor's pure parts (docs/kmsg.md): /dev/kmsg records, the shipped
rules on their examples and on tricky variants, storms."""

from __future__ import annotations

import pytest

from metalguard.agent.kmsg.record import (
    KmsgFormatError,
    device_name,
    parse_record,
    split_records,
    text_record,
)
from metalguard.agent.kmsg.rules import (
    KINDS,
    Finding,
    Ignored,
    RulesError,
    match,
    merged,
    npd_rules,
    parse_rules,
    shipped_rules,
)
from metalguard.agent.kmsg.storm import Coalescer, storm_key, suppressed_callbacks


def test_a_record_with_its_continuation_lines() -> None:
    raw = (
        "3,1042,13129707853,-;pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error\\x20x\n"
        " SUBSYSTEM=pci\n DEVICE=+pci:0000:31:00.0\n"
    )
    r = parse_record(raw)
    assert (r.facility, r.level, r.seq, r.ts_us, r.flags) == (0, 3, 1042, 13129707853, "-")
    assert r.text == "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error x"
    assert r.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:31:00.0"}
    assert r.from_kernel
    assert r.device == "0000:31:00.0"


def test_a_user_space_record_is_not_the_kernels() -> None:
    r = parse_record("12,345,13129707853,-;text")  # echo "<4>text" > /dev/kmsg
    assert (r.facility, r.level, r.from_kernel) == (1, 4, False)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("no separator", "no ';'"),
        ("3,1;x", "PRIORITY,SEQ,TIMESTAMP,FLAGS"),
        ("3,x,1,-;x", "not a number"),
        ("3,-1,1,-;x", "negative"),
    ],
)
def test_malformed_records_say_why(raw: str, problem: str) -> None:
    with pytest.raises(KmsgFormatError, match=problem):
        parse_record(raw)


def test_device_names_and_record_splitting() -> None:
    assert device_name("b8:0") == "block 8:0"
    assert device_name("n2") == "netdev 2"
    assert device_name("+usb:1-1") == "1-1"
    assert device_name("") == ""
    text = "6,1,1,-;a\n SUBSYSTEM=pci\n6,2,2,-;b\n\n6,3,3,c;c"
    assert split_records(text) == ["6,1,1,-;a\n SUBSYSTEM=pci", "6,2,2,-;b", "6,3,3,c;c"]


@pytest.mark.parametrize("rule", shipped_rules(), ids=lambda r: r.name)
def test_every_shipped_rule_matches_its_example_and_is_first_to(rule) -> None:  # type: ignore[no-untyped-def]
    found = match(text_record(rule.example), shipped_rules())
    if rule.ignore:
        assert found == Ignored(rule.name)
    else:
        assert isinstance(found, Finding)
        assert found.rule == rule.name


def test_the_shipped_rules_give_every_kind() -> None:
    assert {r.kind for r in shipped_rules()} == set(KINDS)


def _find(text: str) -> Finding:
    found = match(text_record(text, seq=7, ts_us=2_000_000), shipped_rules())
    assert isinstance(found, Finding), text
    return found


@pytest.mark.parametrize(
    ("text", "device", "xid", "severity"),
    [
        ("NVRM: Xid (PCI:0000:2b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", "0000:2b:00", 79, "critical"),
        ("NVRM: Xid (0000:01:00): 16, Head 00000000 Count 00001234", "0000:01:00", 16, "warning"),
        ("NVRM: Xid (PCI:0018:01:00): 48, pid=1234, name=python, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.", "0018:01:00", 48, "warning"),
        ("NVRM: Xid (PCI:0000:b1:00): 13, pid=24451, name=python3, Graphics Exception: ESR 0x405848=0x3e000000", "0000:b1:00", 13, "warning"),
        ("NVRM: Xid (PCI:0000:3b:00): 63, pid=1, name=x, Row Remapper: New row (0x0000000000123) Marked for Remapping, reset gpu to activate.", "0000:3b:00", 63, "info"),
        ("NVRM: Xid (PCI:0000:3b:00): 92, pid=1, name=x, High single-bit ECC error rate", "0000:3b:00", 92, "warning"),
    ],
)  # fmt: skip
def test_xid_forms(text: str, device: str, xid: int, severity: str) -> None:
    f = _find(text)
    assert (f.kind, f.device, f.xid, f.severity) == ("gpu_xid", device, xid, severity)
    assert (f.seq, f.ts_us) == (7, 2_000_000)


def test_an_xid_45_names_only_its_own_xid_and_its_cause() -> None:
    f = _find(
        "NVRM: Xid (PCI:0000:b1:00): 45, pid=1234, name=python3, Ch 00000008, "
        "errorString CTX SWITCH TIMEOUT, Info 0x24c033 caused by previous Xid 79"
    )
    assert (f.xid, f.caused_by) == (45, 79)


def test_xid_154_takes_the_action_in_its_text() -> None:
    reset = _find(
        "NVRM: Xid (PCI:0000:0a:00): 154, GPU recovery action changed from 0x0 (None) "
        "to 0x1 (GPU Reset Required)"
    )
    assert (reset.action, reset.severity) == ("GPU Reset Required", "warning")
    reboot = _find(
        "NVRM: Xid (PCI:0000:0a:00): 154, GPU recovery action changed from 0x0 (None) "
        "to 0x2 (Node Reboot Required)"
    )
    assert (reboot.action, reboot.severity) == ("Node Reboot Required", "critical")


def test_an_sxid_with_its_link_and_severity() -> None:
    fatal = _find(
        "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack timeout error"
    )
    assert (fatal.kind, fatal.severity, fatal.device, fatal.link) == (
        "gpu_sxid",
        "critical",
        "0000:c3:00.0",
        28,
    )
    other = _find(
        "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 36 egress non-posted PRIV error"
    )
    assert other.severity == "warning"


@pytest.mark.parametrize(
    ("text", "kind", "severity"),
    [
        ("INFO: task kworker/u16:2:123 blocked for more than 120 seconds.", "hung_task", "warning"),
        ("INFO: task Xorg with spaces:123 blocked for more than 622 seconds.", "hung_task", "warning"),
        ("BUG: soft lockup - CPU#0 stuck for 67s! [swapper/0:0]", "soft_lockup", "warning"),
        ("INFO: rcu_sched self-detected stall on CPU", "rcu_stall", "warning"),
        ("BUG: unable to handle kernel NULL pointer dereference at 0000000000000008", "kernel_oops", "warning"),
        ("Out of memory: Kill process 1234 (python3) score 900 or sacrifice child", "oom_kill", "warning"),
        ("Killed process 1234 (python3) total-vm:10000kB, anon-rss:9000kB, file-rss:0kB", "oom_kill", "warning"),
        ("Memory cgroup out of memory: Killed process 4321 (my trainer) total-vm:1kB, anon-rss:1kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1kB oom_score_adj:0", "oom_kill", "warning"),
        ("pcieport 0000:00:01.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Receiver ID)", "pcie_aer", "critical"),
        ("nvme 0000:3b:00.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)", "pcie_aer", "warning"),
        ("pciehp 0000:00:1c.0:pcie004: Slot(0): Link Down", "pcie_link_down", "critical"),
        ("{1}[Hardware Error]: event severity: fatal", "hardware_error", "critical"),
        ("I/O error, dev nvme0n1, sector 2048 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio class 0", "io_error", "warning"),
        ("nvme nvme1: I/O 7 QID 0 timeout, completion polled", "nvme_timeout", "warning"),
        ("nvme nvme0: Device not ready; aborting reset, CSTS=0x1", "nvme_down", "critical"),
        ("XFS (sdb1): metadata I/O error in \"xfs_trans_read_buf_map\" at daddr 0x1 len 8 error 5", "fs_error", "warning"),
    ],
)  # fmt: skip
def test_kinds_and_wordings(text: str, kind: str | None, severity: str | None) -> None:
    found = match(text_record(text), shipped_rules())
    if kind is None:
        assert found is None, found
        return
    assert isinstance(found, Finding), text
    assert (found.kind, found.severity) == (kind, severity)


@pytest.mark.parametrize(
    "text",
    [
        "EXT4-fs (sda1): mounted filesystem with ordered data mode. Opts: errors=remount-ro",
        "EXT4-fs (sda1): re-mounted. Opts: errors=remount-ro",
        "mce: CPU supports 7 MCE banks",
        "NVRM: GPU at PCI:0000:3b:00: GPU-5f0e2b5a-1d2c-4b7e-9a3f-0c1d2e3f4a5b",
        "oom_reaper: reaped process 1234 (python3), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB",
        "e1000e: eth0 NIC Link is Up 1000 Mbps Full Duplex, Flow Control: Rx/Tx",
        "mlx5_core 0000:3b:00.0 enp59s0f0np0: Link up",
        "nvme nvme0: 8/0/0 default/read/poll queues",
        "pcieport 0000:00:01.0: AER: enabled with IRQ 24",
        "INFO: lockdep is turned off.",
        "r8169 0000:02:00.0 eth0: Cable plugged",
    ],
)
def test_lines_that_must_not_match(text: str) -> None:
    assert match(text_record(text), shipped_rules()) is None


def test_a_known_flood_is_ignored() -> None:
    line = (
        "mlx5_core 0000:af:00.1: mlx5_cmd_out_err:838:(pid 9): ACCESS_REG(0x805) op_mod(0x1) "
        "failed, status bad parameter(0x3), syndrome (0x6c4d48), err(-22)"
    )
    assert match(text_record(line), shipped_rules()) == Ignored("mlx5_access_reg_spam")


def test_a_records_device_field_when_the_text_names_none() -> None:
    r = parse_record("3,5,10,-;INFO: task x:1 blocked for more than 120 seconds.\n DEVICE=b259:0\n")
    found = match(r, shipped_rules())
    assert isinstance(found, Finding)
    assert found.device == "block 259:0"


def test_user_rules_come_first_and_replace_by_name() -> None:
    user = parse_rules(
        """
[[rule]]
name = "hung_task"
kind = "hung_task"
severity = "critical"
pattern = 'blocked for more than'
example = "INFO: task a:1 blocked for more than 120 seconds."

[[rule]]
name = "my_fabric"
kind = "fabric_flap"
pattern = 'fabric flapped'
""",
        "mine.toml",
    )
    rules = merged(user)
    assert [r.name for r in rules].count("hung_task") == 1
    f = match(text_record("INFO: task a:1 blocked for more than 120 seconds."), rules)
    assert isinstance(f, Finding)
    assert f.severity == "critical"
    g = match(text_record("the fabric flapped twice"), rules)
    assert isinstance(g, Finding)
    assert (g.kind, g.severity) == ("fabric_flap", "warning")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[[rule]]\nkind = 'x'\npattern = 'y'\n", "`name`"),
        ("[[rule]]\nname = 'a'\nkind = 'Bad Kind'\npattern = 'y'\n", "lowercase token"),
        ("[[rule]]\nname = 'a'\nkind = 'x'\npattern = '('\n", "bad pattern"),
        ("[[rule]]\nname = 'a'\nkind = 'x'\npattern = 'y'\nseverity = 'huge'\n", "`severity`"),
        ("[[rule]]\nname = 'a'\nkind = 'x'\npattern = 'y'\nexample = 'z'\n", "its own example"),
        ("[[rule]]\nname = 'a'\nkind = 'x'\npattern = 'y'\ncolour = 1\n", "unknown key"),
        ("[[rule]]\nname = 'a'\nkind = 'x'\npattern = 'y'\n[[rule]]\nname = 'a'\nkind = 'x'\npattern = 'y'\n", "used twice"),
        ("[[rule]\n", "mine.toml"),
        ("[[rule]]\nname = 'a'\nkind = 'x'\npattern = 'y'\nseverity_map = { a = 'info' }\n", "(?P<sev>"),
    ],
)  # fmt: skip
def test_a_bad_rules_file_says_which_rule_and_why(text: str, problem: str) -> None:
    with pytest.raises(RulesError, match=problem.replace("(", r"\(").replace("?", r"\?")):
        parse_rules(text, "mine.toml")


def test_node_problem_detectors_rules_load_as_they_are() -> None:
    npd = """{"plugin": "kmsg", "rules": [
      {"type": "temporary", "reason": "OOMKilling",
       "pattern": "Killed process \\\\d+ (.+) total-vm:\\\\d+kB, anon-rss:\\\\d+kB, file-rss:\\\\d+kB.*"},
      {"type": "permanent", "condition": "ReadonlyFilesystem", "reason": "FilesystemIsReadOnly",
       "pattern": "Remounting filesystem read-only"},
      {"type": "temporary", "reason": "SomethingNew", "pattern": "something new"}]}"""
    rules = npd_rules(npd, "kernel-monitor.json")
    assert [(r.kind, r.severity) for r in rules] == [
        ("oom_kill", "warning"),
        ("fs_readonly", "critical"),
        ("npd_something_new", "warning"),
    ]
    oom = "Killed process 12 (a b) total-vm:1kB, anon-rss:1kB, file-rss:0kB, shmem-rss:0kB"
    assert isinstance(match(text_record(oom), rules), Finding)
    # as NPD does, the pattern is matched at the end of the message
    assert match(text_record("Remounting filesystem read-only, or not"), rules) is None
    with pytest.raises(RulesError, match="no `rules` list"):
        npd_rules("{}", "k.json")


def _xid(xid: int, device: str = "0000:2b:00", caused_by: int | None = None) -> Finding:
    return Finding(seq=1, ts_us=1, kind="gpu_xid", severity="warning", device=device,
                   rule="nvidia_xid", message="m", xid=xid, caused_by=caused_by)  # fmt: skip


def test_a_storm_is_one_report_then_its_count() -> None:
    storms = Coalescer(window_s=60)
    first = storms.feed(_xid(45), 0.0)
    assert [(r.count, r.repeats) for r in first] == [(1, False)]
    for t in range(1, 1000):
        assert storms.feed(_xid(45), t * 0.05) == []
    assert storms.feed(_xid(45, device="0000:3b:00"), 1.0)  # another GPU: its own
    (tail,) = storms.flush(60.0)
    assert (tail.count, tail.repeats) == (999, True)
    assert storms.flush(61.0) == []  # the other GPU's window ended without repeats
    again = storms.feed(_xid(45), 70.0)
    assert [(r.count, r.repeats) for r in again] == [(1, False)]


def test_an_xid_45_is_counted_with_the_xid_it_names() -> None:
    storms = Coalescer(window_s=60)
    assert storms.feed(_xid(79), 0.0)
    assert storms.feed(_xid(45, caused_by=79), 1.0) == []
    assert storm_key(_xid(45, caused_by=79)) == storm_key(_xid(79))
    (tail,) = storms.flush(60.0)
    assert tail.count == 1


def test_callbacks_suppressed() -> None:
    assert suppressed_callbacks("nvme_log_error: 37 callbacks suppressed") == 37
    assert suppressed_callbacks("nothing here") == 0
