"""The rdma collector on a real Soft-RoCE device: a QEMU VM (tests/support/harness/rxe_vm.py)
makes rxe0, runs ibv_rc_pingpong on it and sends its sysfs files three times — idle, after
a pingpong, during an endless one — and the collector's scan reads each tree here.

Skips, with the reason, where QEMU, busybox, iproute2's rdma, ibverbs-utils or the rxe
provider are missing (tests/ensure-tools.sh installs them as root), where no Debian
kernel with rdma_rxe can be had (apt), or where the VM cannot make the device.  The
first run downloads and unpacks the kernel (~70 MB, once: rxe_kernel.cache_root()).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.agent.collectors.rdma import scan_rdma
from metalguard.agent.sysfs import SysfsReader
from metalguard.proto.telemetry import RdmaPort
from tests.support.harness import rxe_kernel, rxe_vm

ITERATIONS = 300
"""Round trips of the first pingpong: each side sends one message per round trip."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("vm")]


def _vm_run(tmp_path: Path) -> rxe_vm.VmRun:
    if (reason := rxe_vm.missing_tools()) is not None:
        pytest.skip(f"Soft-RoCE VM: {reason}")
    try:
        kernel = rxe_kernel.ensure_kernel(rxe_kernel.cache_root())
    except rxe_kernel.NoKernelError as exc:
        pytest.skip(f"Soft-RoCE VM: no kernel with rdma_rxe: {exc}")
    try:
        return rxe_vm.boot(kernel, tmp_path, ITERATIONS)
    except rxe_vm.VmSetupError as exc:
        pytest.skip(f"Soft-RoCE VM: {exc}")


def _port(root: Path) -> RdmaPort:
    ports, errors = scan_rdma(SysfsReader(root))
    assert errors == [], errors
    assert [(p.device, p.port) for p in ports] == [("rxe0", 1)]
    return ports[0]


def test_a_real_rxe_devices_counters_grow_under_traffic(tmp_path: Path) -> None:
    run = _vm_run(tmp_path)
    print(f"Soft-RoCE VM ran {run.wall_s:.1f}s")
    assert run.value("RC") == "pingpong 0 0", run.tail()
    assert set(run.readings) == {"idle", "after", "during"}, run.lines
    idle, after, during = (_port(run.readings[n]) for n in ("idle", "after", "during"))

    for port in (idle, after, during):
        assert (port.state, port.state_id) == ("ACTIVE", 4)
        assert (port.phys_state, port.phys_state_id) == ("LinkUp", 5)
        assert port.link_layer == "Ethernet"
        assert port.netdev == "dum0"
        assert (port.rate_gbps or 0) > 0
        assert port.counters == {}  # no PMA on rxe: its counters are all hw_counters
        assert port.saturated == ()

    def hw(port: RdmaPort, name: str) -> int:
        return port.hw_counters[name]

    # The completed pingpong: every send of both sides, in packets both ways.
    assert hw(after, "rdma_sends") - hw(idle, "rdma_sends") >= 2 * ITERATIONS
    assert hw(after, "rdma_recvs") - hw(idle, "rdma_recvs") >= 2 * ITERATIONS
    for name in ("sent_pkts", "rcvd_pkts"):
        assert hw(after, name) - hw(idle, name) >= 2 * ITERATIONS, name
    # The reading taken while the second pingpong ran (it still did when the reading
    # was sent): the counters moved on from the last one.
    assert run.value("ALIVE") == "yes", run.tail()
    for name in ("sent_pkts", "rcvd_pkts", "rdma_sends"):
        assert hw(during, name) > hw(after, name), name
    for name in ("send_err", "retry_exceeded_err", "retry_rnr_exceeded_err"):
        assert hw(during, name) == hw(idle, name) == 0, name
