"""bench/proto_bench.py runs and prints its figures (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# A deadline for a hang, not a speed check: a bench child on a busy host takes minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "proto_bench.py"


def run_quick(script: Path | str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a bench script to its end (its output captured); it must exit 0."""
    result = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


ROW = re.compile(
    r"^(msgpack|json|stdlib json)\s+(encode|decode)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)x$"
)


def test_proto_bench_quick_prints_the_table() -> None:
    result = run_quick(str(BENCH), "--quick", timeout_s=60)
    out = result.stdout
    assert "8 GPUs, 16 DIMMs, 12 PCIe (full AER), 10 disks, 12 fans" in out

    rows = {(m.group(1), m.group(2)): m for line in out.splitlines() if (m := ROW.match(line))}
    expected = {(c, op) for c in ("msgpack", "json", "stdlib json") for op in ("encode", "decode")}
    assert set(rows) == expected, out
    for m in rows.values():
        assert int(m.group(3).replace(",", "")) > 0, "msg/s"
        assert int(m.group(4).replace(",", "")) > 1000, "bytes per message of a full batch"
    assert float(rows["json", "encode"].group(5)) == 1.0, "JSON is the baseline"
    assert rows["msgpack", "encode"].group(4) == rows["msgpack", "decode"].group(4)
    assert int(rows["msgpack", "encode"].group(4).replace(",", "")) < int(
        rows["json", "encode"].group(4).replace(",", "")
    ), "msgpack is the smaller encoding"
    assert re.search(r"^encode: msgpack/JSON = [\d.]+x", out, re.M)
    assert re.search(r"^decode: msgpack/JSON = [\d.]+x", out, re.M)


AGENT_BENCH = BENCH.parent / "agent_bench.py"


def test_agent_bench_quick_prints_figures() -> None:
    result = run_quick(str(AGENT_BENCH), "--quick", timeout_s=120)
    rows = {
        m.group(1): (float(m.group(2)), float(m.group(4)), int(m.group(5)))
        for line in result.stdout.splitlines()
        if (
            m := re.match(r"^(metalguard [\w+()]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$", line)
        )
    }
    assert set(rows) == {
        "metalguard edac+pcie+hwmon",
        "metalguard edac+hwmon",
        "metalguard edac+pcie+hwmon+smart(json)",
    }, result.stdout
    for cpu_ms, rss_mib, items in rows.values():
        assert cpu_ms > 0
        assert rss_mib > 0
        assert items > 0
    assert "node_exporter" in result.stdout  # its row, or why there is no ratio


def test_fleet_bench_quick_prints_figures() -> None:
    result = run_quick(str(BENCH.parent / "fleet_bench.py"), "--quick", timeout_s=120)
    assert re.search(r"^10 agents @ 1 s", result.stdout, re.M), result.stdout
    assert re.search(r"CPU of this process: \d+% of one core", result.stdout)
    match = re.search(r"batches stored/s:\s+([\d.]+) \(ideal 10\.0", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) > 0


def test_ingest_bench_quick_prints_figures() -> None:
    result = run_quick(str(BENCH.parent / "ingest_bench.py"), "--quick", timeout_s=120)
    out = result.stdout
    assert re.search(r"^machine: \d+ vCPU", out, re.M), out
    rates = {
        m.group(1): float(m.group(2).replace(",", ""))
        for line in out.splitlines()
        if (
            m := re.match(
                r"^(raw nats-py|1 controller|2 controller)\D.*?\s([\d,]+)\s+[\d.]+x$", line
            )
        )
    }
    assert set(rates) == {"raw nats-py", "1 controller", "2 controller"}, out
    assert all(rate > 0 for rate in rates.values())
    assert re.search(r"^controller/raw = [\d.]+ \(goal >= 0\.7: (met|missed)\)", out, re.M)
    assert "handled per process: [400, 200, 200] (handler errors: 0)" in out
    steady = {
        m.group(1): float(m.group(2).replace(",", ""))
        for line in out.splitlines()
        if (m := re.match(r"^(\d) controller process(?:es)? \(nodes known\)\s+([\d,]+)\s", line))
    }
    assert set(steady) == {"1", "2"}, out
    assert all(rate > 0 for rate in steady.values())
    assert re.search(r"^steady controller/raw = [\d.]+ \(goal >= 0\.7: (met|missed)\)", out, re.M)
    assert "steady handled per process: [400, 200, 200] (handler errors: 0)" in out
    row = re.search(
        r"^\s*(\d+)/(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$", out, re.M
    )
    assert row, out
    assert row.group(1) == row.group(2) == "20", "every failing node isolated"
    assert re.search(r"^p99 fault-to-isolation = [\d.]+ s \(goal <= 1 s: (met|missed)\)", out, re.M)
    per_node = re.findall(
        r"^\s+[\d,]+ (?:one hardware|each node|own EDAC).*\s([\d.]+)\s+[\d.]+$", out, re.M
    )
    assert len(per_node) == 4, out  # 200 and 400 nodes, then the two other fleets at 200
    assert re.search(
        r"^controller memory per node = [\d.]+ KiB at most, one hardware model "
        r"\(goal <= 8 KiB: (met|missed)\)",
        out,
        re.M,
    )


def test_bmc_proxy_bench_quick_prints_figures() -> None:
    result = run_quick(str(BENCH.parent / "bmc_proxy_bench.py"), "--quick", timeout_s=120)
    out = result.stdout
    assert re.search(r"^20 simulated SNMP v2c BMCs", out, re.M), out
    rate = re.search(r"^targets/s:\s+([\d.]+) \((\d+) unreachable readings\)", out, re.M)
    assert rate, out
    assert float(rate.group(1)) > 0
    assert rate.group(2) == "0"
    assert re.search(r"^agent CPU:\s+\d+% of one core", out, re.M)
    assert re.search(r"^agent RSS:\s+[\d.]+ MiB \(peak [\d.]+ MiB\)", out, re.M)


SCHEDULER_BENCH = BENCH.parent / "scheduler_bench.py"


def test_scheduler_bench_quick_places_the_gang() -> None:
    result = run_quick(str(SCHEDULER_BENCH), "--quick", timeout_s=60)
    steps = {
        m.group(1): float(m.group(3))
        for line in result.stdout.splitlines()
        if (m := re.match(r"^(index|place|pass|preempt)\s+([\d.]+)\s+([\d.]+)\b", line))
    }
    assert set(steps) == {"index", "place", "pass", "preempt"}, result.stdout
    assert re.search(r"^preempt .*\(1 run: [1-9]\d* victims\)$", result.stdout, re.M)
    assert re.search(
        r"^gang of 256 nodes placed at level \w+ in [\d.]+ ms CPU", result.stdout, re.M
    )


STORE_LOAD_BENCH = BENCH.parent / "store_load_bench.py"


def test_store_load_bench_quick_prints_its_ratios() -> None:
    """The bench checks what it loaded (every value; a shard's records only) and exits
    non-zero otherwise; here its lines and ratios are read back."""
    result = run_quick(str(STORE_LOAD_BENCH), "--quick", "--single", timeout_s=110)
    out = result.stdout
    assert "bucket: 1,000 records + 1,000 scoring histories written" in out
    assert re.search(r"^per key \(baseline\): [\d.]+ s for 2,000 keys", out, re.M), out
    assert re.search(r"per key/whole [\d.]+x$", out, re.M), out
    assert re.search(
        r"^a shard's share \(10 of 40 clusters\): [\d.]+ s; per key/shard [\d.]+x$", out, re.M
    ), out


SILENCE_BENCH = BENCH.parent / "silence_bench.py"
SILENCE_ROW = re.compile(r"^\s*([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)x\s+(\d+)$")


def test_silence_bench_quick_prints_both_ways_and_their_ratio() -> None:
    # it exits non-zero if the two ways disagree
    result = run_quick(SILENCE_BENCH, "--quick", timeout_s=120)
    rows = [m for line in result.stdout.splitlines() if (m := SILENCE_ROW.match(line))]
    assert len(rows) == 1, result.stdout
    nodes, walk, watch, _ratio, silent = rows[0].groups()
    assert nodes == "2,000"
    assert float(walk) > 0
    assert float(watch) > 0
    assert int(silent) > 0, "no node fell silent: the check was not exercised"


KMSG_BENCH = BENCH.parent / "kmsg_bench.py"


@pytest.mark.xdist_group("kmsg")  # it writes to /dev/kmsg and sets printk_devkmsg, as root
def test_kmsg_bench_quick_prints_figures() -> None:
    out = run_quick(str(KMSG_BENCH), "--quick", timeout_s=180).stdout
    assert re.search(r"^\(b\) a burst of 2,000 records: [\d.]+ s CPU .* \([\d.]+x\)", out, re.M), (
        out
    )
    if "(a), (c): need root" not in out:
        assert re.search(r"^\(a\) latency over 20 of 20 lines", out, re.M), out
        assert re.search(r"p50 [\d.]+ ms, p99 [\d.]+ ms", out), out
        assert re.search(r"^\(c\) idle CPU over 2 s: kmsg on [\d.]+ s, off [\d.]+ s", out, re.M), (
            out
        )
