"""Follow metalguard's events over NATS (docs/events.md): one line per event."""

import argparse
import asyncio

import msgspec
import nats
from nats.js.api import DeliverPolicy


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--server", default="nats://127.0.0.1:4222")
    p.add_argument("--subject", default="mg.ctl.>", help="e.g. mg.ctl.*.node.> or mg.evt.>")
    p.add_argument("--all", action="store_true", help="replay what the stream keeps first")
    p.add_argument("--count", type=int, default=0, help="exit 0 after N events")
    p.add_argument("--timeout", type=float, default=None, help="exit 1 after S seconds")
    a = p.parse_args()
    nc = await asyncio.wait_for(nats.connect(a.server), 10)
    policy = DeliverPolicy.ALL if a.all else DeliverPolicy.NEW
    sub = await nc.jetstream().subscribe(a.subject, ordered_consumer=True, deliver_policy=policy)
    print(f"subscribed to {a.subject}", flush=True)
    seen, deadline = 0, a.timeout and asyncio.get_running_loop().time() + a.timeout
    try:
        while not a.count or seen < a.count:
            left = deadline - asyncio.get_running_loop().time() if deadline else 3600
            msg = await sub.next_msg(timeout=max(left, 0.001))  # TimeoutError at the deadline
            event = msgspec.msgpack.decode(msg.data)  # a dict: docs/protocol.md has the fields
            why = (event.get("reasons") or [{}])[0].get("message") or event.get("message")
            node = (event.get("node") or {}).get("node", event.get("region"))
            print(f"{event['type']} {event['kind']} {node}: {why}", flush=True)
            seen += 1
    except (TimeoutError, nats.errors.TimeoutError):
        return 1
    finally:
        await nc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
