"""The client library's step timing over a real socket pair (docs/workloads.md)."""

from __future__ import annotations

import json
import socket

import pytest

from metalguard.agent.workload.client import WorkloadClient


def test_the_client_sends_its_windows_through_the_socket() -> None:
    here, there = socket.socketpair()
    there.settimeout(5)
    wl = WorkloadClient(here, handle_sigusr1=False, window_s=0.0)
    wl.set_role(1, 0)
    with wl.compute():
        pass
    wl.report_timing(0.25, 0.05)
    wl.report_progress(7)
    wl.close()
    lines = [json.loads(x) for x in there.makefile().read().splitlines()]
    there.close()
    assert lines[0] == {"op": "progress", "step": 7}
    timing = lines[1]
    assert timing["op"] == "timing"
    assert timing["role"] == [1, 0]
    assert timing["compute_s"] >= 0.25
    assert timing["comm_s"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="kind must be one of"):
        WorkloadClient(None).mark_step("lunch")
