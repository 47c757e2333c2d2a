# ruff: noqa: E501  (real kernel log lines are kept whole)
"""The kernel log monitor's speed (docs/kmsg.md, docs/benchmarks.md "Kernel log").

Usage: python bench/kmsg_bench.py [--quick] [--lines 200] [--burst 10000] [--idle-s 20]

(a) latency, root only: a line written to /dev/kmsg (the agent trusts user records here)
    -> the agent's NodeEvent as a subscriber of the controller's event subject receives
    it, p50 / p99 over ``--lines`` lines at a 1 s agent interval, each naming its own
    device (no storm coalescing). The baseline, same run: the agent's collection interval
    (1 s), the most a polled sysfs counter waits before its cycle reads it.
(b) CPU of a burst: ``--burst`` real-looking records through the agent's path (parse,
    classify by the shipped rules, storms, counts), against parsing them only: CPU
    seconds and the ratio.
(c) idle cost, root only: two agent processes for ``--idle-s`` seconds, the kernel log
    monitor on and off, their CPU (utime + stime) while the kernel log is quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metalguard.agent.kmsg.record import parse_record
from metalguard.agent.kmsg.source import KmsgSource
from metalguard.proto.base import NodeIdentity

DEVKMSG = Path("/dev/kmsg")
RATELIMIT = Path("/proc/sys/kernel/printk_devkmsg")
LINES = (
    "NVRM: Xid (PCI:0000:2b:00): 13, pid=1234, name=python3, Graphics Exception: ESR 0x405848=0x3e000000",
    "INFO: task kworker/u16:2:123 blocked for more than 120 seconds.",
    "EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm ls: reading directory lblock 0",
    "pcieport 0000:00:01.0: AER: Corrected error received: 0000:01:00.0",
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "nvme nvme0: I/O 123 QID 4 timeout, reset controller",
    "e1000e: eth0 NIC Link is Up 1000 Mbps Full Duplex, Flow Control: Rx/Tx",
    'audit: type=1400 audit(1700000000.000:42): apparmor="STATUS" operation="profile_load"',
)


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process (this one when None)."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def burst(n: int) -> tuple[float, float]:
    """CPU seconds of ``n`` records through the agent's path, and through parsing only."""
    records = [
        f"{3 + (i % 4)},{i + 1},{1_000_000 + i},-;{LINES[i % len(LINES)]}".replace(
            "sda1", f"sd{i % 26}"
        )
        for i in range(n)
    ]

    async def emit(_event: object) -> None:
        return None

    with tempfile.TemporaryDirectory() as tmp:
        source = KmsgSource(
            lambda: NodeIdentity(region="r1", cluster="c1", node="bench"),
            emit,
            Path(tmp) / "none",
        )
        start = cpu_s()
        parsed = [parse_record(r) for r in records]
        parse_only = cpu_s() - start
        start = cpu_s()
        source._on_records([parse_record(r) for r in records])
        full = cpu_s() - start
        assert source.counts().records == n
    return full, parse_only if parsed else 0.0


def write_config(path: Path, nats_url: str, spool: Path, node: str, *, kmsg: bool) -> None:
    path.write_text(
        f"""
[node]
region = "r1"
cluster = "c1"
name = "{node}"

[nats]
servers = ["{nats_url}"]
prefix = "mgbench"

[collect]
interval_s = 1.0
enabled = ["cache"]

[spool]
dir = "{spool}"

[kmsg]
enabled = {"true" if kmsg else "false"}
trust_user_records = true
backfill_s = 0
"""
    )


async def latency(lines: int, idle_s: float) -> None:
    import nats
    from nats.aio.msg import Msg

    from metalguard.controller.broker.server import NatsServer
    from metalguard.controller.state.streams import ensure_streams
    from metalguard.proto.codec import decode
    from metalguard.proto.events import NodeEvent
    from metalguard.proto.subjects import Subjects

    server = NatsServer()
    url = server.start()
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            tag = uuid.uuid4().hex[:6]
            arrived: dict[str, float] = {}
            every = asyncio.Event()
            nc = await nats.connect(url)
            await ensure_streams(nc.jetstream(timeout=5), Subjects("mgbench"))

            async def on_event(msg: Msg) -> None:
                event = decode(msg.data, NodeEvent)
                arrived.setdefault(event.device, time.monotonic())
                if len(arrived) >= lines:
                    every.set()

            await nc.subscribe(f"mgbench.evt.r1.c1.bench{tag}.>", cb=on_event)
            for node, on in ((f"bench{tag}", True), (f"idle{tag}", False)):
                config = root / f"{node}.toml"
                write_config(config, url, root / node, node, kmsg=on)
                argv = [sys.executable, "-m", "metalguard", "agent", "run", "--config", str(config)]
                with (root / f"{node}.log").open("w") as log:
                    procs.append(await asyncio.create_subprocess_exec(*argv, stderr=log))
            await asyncio.sleep(5)  # both agents up, the reader at the end of the log
            cpu0 = [cpu_s(p.pid) for p in procs]
            await asyncio.sleep(idle_s)
            idle = [cpu_s(p.pid) - c for p, c in zip(procs, cpu0, strict=True)]
            written: dict[str, float] = {}
            fd = os.open(DEVKMSG, os.O_WRONLY)
            try:
                for i in range(lines):
                    device = f"mg{tag}{i}"
                    written[device] = time.monotonic()
                    os.write(fd, f"<3>EXT4-fs error (device {device}): bench {i}\n".encode())
                    await asyncio.sleep(0.05)
            finally:
                os.close(fd)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await every.wait()
            await nc.close()
            if len(arrived) < lines:
                print((root / f"bench{tag}.log").read_text()[-2000:], file=sys.stderr)
            got = sorted(arrived[d] - written[d] for d in written if d in arrived)
            print(f"(a) latency over {len(got)} of {lines} lines (agent interval 1 s):")
            if got:
                p99 = got[min(len(got) - 1, int(0.99 * len(got)))]
                p50 = statistics.median(got)
                print(
                    f"    p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {got[-1] * 1000:.1f} ms"
                )
                print(f"    p99 / the 1 s interval a polled counter waits: {p99 / 1.0:.3f}")
            print(
                f"(c) idle CPU over {idle_s:g} s: kmsg on {idle[0]:.3f} s, off {idle[1]:.3f} s "
                f"({(idle[0] - idle[1]) / idle_s * 100:+.2f} % of a core)"
            )
    finally:
        for p in procs:
            p.terminate()
            await p.wait()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small numbers (a smoke test)")
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--burst", type=int, default=10_000)
    parser.add_argument("--idle-s", type=float, default=20.0)
    args = parser.parse_args()
    if args.quick:
        args.lines, args.burst, args.idle_s = 20, 2000, 2.0
    full, parse_only = burst(args.burst)
    print(
        f"(b) a burst of {args.burst:,} records: {full:.3f} s CPU through the agent's path "
        f"(parse, rules, storms, counts), {parse_only:.3f} s parsing only "
        f"({full / max(parse_only, 1e-9):.1f}x); goal <= 1 s for 10,000"
    )
    if os.geteuid() == 0 and os.access(DEVKMSG, os.W_OK) and RATELIMIT.exists():
        before = RATELIMIT.read_text().strip()
        RATELIMIT.write_text("on\n")  # user writes to /dev/kmsg not rate-limited
        try:
            asyncio.run(latency(args.lines, args.idle_s))
        finally:
            RATELIMIT.write_text(before + "\n")
    else:
        print("(a), (c): need root and a writable /dev/kmsg: skipped")


if __name__ == "__main__":
    main()
