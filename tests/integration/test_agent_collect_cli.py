"""``metalguard agent collect --once``: the JSON contract, text output, broken input, exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.support.harness.agent_proc import FIXTURE_SMART, FIXTURE_SYSFS, METALGUARD

TOP_LEVEL = {"node", "seq", "ts", "edac", "pcie", "hwmon", "smart", "rdma", "errors"}
PCIE_KEYS = {
    "address", "class", "vendor", "device", "current_link_speed_gts", "max_link_speed_gts",
    "current_link_width", "max_link_width", "downgraded", "retrains", "aer",
}  # fmt: skip
SMART_KEYS = {
    "device", "protocol", "model", "passed", "temperature_c", "power_on_hours",
    "critical_warning", "media_errors", "percentage_used", "available_spare",
    "reallocated_sectors", "pending_sectors", "offline_uncorrectable",
    "reported_uncorrectable", "grown_defects",
}  # fmt: skip
RDMA_KEYS = {
    "device", "port", "state", "state_id", "phys_state", "phys_state_id", "rate_gbps",
    "link_layer", "netdev", "board_id", "fw_ver", "hca_type", "counters", "counters_ext",
    "hw_counters", "device_hw_counters", "saturated", "rx_bytes", "tx_bytes",
}  # fmt: skip
NO_PMA = "not a counter: 'N/A (no PMA)'"
"""i40iw0's counters in node_exporter's tree: each one an error entry (docs/collectors.md)."""


def collect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [METALGUARD, "agent", "collect", "--once", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_json_contract_over_the_fixture_tree() -> None:
    result = collect(
        "--sysfs", str(FIXTURE_SYSFS), "--smart-json-dir", str(FIXTURE_SMART), "--format", "json"
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc.keys() >= TOP_LEVEL
    mc = doc["edac"][0]
    assert {"mc", "ce_count", "ue_count", "ce_noinfo_count", "ue_noinfo_count"} <= mc.keys()
    assert (mc["mc"], mc["ce_count"], mc["ue_count"]) == (0, 1, 5)
    assert {"dimms", "csrows"} <= mc.keys()
    row = mc["csrows"][0]
    assert {"csrow", "ce_count", "ue_count", "channels"} <= row.keys()
    assert {"channel", "label", "ce_count", "ue_count"} <= row["channels"][0].keys()
    nvme = next(d for d in doc["pcie"] if d["address"] == "0000:01:00.0")
    assert nvme.keys() >= PCIE_KEYS
    assert nvme["downgraded"] is True
    assert set(nvme["aer"]) == {"correctable", "fatal", "nonfatal"}
    chip = next(c for c in doc["hwmon"] if c["fans"])
    assert {"chip", "name", "fans", "temps"} <= chip.keys()
    assert {"sensor", "label", "rpm", "min_rpm", "alarm"} <= chip["fans"][0].keys()
    temps = next(c for c in doc["hwmon"] if c["temps"])["temps"][0]
    assert {"sensor", "label", "celsius", "crit_celsius", "max_celsius"} <= temps.keys()
    assert len(doc["smart"]) == len(list(FIXTURE_SMART.glob("*.json")))
    for disk in doc["smart"]:
        assert disk.keys() >= SMART_KEYS
    ports = {(p["device"], p["port"]): p for p in doc["rdma"]}
    assert list(ports) == [("i40iw0", 1), ("mlx4_0", 1), ("mlx4_0", 2)]
    for port in ports.values():
        assert port.keys() >= RDMA_KEYS
    mlx4 = ports["mlx4_0", 1]
    assert (mlx4["state"], mlx4["phys_state"], mlx4["rate_gbps"]) == ("ACTIVE", "LinkUp", 40.0)
    assert mlx4["counters"]["port_xmit_wait"] == 4294967295
    assert mlx4["saturated"] == ["port_xmit_wait"]
    # The only errors: the fixture's "N/A (no PMA)" counter files, one entry each.
    assert doc["errors"], "i40iw0's N/A (no PMA) counters must be error entries"
    for error in doc["errors"]:
        assert (error["collector"], error["message"]) == ("rdma", NO_PMA), error
        assert "/class/infiniband/i40iw0/ports/1/counters/" in error["path"]


def test_text_format() -> None:
    result = collect("--sysfs", str(FIXTURE_SYSFS), "--collectors", "pcie", "--format", "text")
    assert result.returncode == 0, result.stderr
    assert "0000:01:00.0" in result.stdout
    assert "DOWNGRADED" in result.stdout

    rdma = collect("--sysfs", str(FIXTURE_SYSFS), "--collectors", "rdma", "--format", "text")
    assert rdma.returncode == 0, rdma.stderr
    lines = [line for line in rdma.stdout.splitlines() if line.startswith("rdma ")]
    assert lines == [
        "rdma  i40iw0/1 ACTIVE LinkUp 10 Gb/s InfiniBand netdev=- link_downed=- "
        "link_error_recovery=- symbol_error=- port_rcv_errors=-",
        "rdma  mlx4_0/1 ACTIVE LinkUp 40 Gb/s InfiniBand netdev=- link_downed=0 "
        "link_error_recovery=0 symbol_error=- port_rcv_errors=0  SATURATED port_xmit_wait",
        "rdma  mlx4_0/2 ACTIVE LinkUp 40 Gb/s InfiniBand netdev=- link_downed=0 "
        "link_error_recovery=0 symbol_error=- port_rcv_errors=-",
    ]


def _broken_tree(root: Path) -> Path:
    sysfs = root / "sys"
    mc = sysfs / "devices/system/edac/mc/mc0"
    mc.mkdir(parents=True)
    (mc / "ce_count").write_text("garbage\n")
    (mc / "ue_count").write_text("")
    (mc / "ce_noinfo_count").mkdir()  # a directory where a file should be
    (mc / "ue_noinfo_count").write_text("7\n")
    with (mc / "size_mb").open("wb") as f:  # a 10 MB attribute
        f.truncate(10 * 1024 * 1024)
    hwmon = sysfs / "class/hwmon/hwmon0"
    hwmon.mkdir(parents=True)
    (hwmon / "name").write_text("nct6779\n")
    (hwmon / "fan1_input").write_text("1200\n")
    (hwmon / "fan2_input").write_text("x\n")
    os.mkfifo(hwmon / "temp1_input")  # would block a naive reader forever
    (hwmon / "temp2_input").write_text("45000\n")
    pci = sysfs / "bus/pci/devices"
    pci.mkdir(parents=True)
    (pci / "0000:00:01.0").symlink_to("../../../devices/pci0000:00/0000:00:01.0")  # dangling
    return sysfs


def test_broken_tree_gives_errors_keeps_the_rest_and_exits_0(tmp_path: Path) -> None:
    sysfs = _broken_tree(tmp_path)
    result = collect("--sysfs", str(sysfs), "--collectors", "edac,hwmon,pcie,smart")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    mc = doc["edac"][0]
    assert mc["ue_noinfo_count"] == 7
    assert mc["ce_count"] is None
    assert mc["ue_count"] is None
    chip = doc["hwmon"][0]
    assert [(f["sensor"], f["rpm"]) for f in chip["fans"]] == [("fan1", 1200.0), ("fan2", None)]
    assert [(t["sensor"], t["celsius"]) for t in chip["temps"]] == [
        ("temp1", None),
        ("temp2", 45.0),
    ]
    failed = {(e["collector"], Path(e["path"]).name) for e in doc["errors"] if e["path"]}
    assert ("edac", "ce_count") in failed
    assert ("edac", "ce_noinfo_count") in failed
    assert ("hwmon", "fan2_input") in failed
    # SMART has no disks here and smartctl may be absent: either way an entry, not a crash
    assert {r["collector"] for r in doc["collectors"]} == {"edac", "hwmon", "pcie", "smart"}


def test_bad_config_and_unknown_collector_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "agent.toml"
    bad.write_text("[collect]\nsysfs = 3\n")
    result = collect("--config", str(bad))
    assert result.returncode == 2
    assert f"{bad}: collect.sysfs: Expected `str`, got `int`" in result.stderr
    result = collect("--collectors", "edac,nosuch")
    assert result.returncode == 2
    assert "unknown collector(s) nosuch" in result.stderr


def test_dataset_caches_in_json_and_text(tmp_path: Path) -> None:
    """``[[cache.datasets]]``: each one's stats.json in the batch's ``cache`` list; one
    whose cache is not running is there with its config and an error naming its file."""
    warm_dir, cold_dir = tmp_path / "warm", tmp_path / "cold"
    warm_dir.mkdir()
    stats = {"dataset": "imagenet", "ts": time.time(), "max_bytes": 1000, "used_bytes": 700,
             "hits": 3, "misses": 1, "policy": "pin", "mountpoint": "/mnt/imagenet"}  # fmt: skip
    (warm_dir / "stats.json").write_text(json.dumps(stats))
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[[cache.datasets]]\nname = "imagenet"\nsource = "/nfs/imagenet"\n'
        f'cache_dir = "{warm_dir}"\nmax_bytes = 1000\nmountpoint = "/mnt/imagenet"\n\n'
        f'[[cache.datasets]]\nname = "coco"\nsource = "http://u:pw@store/coco"\n'
        f'cache_dir = "{cold_dir}"\nmax_bytes = 500\n'
    )
    result = collect("--config", str(config), "--collectors", "cache", "--format", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    warm, cold = doc["cache"]
    assert {k: warm[k] for k in stats} == stats
    assert {"bytes_from_cache", "bytes_from_source", "evictions", "dataset_bytes"} <= warm.keys()
    assert (cold["dataset"], cold["source"], cold["ts"]) == ("coco", "http://store/coco", 0.0)
    (error,) = doc["errors"]
    assert (error["collector"], error["path"]) == ("cache", str(cold_dir / "stats.json"))
    assert "not running" in error["message"]
    text = collect("--config", str(config), "--collectors", "cache", "--format", "text")
    assert text.returncode == 0, text.stderr
    assert "cache imagenet: 700/1000 B in 0 files, hits 3 misses 1 (75%)" in text.stdout
    assert "cache coco: not running (max 500 B)" in text.stdout
