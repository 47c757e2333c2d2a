"""The tenant-quota queue pass at fleet scale (controller/jobs/quota.py).

Builds a synthetic fleet (``--nodes`` nodes of 8 GPUs in 16-node racks), six tenants whose
guarantees add up to the fleet, running jobs on 98 % of the nodes (1-8 nodes, 1-8 GPUs
per node, a third preemptible; some tenants borrowing, the others lending) and a queue of
``--queue`` jobs of all tenants (1-16 nodes, priorities 0-2): some start, some reclaim or
preempt inside their tenant, the rest wait. Then times ``--passes`` queue passes
(``schedule_with_quotas`` on a kept index and a kept empty one, each pass's placements
released again after it so that every pass sees the same state):

- ``counted``: the pass counts each tenant's GPUs over every running job and the fleet's
  GPUs over every node (the controller's job manager's call, and the twin's before);
- ``kept``: the same pass given ``TenantHoldings`` kept beside the index (the twin's
  pooled allocation now): no walk over the running jobs or the fleet.

Both decide the same (checked on every pass). Prints CPU ms per pass (medians; the
machine is shared, CPU time is the steadier figure) and the ratio counted / kept,
measured in the same run. ``--twin NODESxDAYS`` (default 512x30; ``--twin ""``: none)
adds a pooled ``metalguard twin run`` of that size (the built-in tenants at
``load_scale`` 1.5) twice: as it runs, and with the pool's holdings left out of each pass
(``counted``); the two reports must be the same.

Usage: python bench/quota_bench.py [--nodes 1000,4000] [--queue 20] [--passes 40]
       [--twin 512x30] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import metalguard.twin
from metalguard import cli
from metalguard.controller.jobs import quota
from metalguard.controller.jobs.quota import TenantHoldings, schedule_with_quotas
from metalguard.controller.jobs.scheduler import (
    FleetIndex,
    FleetNode,
    JobRequest,
    QueuePass,
    RunningJob,
)
from metalguard.proto.tenants import TenantQuota

TENANTS = {"a": 0.3, "b": 0.2, "c": 0.15, "d": 0.15, "e": 0.1, "f": 0.1}
"""Each tenant's share of the fleet's GPUs (its guarantee)."""
LOAD = {"a": 0.6, "b": 1.5, "c": 1.4, "d": 0.7, "e": 1.6, "f": 1.2}
"""What each tenant's running jobs hold, against its guarantee (> 1: it borrows)."""
DEFAULT_TENANTS = Path(metalguard.twin.__file__).with_name("data") / "tenants.toml"


def build(
    nodes: int, queue_len: int, seed: int = 1
) -> tuple[list[FleetNode], list[RunningJob], list[JobRequest], dict[str, TenantQuota]]:
    """The fleet, its running jobs, the queue and the tenants' quotas."""
    rng = random.Random(seed)
    fleet = [
        FleetNode(
            handle=f"r1.c{i // 512}.n{i}",
            region="r1",
            cluster=f"c{i // 512}",
            rack=f"k{i // 16}",
            gpus=8,
            gpu_type="h100",
            cpu_cores=128,
            memory_gb=2048,
        )
        for i in range(nodes)
    ]
    total = 8 * nodes
    quotas = {t: TenantQuota(name=t, gpus=int(share * total)) for t, share in TENANTS.items()}
    want = {t: LOAD[t] * q.gpus for t, q in quotas.items()}
    held = dict.fromkeys(TENANTS, 0)
    running: list[RunningJob] = []
    cursor = 0
    while cursor < int(0.98 * nodes):
        size = rng.choice([1, 1, 1, 2, 4, 8])
        per = rng.choice([1, 2, 4, 8, 8])
        tenant = max(TENANTS, key=lambda t: (want[t] - held[t], t))
        slots = 8 // per  # jobs of this size sharing the same nodes
        hosts = tuple(n.handle for n in fleet[cursor : cursor + size])
        for _ in range(slots):
            j = len(running)
            req = JobRequest(
                f"run{j}",
                nodes=len(hosts),
                tenant=tenant,
                gpus_per_node=per,
                cpu=8,
                priority=rng.choice([0, 0, 1]),
                preemptible=rng.random() < 1 / 3,
            )
            running.append(RunningJob(req, hosts, float(j)))
            held[tenant] += per * len(hosts)
        cursor += size
    queue = [
        JobRequest(
            f"q{i}",
            nodes=rng.choice([1, 1, 2, 4, 8, 16]),
            tenant=rng.choice(sorted(TENANTS)),
            gpus_per_node=rng.choice([1, 2, 4, 8, 8]),
            cpu=8,
            priority=rng.choice([0, 0, 1, 2]),
            submitted_ts=float(i),
        )
        for i in range(queue_len)
    ]
    return fleet, running, queue, quotas


def passes(
    fleet: list[FleetNode],
    running: list[RunningJob],
    queue: list[JobRequest],
    quotas: dict[str, TenantQuota],
    count: int,
    kept: bool,
) -> tuple[list[QueuePass], list[float]]:
    """``count`` passes on kept indexes (with kept holdings or without), each pass's
    placements released afterwards; the decisions and each pass's CPU ms."""
    index, empty = FleetIndex(fleet, running), FleetIndex(fleet)
    holdings = TenantHoldings(fleet, running) if kept else None
    by_id = {r.job_id: r for r in queue}
    decided, cpu = [], []
    for _ in range(count):
        c0 = time.process_time()
        got = schedule_with_quotas(
            queue, (), running, quotas, index=index, empty=empty, holdings=holdings
        )
        cpu.append((time.process_time() - c0) * 1000)
        decided.append(got)
        for p in got.placements:
            index.release(by_id[p.job_id], p.nodes)
            if holdings is not None:
                holdings.release(by_id[p.job_id], p.nodes)
    return decided, cpu


def pass_rows(nodes: int, queue_len: int, count: int) -> list[str]:
    """The counted and kept rows of one fleet size."""
    fleet, running, queue, quotas = build(nodes, queue_len)
    old, old_cpu = passes(fleet, running, queue, quotas, count, kept=False)
    new, new_cpu = passes(fleet, running, queue, quotas, count, kept=True)
    if old != new:
        raise AssertionError("the pass with kept holdings decided otherwise")
    first = new[0]
    counted, kept = statistics.median(old_cpu), statistics.median(new_cpu)
    return [
        f"{nodes:>7,}{len(running):>9,}{len(queue):>7}{counted:>12.2f}{kept:>10.2f}"
        f"{counted / kept:>8.1f}x   {len(first.placements)} placed, "
        f"{len(first.preemptions)} preemptions "
        f"({sum(p.cause == 'reclaim' for p in first.preemptions)} reclaims), "
        f"{len(first.blocked)} blocked"
    ]


def twin_run(nodes: int, days: float, tenants: Path, counted: bool) -> tuple[float, float, str]:
    """One pooled twin run through ``metalguard twin run`` (wall s, CPU s, the report);
    ``counted``: the pool's passes without its kept holdings."""
    real = quota.schedule_with_quotas

    def without(*args: Any, **kwargs: Any) -> QueuePass:
        kwargs.pop("holdings", None)
        return real(*args, **kwargs)

    report = tenants.with_name("report.json")
    argv = ["twin", "run", "--nodes", str(nodes), "--days", str(days), "--allocation", "pooled"]
    argv += ["--tenants", str(tenants), "--report", str(report)]
    if counted:
        quota.schedule_with_quotas = without
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main(argv)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        quota.schedule_with_quotas = real
    if code != 0:
        raise RuntimeError(f"metalguard {' '.join(argv)}: exit status {code}")
    return wall, cpu, report.read_text()


def main() -> int:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000,4000", help="fleet sizes, comma-separated")
    parser.add_argument("--queue", type=int, default=20)
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--twin", default="512x30", help="NODESxDAYS of a pooled twin run")
    parser.add_argument("--quick", action="store_true", help="1,000 nodes, 5 passes, no twin")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.passes, args.twin = "1000", 5, ""
    print(f"{args.passes} passes each, CPU ms per pass (medians)")
    print(f"{'nodes':>7}{'running':>9}{'queue':>7}{'counted ms':>12}{'kept ms':>10}{'ratio':>9}")
    for size in args.nodes.split(","):
        print("\n".join(pass_rows(int(size), args.queue, args.passes)))
    if args.twin:
        n, _, d = args.twin.lower().partition("x")
        with tempfile.TemporaryDirectory() as tmp:
            tenants = Path(tmp, "tenants.toml")
            tenants.write_text("load_scale = 1.5\n" + DEFAULT_TENANTS.read_text())
            now = twin_run(int(n), float(d), tenants, counted=False)
            before = twin_run(int(n), float(d), tenants, counted=True)
        if now[2] != before[2]:
            raise AssertionError("the twin's report differs without the kept holdings")
        print(
            f"twin pooled {n} nodes x {d} days (load_scale 1.5): kept {now[1]:.1f} s CPU "
            f"({now[0]:.1f} s wall), counted {before[1]:.1f} s CPU ({before[0]:.1f} s wall): "
            f"{before[1] / now[1]:.2f}x, the same report"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
