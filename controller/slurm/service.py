"""``metalguard slurm-bridge --config FILE``: the bridge as a process (systemd).

Connect (bounded), attach the durable consumer to ``<P>_CONTROL`` (the controller's
``controller setup`` creates the streams), then run until SIGTERM or SIGINT.  Exit
status: 0 after a clean stop, 1 when NATS or the control stream is unreachable, 2 for a
bad config.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError

from metalguard.controller.config import ConfigError
from metalguard.controller.service import connect_options
from metalguard.controller.slurm.bridge import SlurmBridge
from metalguard.controller.slurm.config import load_bridge_config
from metalguard.controller.slurm.runner import SlurmRunner
from metalguard.controller.slurm.tools import SlurmTools
from metalguard.proto.subjects import Subjects
from metalguard.runtime.deadlines import within


async def run_bridge(config_path: Path) -> int:
    """Run until SIGTERM/SIGINT; the exit status."""
    try:
        cfg = load_bridge_config(config_path)
        options = connect_options(cfg.nats)
    except (ConfigError, ValueError) as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    options["name"] = "metalguard-slurm-bridge"
    subjects = Subjects(cfg.nats.prefix)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            nc: Client = await within(nats.connect(**options), cfg.nats.connect_deadline_s)
        except (TimeoutError, OSError, NatsError):
            print(f"metalguard: cannot connect to {', '.join(cfg.nats.servers)}", file=sys.stderr)
            return 1
        try:
            js = nc.jetstream(timeout=cfg.nats.publish_timeout_s)
            tools = SlurmTools(SlurmRunner(cfg.slurm), cfg.slurm.output)
            bridge = SlurmBridge(js, subjects, cfg, tools)
            try:
                await bridge.start()
            except NatsError as exc:  # the streams are the controller's (controller setup)
                print(
                    f"metalguard: cannot attach to {subjects.stream_control}: {exc}",
                    file=sys.stderr,
                )
                return 1
            print(f"metalguard: slurm bridge for region {cfg.region} running", file=sys.stderr)
            await stop.wait()
            await bridge.stop()
            return 0
        finally:
            await nc.close()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
