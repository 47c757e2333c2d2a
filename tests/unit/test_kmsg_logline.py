"""Kernel log lines as dmesg, syslog and the journal write them (``kmsg scan --input
text``, metalguard/agent/kmsg/logline.py): the prefixes are the real ones the fixtures'
sources showed (tests/fixtures/kmsg/*.txt, each block's comment names the prefix it
stripped), put back in front of every real line: the message and its class come out the
same."""

from __future__ import annotations

import json

import pytest

from metalguard.agent.kmsg.logline import USER_FACILITY, parse_line
from metalguard.agent.kmsg.rules import Finding, Ignored, match, shipped_rules
from tests.support.kmsg_lines import cases

CASES = cases()

# (prefix as the fixture's source showed it, its time since boot in µs or None)
REAL_PREFIXES = [
    ("[6781741.548768] ", 6781741548768),  # gpu.txt: dmesg quoted in gpud's docs
    ("[Sun Feb 23 16:24:18 2025] ", None),  # gpu.txt: dmesg --ctime
    ("kern  :warn  : 2025-01-21T04:41:44,283302+00:00 ", None),  # dmesg --decode, iso
    ("Dec  2 11:38:47 worker4 kernel: [  219.470994] ", 219470994),  # gpu-operator#1146
    ("Nov 29 11:28:11 zeus kernel: ", None),  # dxvk#1799, journal
    ("kwi 15 07:56:59 testowy kernel: ", None),  # open-gpu-kernel-modules#1045, Polish month
    ("Feb 23 03:28:16 kernel: ", None),  # memory.txt: syslog without the host
    ("<4>[ 1126.635824] ", 1126635824),  # gpud's pstore dmesg.txt (the priority, raw)
    ("kernel: ", None),  # open-gpu-kernel-modules#1150, journal lines
]


def _kind(found: Finding | Ignored | None) -> str | None:
    return found.kind if isinstance(found, Finding) else None


@pytest.mark.parametrize(("prefix", "mono_us"), REAL_PREFIXES, ids=[p for p, _ in REAL_PREFIXES])
def test_every_real_line_behind_a_real_prefix_is_classified_as_without_it(
    prefix: str, mono_us: int | None
) -> None:
    rules = shipped_rules()
    wrong = []
    for where, text, _ in CASES:
        record = parse_line(prefix + text, 7)
        assert record is not None
        if record.text != text or _kind(match(record, rules)) != _kind(
            match(parse_line(text, 7), rules)  # type: ignore[arg-type]
        ):
            wrong.append((where, record.text))
        assert record.from_kernel, (where, prefix)
        assert record.seq == 7
        if mono_us is not None:
            assert record.ts_us == mono_us
    assert not wrong, wrong[:5]


def test_the_raw_priority_and_dmesg_x_levels_are_kept() -> None:
    raw = parse_line("<3>[  12.500000] EXT4-fs (sda1): Remounting filesystem read-only", 1)
    assert raw is not None
    assert (raw.facility, raw.level, raw.ts_us) == (0, 3, 12_500_000)
    decoded = parse_line("kern  :err   : [  12.500000] EXT4-fs (sda1): Remounting", 1)
    assert decoded is not None
    assert (decoded.facility, decoded.level) == (0, 3)
    user = parse_line("user  :notice: [  13.000000] EXT4-fs (sda1): Remounting", 1)
    assert user is not None
    assert not user.from_kernel


def test_a_line_another_program_logged_is_not_the_kernels() -> None:
    record = parse_line("Dec  2 11:38:47 worker4 myapp[42]: GPU has fallen off the bus", 1)
    assert record is not None
    assert record.facility == USER_FACILITY
    assert record.text == "GPU has fallen off the bus"


def test_a_message_that_looks_like_a_tag_is_not_taken_for_one() -> None:
    """After a kernel tag the message's own ``word:`` stays the message."""
    for line in (
        "Feb 23 03:28:16 kernel: mce: [Hardware Error]: Machine check events logged",
        "2025-01-21T04:41:44,283302+00:00 mlx5_core 0000:3b:00.0: mlx5_cmd_check:810: x",
    ):
        record = parse_line(line, 1)
        assert record is not None, line
        assert record.from_kernel, line
        assert record.text.startswith(("mce:", "mlx5_core")), record.text


def test_journal_json_entries() -> None:
    kernel = {
        "MESSAGE": "NVRM: Xid (PCI:0000:2b:00): 79, pid='<unknown>', name=<unknown>, GPU has "
        "fallen off the bus.",
        "PRIORITY": "4",
        "SYSLOG_FACILITY": "0",
        "_TRANSPORT": "kernel",
        "__MONOTONIC_TIMESTAMP": "219470994",
        "_KERNEL_DEVICE": "+pci:0000:2b:00.0",
        "_KERNEL_SUBSYSTEM": "pci",
    }
    record = parse_line(json.dumps(kernel), 3)
    assert record is not None
    assert record.from_kernel
    assert (record.level, record.ts_us, record.device) == (4, 219470994, "0000:2b:00.0")
    found = match(record, shipped_rules())
    assert isinstance(found, Finding)
    assert (found.kind, found.xid) == ("gpu_xid", 79)
    stdout = {"MESSAGE": "GPU has fallen off the bus", "_TRANSPORT": "stdout", "PRIORITY": "6"}
    assert not parse_line(json.dumps(stdout), 4).from_kernel  # type: ignore[union-attr]
    # a message journald kept as bytes (not UTF-8)
    as_bytes = {"MESSAGE": list(b"EXT4-fs (sda1): Remounting filesystem read-only\xff"),
                "_TRANSPORT": "kernel"}  # fmt: skip
    record = parse_line(json.dumps(as_bytes), 5)
    assert record is not None
    assert record.text.startswith("EXT4-fs (sda1): Remounting")


def test_blank_lines_are_nothing_and_anything_else_a_message() -> None:
    assert parse_line("", 1) is None
    assert parse_line("   \r\n", 1) is None
    assert parse_line("{not json", 1).text == "{not json"  # type: ignore[union-attr]
    assert parse_line('{"no": "message"}', 1).text == '{"no": "message"}'  # type: ignore[union-attr]
