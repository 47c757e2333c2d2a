"""One bmc-proxy process polling many simulated SNMP BMCs: targets/s, CPU and RSS.

Three processes, so that each one's cost is its own:

- the simulated BMCs: one Python process running pysnmp's command responder
  (agent/bmc/snmp_responder.py) on one UDP port, one v2c community per BMC, each serving
  the recorded ENTITY-SENSOR-MIB dataset tests/fixtures/snmp/entity-sensor-bmc.snmprec
  (8 sensors, 9 physical entities: 4 GETBULK round trips per read);
- a nats-server with the design's streams;
- ``metalguard agent run`` with N ``[[bmc]]`` targets, ``bmc_proxy.interval_s = 1`` (it
  polls back to back when a cycle takes longer) and its own collectors reduced to edac
  over the fixture sysfs tree.

After a warm-up, for ``--seconds`` it counts the out-of-band batches arriving on NATS
(targets/s) and samples the agent's CPU (utime+stime from /proc/PID/stat) and RSS
(VmRSS, VmHWM); the responder's CPU is printed too (when it is near 100 % of a core the
simulator, not the proxy, is the limit).  Prints figures; asserts nothing.

Usage: python bench/bmc_proxy_bench.py [--targets 200] [--seconds 10]
       [--concurrency 32] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
from nats.aio.msg import Msg

from metalguard.controller.broker.server import NatsServer
from metalguard.controller.state.streams import ensure_streams
from metalguard.proto.codec import decode
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "tests" / "fixtures" / "snmp" / "entity-sensor-bmc.snmprec"
SYSFS = ROOT / "tests" / "fixtures" / "node_exporter" / "sys"
METALGUARD = str(Path(sys.executable).parent / "metalguard")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


async def serve(count: int) -> None:
    """The simulated BMCs: ``count`` communities ``bmc0..`` on one port until stdin closes."""
    from metalguard.agent.bmc.snmp_responder import SnmpResponder, load_snmprec

    records = load_snmprec(DATASET)
    sim = SnmpResponder()
    for i in range(count):
        sim.add_community(f"bmc{i}", records)
    print(f"PORT {sim.port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # late datagrams at shutdown
    sim.close()


def agent_config(path: Path, url: str, prefix: str, port: int, args: argparse.Namespace) -> None:
    """The bmc-proxy agent's config: N targets on the responder's port."""
    targets = "".join(
        f'[[bmc]]\nnode = "bench.c1.n{i:04d}"\naddress = "127.0.0.1:{port}"\n'
        f'protocol = "snmp"\ncommunity = "bmc{i}"\ntimeout_s = 2.0\nretries = 1\n\n'
        for i in range(args.targets)
    )
    path.write_text(
        f'[node]\nregion = "bench"\ncluster = "mgmt"\nname = "proxy1"\nuuid = "bench"\n'
        f'[nats]\nservers = ["{url}"]\nprefix = "{prefix}"\n'
        f'[collect]\ninterval_s = 5\nenabled = ["edac"]\nsysfs = "{SYSFS}"\n'
        f'[spool]\ndir = "{path.parent / "spool"}"\n'
        f"[bmc_proxy]\ninterval_s = 1\nconcurrency = {args.concurrency}\n\n{targets}"
    )


async def measure(args: argparse.Namespace, root: Path, port: int, sim_pid: int) -> None:
    """Start nats-server and the agent, count batches, sample CPU and RSS, print."""
    server = NatsServer(store_dir=root / "js")
    agent: asyncio.subprocess.Process | None = None
    try:
        url = server.start()
        subjects = Subjects("bench")
        nc = await nats.connect(url)
        await ensure_streams(nc.jetstream(), subjects)
        arrivals: list[tuple[float, bool]] = []
        first_cycle = asyncio.Event()

        async def on_batch(msg: Msg) -> None:
            batch = decode(msg.data, TelemetryBatch)
            if batch.out_of_band:
                arrivals.append((time.monotonic(), batch.bmc[0].reachable))
                if len(arrivals) >= args.targets:
                    first_cycle.set()

        await nc.subscribe(subjects.telemetry("bench", "c1", "*"), cb=on_batch)
        config = root / "agent.toml"
        agent_config(config, url, subjects.prefix, port, args)
        agent = await asyncio.create_subprocess_exec(
            METALGUARD,
            "--log-level",
            "warning",
            "agent",
            "run",
            "--config",
            str(config),
            stdin=asyncio.subprocess.DEVNULL,
        )
        try:
            await asyncio.wait_for(first_cycle.wait(), 120)  # warm-up: the first full cycle
        except TimeoutError:
            raise SystemExit(f"only {len(arrivals)} of {args.targets} targets in 120 s") from None
        first_cycle_s = arrivals[args.targets - 1][0] - arrivals[0][0]
        start_n, t0 = len(arrivals), time.monotonic()
        cpu0, sim_cpu0 = cpu_seconds(agent.pid), cpu_seconds(sim_pid)
        rss_samples = []
        while time.monotonic() - t0 < args.seconds:
            await asyncio.sleep(0.5)  # a sampling period, not a wait for something
            rss_samples.append(memory_mib(agent.pid)[0])
        elapsed = time.monotonic() - t0
        cpu = cpu_seconds(agent.pid) - cpu0
        sim_cpu = cpu_seconds(sim_pid) - sim_cpu0
        window = arrivals[start_n:]
        _, hwm = memory_mib(agent.pid)
        await nc.close()
    finally:
        if agent is not None and agent.returncode is None:
            agent.terminate()
            await asyncio.wait_for(agent.wait(), 30)
        server.close()
    rate = len(window) / elapsed
    unreachable = sum(1 for _, ok in window if not ok)
    print(f"machine: {os.cpu_count()} vCPU, Python {sys.version.split()[0]}")
    print(
        f"{args.targets} simulated SNMP v2c BMCs (1 responder process, 1 UDP port), "
        f"concurrency {args.concurrency}, measured {elapsed:.1f} s"
    )
    print(f"first full cycle:          {first_cycle_s:.2f} s")
    print(f"targets/s:                 {rate:.1f} ({unreachable} unreachable readings)")
    print(f"agent CPU:                 {100 * cpu / elapsed:.0f}% of one core")
    print(f"agent CPU per target read: {1000 * cpu / max(len(window), 1):.2f} ms")
    print(
        f"agent RSS:                 {sum(rss_samples) / len(rss_samples):.1f} MiB "
        f"(peak {hwm:.1f} MiB)"
    )
    print(f"responder CPU:             {100 * sim_cpu / elapsed:.0f}% of one core")


def main() -> None:
    """Parse arguments and run the bench (or, with --serve, the simulated BMCs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="20 targets, 3 s")
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    if args.quick:
        args.targets, args.seconds = 20, 3.0
    sim = subprocess.Popen(  # the simulated BMCs, in a process of their own
        [sys.executable, __file__, "--serve", str(args.targets)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sim.stdout is not None
        port = int(sim.stdout.readline().split()[1])
        with tempfile.TemporaryDirectory(prefix="bmc-bench-") as tmp:
            asyncio.run(measure(args, Path(tmp), port, sim.pid))
    finally:
        if sim.stdin is not None:
            sim.stdin.close()
        sim.wait(10)


if __name__ == "__main__":
    main()
