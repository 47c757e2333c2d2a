"""The ``netdev`` collector: pure parsing of ethtool and tc readings, and the collector's
own checks (a fake sysfs tree with a fake ethtool, and real veth interfaces as root:
tests/integration/test_netdev_collector.py)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from metalguard.agent.collectors.base import CollectorSettings
from metalguard.agent.collectors.netdev import (
    ClassLabel,
    NetdevCollector,
    _raw,
    _Sysfs,
    interface,
    leaf_marks,
)
from metalguard.agent.collectors.netdev_parse import (
    classid,
    ecn_marks,
    parse_ethtool_stats,
    pause_counters,
    pause_totals,
    selected,
)
from metalguard.proto.telemetry import TcClassStats
from tests.support.ethtool_samples import MLX5, VETH

# --- pure -----------------------------------------------------------------------------


def test_ethtool_counters_and_pause_totals() -> None:
    stats = parse_ethtool_stats(MLX5)
    assert stats["rx_packets"] == 1234
    assert stats["rx_discards_phy"] == 3
    pause = pause_counters(stats)
    assert set(pause) == {
        "rx_prio3_pause",
        "rx_prio3_pause_duration",
        "rx_prio3_pause_transition",
        "tx_prio3_pause",
        "rx_prio4_pause",
        "rx_pause_ctrl_phy",
        "tx_pause_ctrl_phy",
    }
    assert pause_totals(pause) == (100, 5)  # the PHY counters win: no double counting

    per_prio = {k: v for k, v in pause.items() if "ctrl_phy" not in k}
    assert pause_totals(per_prio) == (100, 5)  # 70 + 30; durations and transitions skipped
    assert pause_totals({"rx_pause": 8, "tx_global_pause": 2}) == (8, 2)
    assert pause_totals({"rx_prio3_pause_duration": 5}) == (None, None)


def test_no_stats_means_no_counters() -> None:
    assert parse_ethtool_stats("no stats available\n") == {}
    assert parse_ethtool_stats("") == {}
    veth = parse_ethtool_stats(VETH)
    assert veth["peer_ifindex"] == 2
    assert pause_counters(veth) == {}
    assert pause_totals({}) == (None, None)


def test_classid_is_hex_like_tc() -> None:
    assert classid(0x10010) == "1:10"
    assert classid(0x10001) == "1:1"
    assert classid(0xFFFF0000) == "ffff:0"


def test_ecn_marks_of_red_fq_codel_and_others() -> None:
    red = struct.pack("=4I", 1, 2, 3, 44)
    assert ecn_marks("red", red) == 44
    assert ecn_marks("choke", struct.pack("=5I", 0, 0, 0, 7, 9)) == 7
    fq_codel = struct.pack("=5I", 0, 1500, 0, 12, 3)
    assert ecn_marks("fq_codel", fq_codel) == 12
    assert ecn_marks("fq_codel", struct.pack("=5I", 1, 0, 0, 12, 0)) is None  # class stats
    assert ecn_marks("pfifo", red) is None
    assert ecn_marks("red", b"\x00\x01") is None
    assert ecn_marks("red", None) is None


def test_raw_xstats_forms() -> None:
    packed = struct.pack("=4I", 0, 0, 0, 5)
    assert _raw(packed) == packed
    assert _raw(packed.hex(":")) == packed  # how pyroute2 shows an attribute it cannot decode
    assert _raw("not hex") is None
    assert _raw(None) is None
    assert ecn_marks("red", _raw(packed.hex())) == 5
    assert leaf_marks("red", packed.hex(":")) == 5
    assert leaf_marks("fq_codel", {"maxpacket": 1500, "ecn_mark": 9}) == 9  # pyroute2 decoded
    assert leaf_marks("choke", {"early": 1, "marked": 4}) == 4
    assert leaf_marks("htb", {"lends": 1}) is None
    assert leaf_marks("pfifo", None) is None


def test_interface_selection() -> None:
    assert selected("eth0", (), ("lo",))
    assert not selected("lo", (), ("lo",))
    assert selected("ens1f0np0", ("ens*", "eth*"), ())
    assert not selected("veth12ab", ("ens*",), ())
    assert not selected("veth12ab", (), ("lo", "veth*"))


def test_interface_labels_lossless_classes() -> None:
    sysfs = _Sysfs("eth0", {"rx_dropped": 4, "tx_errors": 1}, True)
    classes = [TcClassStats(classid="1:10", drops=3), TcClassStats(classid="1:20", drops=1)]
    got = interface(
        sysfs,
        parse_ethtool_stats(MLX5),
        classes,
        {"1:10": ClassLabel("training", lossless=True)},
        ("1:20",),
    )
    assert (got.rx_dropped, got.tx_errors, got.rx_bytes) == (4, 1, None)
    assert (got.rx_pause, got.tx_pause) == (100, 5)
    assert [(c.name, c.lossless, c.drops) for c in got.tc_classes] == [
        ("training", True, 3),
        ("", True, 1),
    ]


# --- the collector's checks, no tree needed ---------------------------------------------


async def test_no_net_directory_is_no_data(tmp_path: Path) -> None:
    result = await NetdevCollector(CollectorSettings(sysfs=tmp_path)).collect()
    assert (result.items, result.errors) == ((), ())


def test_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"netdev\.ethtool"):
        NetdevCollector(CollectorSettings(sysfs=tmp_path, options={"netdev.ethtool": "some"}))
    with pytest.raises(ValueError, match=r"netdev\.exclude"):
        NetdevCollector(CollectorSettings(sysfs=tmp_path, options={"netdev.exclude": [1]}))
