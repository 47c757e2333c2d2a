"""``metalguard demo``: the one command a newcomer runs.

First form: an embedded nats-server with the design's streams and buckets, its URL
printed, running until Ctrl-C / SIGINT / SIGTERM (or ``--duration``), then a clean stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import nats

from controller.natsserver import NatsServer
from controller.streams import ensure_streams
from proto.subjects import Subjects


def _say(line: str) -> None:
    print(f"metalguard demo: {line}", flush=True)


async def run_demo(*, duration_s: float | None = None, prefix: str = "mg") -> int:
    """Run the demo until a stop signal or the duration; return the exit status."""
    subjects = Subjects(prefix)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = NatsServer()
    try:
        _say("starting nats-server (JetStream)")
        url = await asyncio.to_thread(server.start)
        nc = await asyncio.wait_for(nats.connect(url, max_reconnect_attempts=1), 10)
        try:
            await ensure_streams(nc.jetstream(), subjects)
        finally:
            await nc.close()
        _say(
            f"streams {subjects.stream_telemetry}, {subjects.stream_events}, "
            f"{subjects.stream_control} and KV buckets ready"
        )
        _say(f"NATS at {url}")
        _say("running; press Ctrl-C to stop")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), duration_s)
        _say("stopping")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await asyncio.to_thread(server.close)
    _say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(run_demo()))
