"""The ``netdev`` collector over a fake sysfs tree with a fake ethtool, and (as root) over
real veth interfaces with htb classes in network namespaces (the pure parsing:
tests/unit/test_netdev.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import msgspec
import pytest

from metalguard.agent.collectors.base import Collected, CollectorSettings
from metalguard.agent.collectors.netdev import NetdevCollector
from metalguard.controller.core.scoring.engine import assess
from metalguard.proto.codec import decode_json
from metalguard.proto.telemetry import NetInterface, TelemetryBatch
from tests.support.ethtool_samples import MLX5

METALGUARD = Path(sys.executable).parent / "metalguard"


# --- a fake sysfs tree and a fake ethtool ------------------------------------------------

STATS = {
    "rx_bytes": "1000\n",
    "tx_bytes": "2000\n",
    "rx_packets": "10\n",
    "tx_packets": "20\n",
    "rx_dropped": "3\n",
    "tx_dropped": "0\n",
    "rx_errors": "1\n",
    "tx_errors": "0\n",
}


def fake_tree(root: Path) -> Path:
    net = root / "class" / "net"
    for name, stats in (
        ("eth0", STATS),
        ("eth1", {**STATS, "rx_dropped": "lots\n"}),
        ("lo", STATS),
        ("veth1", {"rx_bytes": "5\n"}),
    ):
        (net / name / "statistics").mkdir(parents=True)
        for file, text in stats.items():
            (net / name / "statistics" / file).write_text(text)
    devices = root / "devices" / "pci0000:00" / "0000:41:00.0"
    devices.mkdir(parents=True)
    (net / "eth0" / "device").symlink_to(devices)
    (net / "bonding_masters").write_text("bond0\n")
    return root


def fake_ethtool(tmp_path: Path) -> Path:
    """Answers ``ethtool -S eth0`` like a ConnectX NIC and the rest like ethtool 6.1 does
    for an interface without statistics (exit 94)."""
    script = tmp_path / "ethtool"
    (tmp_path / "mlx5.txt").write_text(MLX5)
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = -S ] && [ "$2" = eth0 ] && exec cat {tmp_path / "mlx5.txt"}\n'
        'echo "no stats available"; exit 94\n'
    )
    script.chmod(0o755)
    return script


def nets(result: Collected) -> list[NetInterface]:
    assert all(isinstance(i, NetInterface) for i in result.items)
    return cast(list[NetInterface], list(result.items))


async def test_collector_over_a_fake_tree(tmp_path: Path) -> None:
    root = fake_tree(tmp_path / "sys")
    settings = CollectorSettings(
        sysfs=root,
        options={"netdev.ethtool": "devices", "netdev.ethtool_path": str(fake_ethtool(tmp_path))},
    )
    result = await NetdevCollector(settings).collect()
    by_name = {i.name: i for i in nets(result)}
    assert sorted(by_name) == ["eth0", "eth1", "veth1"]  # lo excluded, files skipped
    eth0 = by_name["eth0"]
    assert (eth0.rx_bytes, eth0.tx_packets, eth0.rx_dropped, eth0.rx_errors) == (1000, 20, 3, 1)
    assert (eth0.rx_pause, eth0.tx_pause) == (100, 5)  # eth0 has a device: ethtool asked
    assert eth0.tc_classes == ()  # a fake root: the live kernel's tc is not read
    assert by_name["eth1"].rx_dropped is None
    assert by_name["eth1"].rx_pause is None  # no device behind it
    assert by_name["veth1"].rx_bytes == 5
    assert by_name["veth1"].tx_bytes is None  # missing file: no value, no error
    assert [(e.path.endswith("eth1/statistics/rx_dropped"), e.message) for e in result.errors] == [
        (True, "not a counter: 'lots'")
    ]

    every = CollectorSettings(
        sysfs=root,
        options={
            "netdev": {"ethtool": "all", "exclude": ["lo", "veth*"]},
            "netdev.ethtool_path": str(fake_ethtool(tmp_path)),
        },
    )
    result = await NetdevCollector(every).collect()
    names = [(i.name, i.rx_pause) for i in nets(result)]
    assert names == [("eth0", 100), ("eth1", None)]  # exit 94: no counters, no error

    missing = CollectorSettings(
        sysfs=root, options={"netdev.ethtool": "all", "netdev.ethtool_path": "no-such-ethtool"}
    )
    result = await NetdevCollector(missing).collect()
    assert all(i.pause == {} for i in nets(result))


# --- real veth in network namespaces (root) ----------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 (network namespaces, veth, tc)",
)

TRAINING_TOS = 26 << 2  # DSCP 26 (AF31), the RoCE class of the test
STARVED_TOS = 46 << 2  # DSCP 46 (EF), into the starved class
PACKETS = 40
NETDEV_JSON = ("--collectors", "netdev", "--format", "json")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def netns_pair() -> Iterator[tuple[str, str]]:
    """Namespaces A and B joined by veth mgt0 (A, 10.77.0.1) -- mgt1 (B, 10.77.0.2); on
    mgt0 an htb: 1:10 for DSCP 26 (u32), 1:30 for DSCP 46 starved (8 kbit, a 2-packet
    pfifo: it drops), 1:20 the default. Both namespaces go away even on failure."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"mgt-nd-a-{tag}", f"mgt-nd-b-{tag}"
    _ip("netns", "add", a)
    try:
        _ip("netns", "add", b)
        try:
            _ip("-n", a, "link", "add", "mgt0", "type", "veth", "peer", "name", "mgt1", "netns", b)
            _ip("-n", a, "addr", "add", "10.77.0.1/24", "dev", "mgt0")
            _ip("-n", b, "addr", "add", "10.77.0.2/24", "dev", "mgt1")
            _ip("-n", a, "link", "set", "mgt0", "up")
            _ip("-n", b, "link", "set", "mgt1", "up")
            tc = ["ip", "netns", "exec", a, "tc"]
            for cmd in (
                "qdisc add dev mgt0 root handle 1: htb default 20",
                "class add dev mgt0 parent 1: classid 1:1 htb rate 1gbit",
                "class add dev mgt0 parent 1:1 classid 1:10 htb rate 500mbit ceil 1gbit",
                "class add dev mgt0 parent 1:1 classid 1:20 htb rate 400mbit ceil 1gbit",
                "class add dev mgt0 parent 1:1 classid 1:30 htb rate 8kbit ceil 8kbit",
                "qdisc add dev mgt0 parent 1:30 handle 30: pfifo limit 2",
                "filter add dev mgt0 parent 1: protocol ip prio 1 u32 "
                "match ip dsfield 0x68 0xfc flowid 1:10",
                "filter add dev mgt0 parent 1: protocol ip prio 2 u32 "
                "match ip dsfield 0xb8 0xfc flowid 1:30",
            ):
                subprocess.run([*tc, *cmd.split()], check=True, capture_output=True, timeout=10)
            yield a, b
        finally:
            subprocess.run(["ip", "netns", "del", b], capture_output=True, timeout=10)
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True, timeout=10)


SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(sys.argv[1]))
for _ in range(int(sys.argv[2])):
    s.sendto(b"x" * 100, ("10.77.0.2", 9))
"""


def _collect(namespace: str, config: Path) -> TelemetryBatch:
    """``metalguard agent collect`` of the netdev collector inside ``namespace``."""
    inside = ("ip", "netns", "exec", namespace)
    result = subprocess.run(
        [*inside, str(METALGUARD), "agent", "collect", "--config", str(config), *NETDEV_JSON],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return decode_json(result.stdout, TelemetryBatch)


@pytest.mark.root
@needs_root
def test_real_veth_counters_tc_classes_and_scoring(
    netns_pair: tuple[str, str], tmp_path: Path
) -> None:
    a, _b = netns_pair
    config = tmp_path / "agent.toml"
    config.write_text(
        '[collect.options]\n"netdev.lossless_classes" = ["1:10", "1:30"]\n'
        '"netdev.ethtool" = "all"\n'
    )
    before = _collect(a, config)

    def send(tos: int, count: int) -> None:
        cmd = ["ip", "netns", "exec", a, sys.executable, "-c", SEND, str(tos), str(count)]
        subprocess.run(cmd, check=True, timeout=30)

    send(0, 5)  # the first packet resolves the neighbour: the default class first
    send(TRAINING_TOS, PACKETS)
    send(STARVED_TOS, PACKETS)
    batch = _collect(a, config)

    assert batch.errors == ()
    assert [n.name for n in batch.net] == ["mgt0"]  # lo excluded; namespace A's sysfs
    mgt0 = batch.net[0]
    assert mgt0.tx_packets is not None
    assert mgt0.tx_packets >= PACKETS + 5
    assert (mgt0.tx_dropped, mgt0.rx_errors) == (0, 0)  # tc drops are not the device's
    assert (mgt0.rx_pause, mgt0.tx_pause, mgt0.pause) == (None, None, {})  # veth: none
    classes = {c.classid: c for c in mgt0.tc_classes}
    assert set(classes) == {"1:1", "1:10", "1:20", "1:30"}
    training, default, starved = classes["1:10"], classes["1:20"], classes["1:30"]
    assert (training.packets, training.drops, training.kind) == (PACKETS, 0, "htb")
    assert training.bytes >= PACKETS * 100
    assert default.packets >= 5  # the DSCP 0 datagrams (and ARP)
    assert (training.lossless, starved.lossless, default.lossless) == (True, True, False)
    assert starved.drops > 0
    assert starved.overlimits > 0
    assert PACKETS - 2 <= starved.packets + starved.drops <= PACKETS  # 2 may wait queued
    assert training.ecn_marks is None  # no RED leaf: nothing marks

    # the controller's network rules judge the real readings: drops in a lossless class
    later = msgspec.structs.replace(batch, seq=before.seq + 1, ts=before.ts + 60)
    signals, _ = assess(None, before)
    _, assessment = assess(signals, later)
    rules = {(f.reason.rule, f.reason.signal) for f in assessment.findings}
    assert rules == {("tc_lossless_drops", "network.lossless_drops")}
    (finding,) = assessment.findings
    assert finding.reason.message.startswith(f"lossless class 1:30 on mgt0: {starved.drops} drops")
