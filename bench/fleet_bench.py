"""How many simulated agents one process carries: CPU and batches per second.

Starts its own nats-server (loopback, temp dir), runs a SimFleet of N real agents over
generated sysfs trees in this process for a measurement window, and prints the CPU used
(share of one core) and the batches stored per second beside the ideal rate (N / interval),
the baseline measured in the same run.

Usage: python bench/fleet_bench.py [--agents 60] [--interval 1.0] [--seconds 10] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import nats

from metalguard.controller.broker.server import NatsServer
from metalguard.controller.state.streams import ensure_streams
from metalguard.demo.sim.fleet import SimFleet
from metalguard.proto.subjects import Subjects


async def _stored(js: nats.js.JetStreamContext, subjects: Subjects) -> int:
    info = await js.stream_info(subjects.stream_telemetry)
    return int(info.state.messages)


async def measure(agents: int, interval_s: float, window_s: float, root: Path) -> None:
    """Run the fleet and print its figures."""
    server = NatsServer(store_dir=root / "js")
    url = await asyncio.to_thread(server.start)
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        subjects = Subjects("bench")
        await ensure_streams(js, subjects)
        racks = max(1, agents // 10)
        per_rack = -(-agents // racks)
        fleet = SimFleet(
            root / "fleet", url, racks=racks, nodes_per_rack=per_rack,
            interval_s=interval_s, prefix=subjects.prefix,
        )  # fmt: skip
        async with fleet:
            deadline = time.monotonic() + 60
            while await _stored(js, subjects) < len(fleet.node_names):
                if time.monotonic() > deadline:
                    raise RuntimeError("the fleet did not publish its first batches in 60 s")
                await asyncio.sleep(0.2)  # warm-up: every agent's first batch
            n0, cpu0, wall0 = await _stored(js, subjects), time.process_time(), time.monotonic()
            await asyncio.sleep(window_s)  # the measurement window
            n1, cpu, wall = (
                await _stored(js, subjects),
                time.process_time() - cpu0,
                time.monotonic() - wall0,
            )
        ideal = len(fleet.node_names) / interval_s
        print(f"{len(fleet.node_names)} agents @ {interval_s:g} s, {wall:.1f} s window")
        print(f"  CPU of this process: {cpu / wall:.0%} of one core")
        print(f"  batches stored/s:    {(n1 - n0) / wall:.1f} (ideal {ideal:.1f}, "
              f"ratio {(n1 - n0) / wall / ideal:.2f})")  # fmt: skip
    finally:
        await nc.close()
        await asyncio.to_thread(server.close)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=60)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="10 agents for 3 s (smoke)")
    args = parser.parse_args()
    agents, window = (10, 3.0) if args.quick else (args.agents, args.seconds)
    with tempfile.TemporaryDirectory(prefix="mg-fleet-bench-") as tmp:
        asyncio.run(measure(agents, args.interval, window, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
