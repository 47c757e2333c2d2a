"""The silence check's cost per tick: a walk over every node against the silence watch.

Usage: python bench/silence_bench.py [--quick] [--nodes 25000,100000] [--ticks 60]

A fleet of N in-service nodes (intervals 30 s; a few stay silent) is checked once a
second for ``--ticks`` seconds while every node sends its batch at its interval (only its
liveness moves, as a steady batch does). Two ways, in one run, on the same fleet:

- walk: ``decide_silence`` over every record each tick (how the controller checked
  before controller/core/silence_watch.py);
- watch: the controller's way now: the nodes that fall due are taken from a
  :class:`SilenceWatch`, ``decide_silence`` looks at those, and the ones heard since are
  watched again at their new time.

Both must find the same silent nodes (checked); the figures are the CPU per tick and the
ratio walk/watch. Pure and in-process: no NATS, no clock but the simulated one.
"""

from __future__ import annotations

import argparse
import time

from msgspec.structs import replace

from metalguard.controller.core.decide import decide_silence
from metalguard.controller.core.lifecycle import LifecycleConfig, silence_due_ts
from metalguard.controller.core.silence_watch import SilenceWatch
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import NodeRecord

T0 = 1_800_000_000.0
INTERVAL_S = 30.0
CFG = LifecycleConfig()
SILENT_EVERY = 997
"""One node in this many stops sending (found UNREACHABLE by both ways)."""


def fleet(nodes: int) -> dict[str, NodeRecord]:
    out = {}
    for i in range(nodes):
        node = NodeIdentity(region="r1", cluster=f"c{i % 40:02d}", node=f"n{i:06d}")
        out[node.handle] = NodeRecord(
            node=node, last_seen_ts=T0 - (i % 30), interval_s=INTERVAL_S, updated_ts=T0
        )
    return out


def run(nodes: int, ticks: int, watched: bool) -> tuple[float, list[int]]:
    """CPU seconds per tick for the checks alone, and the silent count at each tick."""
    records = fleet(nodes)
    handles = list(records)
    watch = SilenceWatch()
    if watched:
        watch.rewatch(records, records, lambda r: silence_due_ts(r, CFG, T0))
    spent = 0.0
    found: list[int] = []
    for tick in range(1, ticks + 1):
        now = T0 + tick
        # each node's batch at its interval: a 30th of the fleet per second
        for i in range(tick % 30, nodes, 30):
            if i % SILENT_EVERY:
                h = handles[i]
                if records[h].grade == "HEALTHY":
                    records[h] = replace(records[h], last_seen_ts=now)
        started = time.process_time()
        if watched:
            due = watch.pop_due(now)
            outcome = decide_silence({h: records[h] for h in due}, now, CFG, watching_since=T0)
            records.update(outcome.records)
            watch.rewatch(due, records, lambda r: silence_due_ts(r, CFG, T0), now=now)
        else:
            outcome = decide_silence(records, now, CFG, watching_since=T0)
            records.update(outcome.records)
        spent += time.process_time() - started
        found.append(len(outcome.records))
    return spent / ticks, found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--nodes", default="25000,100000", help="fleet sizes, comma-separated")
    parser.add_argument("--ticks", type=int, default=150, help="checks, one a second")
    args = parser.parse_args()
    sizes = [2000] if args.quick else [int(n) for n in args.nodes.split(",")]
    ticks = 100 if args.quick else args.ticks
    print(f"silence check once a second over {ticks} s, intervals {INTERVAL_S:g} s, "
          f"1 node in {SILENT_EVERY} silent; limit {CFG.unreachable_after_intervals} "
          f"intervals, at least {CFG.unreachable_after_s:g} s")  # fmt: skip
    print(
        f"{'nodes':>8} {'walk ms/tick':>13} {'watch ms/tick':>14} {'walk/watch':>11} {'silent':>7}"
    )
    for nodes in sizes:
        walk, walk_found = run(nodes, ticks, watched=False)
        watch, watch_found = run(nodes, ticks, watched=True)
        if walk_found != watch_found:
            raise SystemExit(f"the two ways disagree at {nodes} nodes: {walk_found} {watch_found}")
        print(f"{nodes:>8,} {walk * 1e3:>13.2f} {watch * 1e3:>14.3f} {walk / watch:>10.0f}x "
              f"{sum(walk_found):>7}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
